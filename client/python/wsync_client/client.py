"""Trainer and Coordinator: Python faces of the wsync C API."""

import contextlib
import ctypes
import json

from . import _lib
from .errors import FAILED_PRECONDITION, INVALID_ARGUMENT, WsyncError

# Element sizes of the dtype names the daemon accepts (base/dtype.h); used to check arrays before they are sent.
DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
    "int32": 4, "int64": 8, "uint8": 1,
}
_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
            "double": "float64", "fp8": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn"}

# proto3 JSON writes 64-bit integers as strings; these fields come back as Python ints.
_INT64_FIELDS = {"version", "plan_epoch", "membership_epoch", "bytes", "params", "started_unix_ms"}


def _canonical_dtype(name):
    n = str(name)
    if n.startswith("torch."):
        n = n[len("torch."):]
    n = _ALIASES.get(n, n)
    if n not in DTYPE_SIZES:
        raise WsyncError(INVALID_ARGUMENT, "unsupported dtype %r (one of %s)" % (name, ", ".join(sorted(DTYPE_SIZES))))
    return n


def _ints(obj):
    if isinstance(obj, dict):
        return {k: (int(v) if k in _INT64_FIELDS and isinstance(v, str) and v.lstrip("-").isdigit() else _ints(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ints(v) for v in obj]
    return obj


def _check(rc):
    if rc != 0:
        raise WsyncError(rc, _lib.lib().wsync_last_error().decode("utf-8", "replace"))


def _is_torch_tensor(x):
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "element_size")


def _describe(name, array, dtype):
    """(dtype name, shape tuple, data pointer, byte count, keep-alive object) of a numpy array or torch tensor.

    No copy for a contiguous CPU array/tensor: the C library copies the bytes once, into the ring.
    """
    if _is_torch_tensor(array):
        t = array
        if t.device.type != "cpu":
            raise WsyncError(INVALID_ARGUMENT, "tensor %s is on %s; push CPU or CUDA tensors" % (name, t.device))
        if not t.is_contiguous():
            t = t.contiguous()  # the ring takes dense row-major bytes
        # data_ptr() does not care about the element type, so bfloat16 needs no numpy round trip.
        dt = _canonical_dtype(dtype if dtype is not None else t.dtype)
        if DTYPE_SIZES[dt] != t.element_size():
            raise WsyncError(INVALID_ARGUMENT, "tensor %s: dtype %s has %d-byte elements, the tensor (%s) %d"
                             % (name, dt, DTYPE_SIZES[dt], t.dtype, t.element_size()))
        return dt, tuple(t.shape), t.data_ptr(), t.numel() * t.element_size(), t

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - only without numpy
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: push needs a numpy array or a torch tensor, got %s"
                         % (name, type(array).__name__))
    if not isinstance(array, np.ndarray):
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: push needs a numpy array or a torch tensor, got %s"
                         % (name, type(array).__name__))
    a = np.ascontiguousarray(array)  # no copy when already C-contiguous
    if dtype is not None:
        dt = _canonical_dtype(dtype)
    elif a.dtype.name in DTYPE_SIZES or a.dtype.name in _ALIASES:  # includes ml_dtypes' bfloat16
        dt = _canonical_dtype(a.dtype.name)
    elif a.dtype == np.uint16:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s is uint16: pass dtype='bfloat16' (or 'float16') to say what "
                         "its bits are" % name)
    else:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: numpy dtype %s has no wsync equivalent" % (name, a.dtype))
    if DTYPE_SIZES[dt] != a.itemsize:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: dtype %s has %d-byte elements, the array (%s) %d"
                         % (name, dt, DTYPE_SIZES[dt], a.dtype, a.itemsize))
    return dt, a.shape, a.ctypes.data, a.nbytes, a


class _Handle:
    """Owns one C handle: closed by close(), on leaving a `with` block, or when collected."""

    _close_fn = ""   # name of the C function that releases the handle
    _what = ""       # for the error raised after close

    _h = None

    def _handle(self):
        if self._h is None:
            raise WsyncError(FAILED_PRECONDITION, self._what + " is closed")
        return self._h

    def close(self):
        """Releases the handle. Idempotent."""
        if self._h is not None:
            h, self._h = self._h, None
            getattr(_lib.lib(), self._close_fn)(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Trainer(_Handle):
    """One trainer rank's session with its node's source wsyncd.

        with Trainer("127.0.0.1:7601", local_rank=0, global_rank=0) as t:
            for name in t.begin_push(version):
                t.push(name, weights[name])            # numpy array, CPU or CUDA torch tensor
            t.end_push(version)

    A Trainer is used by one thread at a time. Calls block (with the GIL released) until the daemon answers.
    """

    _close_fn = "wsync_trainer_close"
    _what = "trainer session"

    def __init__(self, daemon, local_rank=0, global_rank=0, bucket_bytes=0, timeout=120.0):
        self._h = None
        self._cuda_keep = []  # CUDA tensors whose device-to-host copies may still be running
        lib = _lib.lib()
        h = ctypes.c_void_p()
        _check(lib.wsync_trainer_connect(daemon.encode(), int(local_rank), int(global_rank), int(bucket_bytes),
                                         float(timeout), ctypes.byref(h)))
        self._h = h
        self.daemon = daemon


    def begin_push(self, version):
        """Opens this rank's part of update `version`; returns the names of the tensors this rank must push."""
        buf = ctypes.c_void_p()
        count = ctypes.c_size_t()
        _check(_lib.lib().wsync_trainer_begin_push(self._handle(), int(version), ctypes.byref(buf),
                                                    ctypes.byref(count)))
        text = _lib.take_string(buf.value)
        return text.split("\n") if count.value else []

    def push(self, name, array, dtype=None):
        """Copies one tensor into the ring. `dtype` overrides the array's own (needed for bfloat16 bits held in a
        numpy uint16 array: push(name, bits, dtype="bfloat16"))."""
        if _is_torch_tensor(array) and array.device.type == "cuda":
            return self._push_cuda(name, array, dtype)
        # `_keep` holds a contiguous copy (if one was needed) alive until the bytes are in the ring.
        dt, shape, ptr, nbytes, _keep = _describe(name, array, dtype)
        c_shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        _check(_lib.lib().wsync_trainer_push(self._handle(), name.encode(), dt.encode(), c_shape, len(shape),
                                             ctypes.c_void_p(ptr), int(nbytes)))

    def push_slice(self, name, array, full_shape, offsets, dtype=None):
        """Pushes a slice of HF tensor `name` (whole shape `full_shape`): `array` (host or CUDA) is the slice, its
        shape the extents, starting at `offsets` — a range along dim 0 (row ranges, whole experts) or any rectangle
        of a 2-D tensor. The node's daemon assembles the tensor from the slices its ranks push."""
        full_shape = [int(d) for d in full_shape]
        offsets = [int(o) for o in offsets]
        extents = [int(d) for d in array.shape]
        if "|" in name or len(full_shape) != len(offsets) or len(extents) != len(full_shape):
            raise WsyncError(INVALID_ARGUMENT, "slice of %s: offsets %s / extents %s do not match shape %s"
                             % (name, offsets, extents, full_shape))
        # The wire form is a name (base/tensor_slice.h); the daemon checks the ranges and names the tensor.
        frame = "%s|slice|%s|%s" % (name, "x".join(map(str, full_shape)), ",".join(map(str, offsets)))
        return self.push(frame, array, dtype)

    def push_slices(self):
        """The slices the last begin_push asked this rank to push (shard-aware plans), as dicts with name, shape,
        offsets, extents (row/column ranges: take `t[o0:o0+e0, o1:o1+e1]` and push_slice it)."""
        buf = ctypes.c_void_p()
        count = ctypes.c_size_t()
        _check(_lib.lib().wsync_trainer_push_slices(self._handle(), ctypes.byref(buf), ctypes.byref(count)))
        text = _lib.take_string(buf.value)
        out = []
        for line in (text.split("\n") if count.value else []):
            name, shape, offsets, extents = line.split("|")
            out.append({"name": name, "shape": [int(x) for x in shape.split("x")],
                        "offsets": [int(x) for x in offsets.split(",")],
                        "extents": [int(x) for x in extents.split(",")]})
        return out

    def _push_cuda(self, name, t, dtype):
        """A torch CUDA tensor: one asynchronous device-to-host copy into the ring, ordered after the work queued on
        the tensor's device's current stream. The tensor is kept alive until the next flush/end_push (the copy may
        still be reading it); do not modify it in place before then."""
        if not t.is_contiguous():
            raise WsyncError(INVALID_ARGUMENT, "tensor %s on %s is not contiguous (shape %s, strides %s); push "
                             "t.contiguous()" % (name, t.device, tuple(t.shape), tuple(t.stride())))
        dt = _canonical_dtype(dtype if dtype is not None else t.dtype)
        if DTYPE_SIZES[dt] != t.element_size():
            raise WsyncError(INVALID_ARGUMENT, "tensor %s: dtype %s has %d-byte elements, the tensor (%s) %d"
                             % (name, dt, DTYPE_SIZES[dt], t.dtype, t.element_size()))
        import torch
        device = t.device.index if t.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
        shape = tuple(t.shape)
        c_shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        _check(_lib.lib().wsync_trainer_push_cuda(self._handle(), name.encode(), dt.encode(), c_shape, len(shape),
                                                  ctypes.c_void_p(t.data_ptr()), int(t.numel() * t.element_size()),
                                                  int(device), int(stream)))
        self._cuda_keep.append(t)

    def push_many(self, named_tensors, names=None, dtype=None):
        """Pushes every `(name, tensor)` of an iterable that this rank must push — what `model.state_dict().items()`,
        `model.named_parameters()` or an FSDP/DTensor `full_tensor()` loop yields. `names` is the push filter
        (the list begin_push returned); tensors outside it are skipped without being touched (a generator's
        `full_tensor()` is never called for them only if the caller checks names first). Raises WsyncError
        (INVALID_ARGUMENT) naming the filter's tensors the iterable did not yield, after pushing the others.
        Returns {"pushed": n, "skipped": [names not in the filter]}."""
        wanted = set(names) if names is not None else None
        pushed, skipped = set(), []
        for item in named_tensors:
            try:
                name, tensor = item
            except (TypeError, ValueError):
                raise WsyncError(INVALID_ARGUMENT, "push_many needs (name, tensor) pairs, got %r" % (item,))
            if wanted is not None and name not in wanted:
                skipped.append(name)
                continue
            if name in pushed:
                raise WsyncError(INVALID_ARGUMENT, "tensor %s is yielded twice" % name)
            self.push(name, tensor, dtype=dtype)
            pushed.add(name)
        if wanted is not None and pushed != wanted:
            missing = sorted(wanted - pushed)
            raise WsyncError(INVALID_ARGUMENT, "%d tensors of this rank's push filter were not yielded: %s%s"
                             % (len(missing), ", ".join(missing[:8]), " ..." if len(missing) > 8 else ""))
        return {"pushed": len(pushed), "skipped": skipped}

    def push_update(self, version, named_tensors, dtype=None):
        """begin_push(version), push_many over the filter it returns, end_push(version): one rank's whole part of
        an update. Returns push_many's result."""
        names = self.begin_push(version)
        result = self.push_many(named_tensors, names=names, dtype=dtype)
        self.end_push(version)
        return result

    def flush(self):
        """Commits the current bucket and waits until the daemon took everything committed so far."""
        _check(_lib.lib().wsync_trainer_flush(self._handle()))
        self._cuda_keep = []

    def end_push(self, version):
        """Flushes, then tells the daemon this rank is done with `version`."""
        _check(_lib.lib().wsync_trainer_end_push(self._handle(), int(version)))
        self._cuda_keep = []

    def stats(self):
        """{'tensors', 'bytes', 'buckets'} pushed since the last begin_push."""
        v = [ctypes.c_uint64() for _ in range(3)]
        _check(_lib.lib().wsync_trainer_stats(self._handle(), *[ctypes.byref(x) for x in v]))
        return {"tensors": v[0].value, "bytes": v[1].value, "buckets": v[2].value}



class Coordinator(_Handle):
    """Client of the coordinator API: drives updates and reads cluster status and history."""

    _close_fn = "wsync_coordinator_close"
    _what = "coordinator client"

    def __init__(self, endpoint, dial_timeout=5.0):
        """`endpoint`: "host:port", or several coordinators sharing one etcd state store, as "a:1,b:2" or a list;
        calls go to the leader and follow a fail-over (docs/operations.md, "High availability (etcd)")."""
        self._h = None
        if isinstance(endpoint, (list, tuple)):
            endpoint = ",".join(endpoint)
        h = ctypes.c_void_p()
        _check(_lib.lib().wsync_coordinator_open(endpoint.encode(), float(dial_timeout), ctypes.byref(h)))
        self._h = h
        self.endpoint = endpoint


    def _json_call(self, fn, *args):
        buf = ctypes.c_void_p()
        _check(fn(self._handle(), *args, ctypes.byref(buf)))
        return _ints(json.loads(_lib.take_string(buf.value) or "{}"))

    def begin_update(self, version, pause_mode=""):
        """Pauses every engine and opens update `version`; returns the reply (plan_epoch, pause_seconds, ...)."""
        return self._json_call(_lib.lib().wsync_coordinator_begin_update, int(version),
                               (pause_mode or "").encode())

    def commit_update(self, version, timeout=120.0):
        """Waits for every source, post-processes and resumes the engines; returns the update record as a dict.
        A failed update raises WsyncError with code ABORTED (10): the engines stay paused at their old version
        until an update succeeds; history() then shows its record with success False."""
        return self._json_call(_lib.lib().wsync_coordinator_commit_update, int(version), float(timeout))

    @contextlib.contextmanager
    def update(self, version, pause_mode="", timeout=120.0):
        """Opens update `version`, runs the body (the trainer ranks push), then commits it; when the body raises, the
        update is aborted (engines stay paused at their old version) and the exception propagates. Yields the
        BeginUpdate reply.

            with coordinator.update(7):
                ... every rank pushes version 7 ...
        """
        reply = self.begin_update(version, pause_mode)
        try:
            yield reply
        except BaseException as exc:
            try:
                self.abort_update(version, "%s: %s" % (type(exc).__name__, exc))
            except WsyncError as abort_err:  # keep the body's exception; say why the abort failed too
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note("aborting update %d failed as well: %s" % (int(version), abort_err))
            raise
        self.last_record = self.commit_update(version, timeout)

    def abort_update(self, version, reason=""):
        """Closes the open update `version` without committing it: sources stop taking its pushes and finish the
        writes in flight; it is recorded as aborted. The engines stay paused at their old version. Returns a dict
        with the record, bytes_written (bytes of it that reached the engines) and engines_resumable."""
        return self._json_call(_lib.lib().wsync_coordinator_abort_update, int(version), str(reason).encode())

    def resume_engines(self):
        """Resumes paused engines at their current version; raises WsyncError (FAILED_PRECONDITION) while they may
        hold partial writes of a failed or aborted update."""
        return self._json_call(_lib.lib().wsync_coordinator_resume_engines)

    def status(self):
        """Cluster status: nodes, epochs, current version, state, plan."""
        return self._json_call(_lib.lib().wsync_coordinator_status)

    def history(self, limit=0):
        """The most recent `limit` update records (0: all the coordinator keeps), oldest first."""
        return self._json_call(_lib.lib().wsync_coordinator_history, int(limit)).get("records", [])

