"""Trainer: one trainer rank's session with its node's source wsyncd, in pure Python.

The session opens on the daemon's local trainer socket: the daemon checks this process's uid/gid (SO_PEERCRED) and
hands over the ring's memfd (SCM_RIGHTS) with a session id; the rank's RPCs (TrainerIngest) go to a second local
socket the daemon names. Tensors are copied once, straight into the shared-memory ring.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import struct
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import grpc

from ._proto.wsync.v1 import trainer_pb2, trainer_pb2_grpc
from ._ring import DTYPE_SIZES, RingProducer
from .errors import (DATA_LOSS, DEADLINE_EXCEEDED, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND,
                     PERMISSION_DENIED, UNAVAILABLE, WsyncError, from_rpc_error)

DEFAULT_SOCKET = "/run/wsync/wsyncd.sock"
PROTOCOL = 1
_MAX_ANSWER = 64 * 1024

_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
            "double": "float64", "fp8": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn"}


def canonical_dtype(name: Any) -> str:
    n = str(name)
    if n.startswith("torch."):
        n = n[len("torch."):]
    n = _ALIASES.get(n, n)
    if n not in DTYPE_SIZES:
        raise WsyncError(INVALID_ARGUMENT, "unsupported dtype %r (one of %s)" % (name, ", ".join(sorted(DTYPE_SIZES))))
    return n


def _is_torch_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "element_size")


def _describe(name: str, array: Any, dtype: Optional[str]):
    """(dtype, shape, nbytes, fill) of a numpy array or torch tensor; fill(slot) copies its bytes into the slot."""
    if _is_torch_tensor(array):
        import torch
        t = array
        dt = canonical_dtype(dtype if dtype is not None else t.dtype)
        if DTYPE_SIZES[dt] != t.element_size():
            raise WsyncError(INVALID_ARGUMENT, "tensor %s: dtype %s has %d-byte elements, the tensor (%s) %d"
                             % (name, dt, DTYPE_SIZES[dt], t.dtype, t.element_size()))
        if t.device.type == "meta":
            raise WsyncError(INVALID_ARGUMENT, "tensor %s is on the meta device and has no data (a module built "
                             "with device='meta' must be materialized and loaded first)" % name)
        if t.device.type not in ("cpu", "cuda"):
            raise WsyncError(INVALID_ARGUMENT, "tensor %s is on %s; push CPU or CUDA tensors" % (name, t.device))
        if t.device.type == "cuda" and not torch.cuda.is_available():
            raise WsyncError(INVALID_ARGUMENT, "tensor %s is on %s but this process has no usable CUDA device "
                             "(torch.cuda.is_available() is False): move it to the CPU first" % (name, t.device))
        nbytes = t.numel() * t.element_size()

        def fill(slot: memoryview) -> None:
            if nbytes == 0:
                return
            dst = torch.frombuffer(slot, dtype=torch.uint8, count=nbytes)
            # One copy into the ring: a contiguous CPU tensor's bytes directly, a CUDA tensor's by torch's
            # device-to-host copy straight into the slot (a non-contiguous tensor is made contiguous first).
            with torch.no_grad():  # parameters (requires_grad) are read, never recorded in an autograd graph
                src = t.detach()
                src = src if src.is_contiguous() else src.contiguous()
                dst.copy_(src.reshape(-1).view(torch.uint8))
        return dt, tuple(t.shape), nbytes, fill

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - only without numpy
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: push needs a numpy array or a torch tensor, got %s"
                         % (name, type(array).__name__))
    if not isinstance(array, np.ndarray):
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: push needs a numpy array or a torch tensor, got %s"
                         % (name, type(array).__name__))
    a = array
    if dtype is not None:
        dt = canonical_dtype(dtype)
    elif a.dtype.name in DTYPE_SIZES or a.dtype.name in _ALIASES:  # includes ml_dtypes' bfloat16
        dt = canonical_dtype(a.dtype.name)
    elif a.dtype == np.uint16:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s is uint16: pass dtype='bfloat16' (or 'float16') to say what "
                         "its bits are" % name)
    else:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: numpy dtype %s has no wsync equivalent" % (name, a.dtype))
    if DTYPE_SIZES[dt] != a.itemsize:
        raise WsyncError(INVALID_ARGUMENT, "tensor %s: dtype %s has %d-byte elements, the array (%s) %d"
                         % (name, dt, DTYPE_SIZES[dt], a.dtype, a.itemsize))

    def fill(slot: memoryview) -> None:
        if a.nbytes == 0:
            return
        dst = np.frombuffer(slot, dtype=a.dtype, count=a.size).reshape(a.shape)
        np.copyto(dst, a, casting="no")  # one copy, gathering a non-contiguous array on the way
    return dt, tuple(int(d) for d in a.shape), int(a.nbytes), fill


_log = logging.getLogger("wsync_client")


class PushFilter(list):
    """What begin_push returns: the names this rank must push (a list, as before), plus `shapes` and `dtypes`: the
    shape and dtype the model holds for each (float32/float16 pushed for a bfloat16 tensor are converted)."""

    def __init__(self, names):
        super().__init__(names)
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, str] = {}


def _connect(path: str, deadline: float, timeout: float) -> socket.socket:
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            s.connect(path)
            return s
        except PermissionError as e:
            s.close()
            raise WsyncError(PERMISSION_DENIED, "connecting to trainer socket %s: %s (its mode lets only the daemon's "
                             "uid and group in; see wsyncd --trainer-uid / --trainer-gid)" % (path, e.strerror))
        except FileNotFoundError:
            # Nothing to wait for: the daemon creates its socket before it serves, so a missing path is a wrong path
            # (or a daemon that is not running), not one that is still starting.
            s.close()
            raise WsyncError(NOT_FOUND, "trainer socket %s does not exist: no source wsyncd serves it (check the path "
                             "against the daemon's --trainer-socket, and that the daemon runs)" % path)
        except (ConnectionRefusedError, BlockingIOError, InterruptedError, socket.timeout) as e:
            s.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WsyncError(DEADLINE_EXCEEDED, "no source wsyncd answers on trainer socket %s (%s) within the "
                                 "connect timeout of %gs" % (path, getattr(e, "strerror", None) or e, timeout))
            time.sleep(min(left, 0.05))
        except OSError as e:
            s.close()
            raise WsyncError(UNAVAILABLE, "connecting to trainer socket %s: %s" % (path, e))


def _recv_exact(sock: socket.socket, n: int, path: str) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise WsyncError(UNAVAILABLE, "trainer socket %s: the daemon closed the connection" % path)
        buf += chunk
    return buf


class Trainer:
    """One trainer rank's session with its node's source wsyncd.

        with Trainer("/run/wsync/wsyncd.sock", local_rank=0, global_rank=0) as t:
            names = t.begin_push(version)                 # waits until the driver opened `version`
            t.push_many(model.state_dict().items(), names=names)
            t.end_push(version)

    `daemon` is the daemon's trainer socket (wsyncd --trainer-socket). `timeout` bounds each wait (begin_push for the
    update to open, a bucket hand-over, ring space); `connect_timeout` bounds opening the session, all of it.
    `gpu_fp8`: quantize the CUDA tensors the daemon offers for FP8 on their GPU before the copy (see push).
    A Trainer is used by one thread at a time.
    """

    def __init__(self, daemon: str = DEFAULT_SOCKET, local_rank: int = 0, global_rank: int = 0,
                 bucket_bytes: int = 0, timeout: float = 120.0, connect_timeout: float = 30.0,
                 gpu_fp8: bool = False, placement: bool = True):
        self.gpu_fp8 = bool(gpu_fp8)
        # Zero-copy placement (docs/operations.md): tensors begin_push offers are copied straight into the node's
        # replica (mapped from the daemon's memfds) instead of the ring, and committed with CommitPlaced.
        self.placement = bool(placement)
        self._offers: Dict[str, Any] = {}
        self._offer_gen = 0
        self._maps: List[mmap.mmap] = []
        self._mapped_gen = 0
        self._placed: List[str] = []
        self._placed_pending = 0
        self._version = None
        self._fp8 = None  # the last begin_push's FP8 hint: (block_n, block_k, ue8m0, names)
        self._sock: Optional[socket.socket] = None
        self._ring: Optional[RingProducer] = None
        self._channel = None
        self._in_flight = None
        self.daemon = daemon
        self.timeout = float(timeout)
        self._stats = {"tensors": 0, "bytes": 0, "buckets": 0, "fp8_quantized": 0, "placed": 0, "placed_bytes": 0}
        if "/" not in daemon:
            raise WsyncError(INVALID_ARGUMENT, "%r is not a Unix socket path: trainer ranks reach their node's source "
                             "wsyncd through its local trainer socket (wsyncd --trainer-socket, default %s), not "
                             "over TCP" % (daemon, DEFAULT_SOCKET))
        deadline = time.monotonic() + float(connect_timeout)
        sock = _connect(daemon, deadline, float(connect_timeout))
        try:
            hello = json.dumps({"type": "open", "protocol": PROTOCOL, "local_rank": int(local_rank),
                                "global_rank": int(global_rank)}).encode()
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.sendall(struct.pack("<I", len(hello)) + hello)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refused peer: the daemon answered at once and closed; its reason is still to be read
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                head, fds, _, _ = socket.recv_fds(sock, 4, 4, socket.MSG_WAITALL)
                if len(head) < 4:
                    raise WsyncError(UNAVAILABLE, "trainer socket %s: the daemon closed the connection" % daemon)
                (n,) = struct.unpack("<I", head)
                if n > _MAX_ANSWER:
                    raise WsyncError(DATA_LOSS, "trainer socket %s: answer of %d bytes" % (daemon, n))
                answer = json.loads(_recv_exact(sock, n, daemon))
            except socket.timeout:
                raise WsyncError(DEADLINE_EXCEEDED, "trainer socket %s: the daemon did not answer within the connect "
                                 "timeout of %gs" % (daemon, connect_timeout))
            try:
                if not answer.get("ok", False):
                    err = answer.get("error", "no reason given")
                    code = PERMISSION_DENIED if err.startswith("permission denied") else FAILED_PRECONDITION
                    raise WsyncError(code, "wsyncd at %s refused the session: %s" % (daemon, err))
                if len(fds) != 1:
                    raise WsyncError(DATA_LOSS, "trainer socket %s: the answer carried %d descriptors, not the ring's "
                                     "one" % (daemon, len(fds)))
                self._ring = RingProducer(fds[0])
            finally:
                for fd in fds:
                    os.close(fd)  # the mapping keeps the ring
            self.session_id: str = answer["session_id"]
            self.session: str = answer.get("session", "")
            self.num_local_ranks = int(answer.get("num_local_ranks", 0))
            rpc = answer["rpc"]
            self._channel = grpc.insecure_channel(rpc, options=[("grpc.max_receive_message_length", 64 << 20)])
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=max(0.001, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise WsyncError(DEADLINE_EXCEEDED, "wsyncd at %s: its trainer RPC socket %s did not connect within "
                                 "the connect timeout of %gs" % (daemon, rpc, connect_timeout))
            finally:
                ready.cancel()
            self._stub = trainer_pb2_grpc.TrainerIngestStub(self._channel)
            sock.settimeout(None)
            self._sock = sock  # held for the session's life: closing it tells the daemon this rank is gone
        except BaseException:
            sock.close()
            self._close_quietly()
            raise
        half = self._ring.capacity // 2
        self.bucket_limit = min(int(bucket_bytes), half) if bucket_bytes > 0 else half

    # ---- lifetime ----
    def _close_quietly(self) -> None:
        self._unmap_replica()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        """Ends the session (an uncommitted bucket is dropped). Idempotent."""
        if self._sock is None:
            self._close_quietly()
            return
        try:
            if self._in_flight is not None:
                try:
                    self._in_flight.result()
                except grpc.RpcError:
                    pass
                self._in_flight = None
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            try:
                self._stub.CloseSession(trainer_pb2.CloseSessionRequest(session_id=self.session_id), timeout=5)
            except grpc.RpcError:
                pass  # best effort: the closed socket ends the session anyway
        finally:
            self._close_quietly()
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _live(self) -> RingProducer:
        if self._ring is None:
            raise WsyncError(FAILED_PRECONDITION, "trainer session is closed")
        return self._ring

    # ---- the update ----
    def begin_push(self, version: int) -> "PushFilter":
        """Opens this rank's part of update `version` (waits up to `timeout` until the driver opened it); returns the
        names of the tensors this rank must push (a list), with `.shapes` and `.dtypes`: what the model holds for each,
        to check tensors before pushing them."""
        self._live()
        try:
            rep = self._stub.BeginPush(trainer_pb2.BeginPushRequest(session_id=self.session_id, version=int(version)),
                                       timeout=self.timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e, "begin push of update %d" % int(version))
            if err.code == DEADLINE_EXCEEDED and "no update is open" not in err.message:
                err = WsyncError(DEADLINE_EXCEEDED, "no update is open: update %d was not opened within %gs; call "
                                 "Coordinator.begin_update(%d) first" % (int(version), self.timeout, int(version)))
            raise err from None
        self._stats = {"tensors": 0, "bytes": 0, "buckets": 0, "fp8_quantized": 0, "placed": 0, "placed_bytes": 0}
        self._version = int(version)
        self._placed, self._placed_pending = [], 0
        self._offers = {p.name: p for p in rep.placements} if self.placement else {}
        self._offer_gen = int(rep.replica_generation)
        self._fp8 = None
        if rep.HasField("fp8") and rep.fp8.tensor_names:
            self._fp8 = (int(rep.fp8.block_n), int(rep.fp8.block_k), bool(rep.fp8.ue8m0), set(rep.fp8.tensor_names))
        self._slices = [{"name": x.name, "shape": list(x.shape), "offsets": list(x.offsets), "extents": list(x.extents),
                         "gather": bool(x.gather)} for x in rep.slices]
        self._version = int(version)
        self._converted = set()
        names = PushFilter(rep.tensor_names)
        for e in rep.expected:
            if e.dtype:
                names.shapes[e.name] = tuple(int(d) for d in e.shape)
                names.dtypes[e.name] = e.dtype
        self._expected = names
        return names

    def push_slices(self) -> List[Dict[str, Any]]:
        """The slices the last begin_push asked this rank to push (shard-aware plans), as dicts with name, shape,
        offsets, extents (row/column ranges: take `t[o0:o0+e0, o1:o1+e1]` and push_slice it)."""
        return list(getattr(self, "_slices", []))

    def push_slice(self, name: str, array: Any, full_shape: Sequence[int], offsets: Sequence[int],
                   dtype: Optional[str] = None) -> None:
        """Pushes a slice of HF tensor `name` (whole shape `full_shape`): `array` is the slice, its shape the extents,
        starting at `offsets` — a range along dim 0 (row ranges, whole experts) or any rectangle of a 2-D tensor.
        The node's daemon assembles the tensor from the slices its ranks push and names the tensor and ranges of a
        slice it refuses (overlap, out of range)."""
        full_shape = [int(d) for d in full_shape]
        offsets = [int(o) for o in offsets]
        extents = [int(d) for d in array.shape]
        if "|" in name or len(full_shape) != len(offsets) or len(extents) != len(full_shape):
            raise WsyncError(INVALID_ARGUMENT, "slice of %s: offsets %s / extents %s do not match shape %s"
                             % (name, offsets, extents, full_shape))
        # The wire form is the frame's name (base/tensor_slice.h): NAME|slice|D0xD1...|O0,O1,...
        frame = "%s|slice|%s|%s" % (name, "x".join(map(str, full_shape)), ",".join(map(str, offsets)))
        self.push(frame, array, dtype)

    def _wait_in_flight(self) -> None:
        f, self._in_flight = self._in_flight, None
        if f is None:
            return
        try:
            f.result()
        except grpc.RpcError as e:
            raise from_rpc_error(e, "bucket hand-over") from None

    def _commit_async(self) -> None:
        ring = self._live()
        if ring.bucket_tensors == 0:
            return
        self._wait_in_flight()  # one bucket in flight: the ring always has room for the next
        seq = ring.commit_bucket()
        self._stats["buckets"] += 1
        self._in_flight = self._stub.CommitBucket.future(
            trainer_pb2.CommitBucketRequest(session_id=self.session_id, bucket_seq=seq), timeout=self.timeout)

    def fp8_tensors(self) -> List[str]:
        """The tensors the last begin_push offered for pre-quantization (the node's replica stores FP8 block-quantized
        weights; empty otherwise): with gpu_fp8=True, CUDA tensors among them are quantized on their GPU."""
        return sorted(self._fp8[3]) if self._fp8 else []

    def push(self, name: str, array: Any, dtype: Optional[str] = None) -> None:
        """Copies one tensor (numpy array, CPU or CUDA torch tensor) into the ring. `dtype` overrides the array's
        own (needed for bfloat16 bits held in a numpy uint16 array: push(name, bits, dtype="bfloat16")).

        With gpu_fp8=True, a 2-D bfloat16/float16/float32 CUDA tensor that begin_push offered for FP8 is quantized on
        its GPU (wsync_client.fp8, byte-identical to the daemon's CPU quantizer) and pushed as its float8_e4m3fn
        codes plus float32 `<name>_scale_inv`: about half the device-to-host bytes of bfloat16."""
        if self._fp8 is not None and self.gpu_fp8 and dtype is None and name in self._fp8[3] and _is_torch_tensor(array):
            import torch
            if (array.device.type == "cuda" and array.dim() == 2
                    and array.dtype in (torch.bfloat16, torch.float16, torch.float32)):
                from .fp8 import quantize_fp8_block
                block_n, block_k, ue8m0, _ = self._fp8
                codes, scale = quantize_fp8_block(array, block_n, block_k, ue8m0)
                self._push(name, codes, None)
                self._push(name + "_scale_inv", scale, None)
                self._stats["tensors"] -= 1  # the weight counts once
                self._stats["fp8_quantized"] += 1
                return
        self._push(name, array, dtype)

    # ---- zero-copy placement ----
    def _map_replica(self) -> None:
        """Maps the replica's layout buffers (memfds from the daemon's trainer socket, a {"type": "replica"} hello)."""
        if self._maps and self._mapped_gen == self._offer_gen:
            return
        self._unmap_replica()
        deadline = time.monotonic() + self.timeout
        sock = _connect(self.daemon, deadline, self.timeout)
        try:
            sock.settimeout(self.timeout)
            hello = json.dumps({"type": "replica", "protocol": PROTOCOL, "session_id": self.session_id}).encode()
            sock.sendall(struct.pack("<I", len(hello)) + hello)
            head, fds, _, _ = socket.recv_fds(sock, 4, 256, socket.MSG_WAITALL)
            try:
                if len(head) < 4:
                    raise WsyncError(UNAVAILABLE, "trainer socket %s: the daemon closed the connection" % self.daemon)
                (n,) = struct.unpack("<I", head)
                if n > _MAX_ANSWER:
                    raise WsyncError(DATA_LOSS, "trainer socket %s: answer of %d bytes" % (self.daemon, n))
                answer = json.loads(_recv_exact(sock, n, self.daemon))
                if not answer.get("ok", False):
                    raise WsyncError(FAILED_PRECONDITION, "wsyncd refused the replica's buffers: %s"
                                     % answer.get("error", "no reason given"))
                sizes = [int(b) for b in answer.get("replica_bytes", [])]
                if int(answer.get("replica_generation", 0)) != self._offer_gen or len(sizes) != len(fds):
                    raise WsyncError(FAILED_PRECONDITION, "the replica changed since begin_push, or the answer is "
                                     "malformed (%d descriptors)" % len(fds))
                self._maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                              for fd, size in zip(fds, sizes)]
                self._mapped_gen = self._offer_gen
            finally:
                for fd in fds:
                    os.close(fd)  # the mappings keep the buffers
        finally:
            sock.close()

    def _unmap_replica(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view over it is still referenced; the GC drops it
        self._maps, self._mapped_gen = [], 0

    def _try_place(self, name: str, array: Any, dtype: Optional[str]) -> bool:
        """Copies a tensor begin_push offered for placement (exactly its dtype and shape) into the replica; False
        when it must go through the ring."""
        offer = self._offers.get(name)
        if offer is None:
            return False
        dt, shape, nbytes, _ = _describe(name, array, dtype)
        if dt != canonical_dtype(offer.dtype) or tuple(shape) != tuple(offer.shape):
            return False
        self._map_replica()
        for r in offer.regions:
            if (r.layout >= len(self._maps)
                    or r.offset + (r.rows - 1) * r.pitch + r.row_bytes > len(self._maps[r.layout])
                    or r.src_offset + (r.rows - 1) * r.src_pitch + r.row_bytes > nbytes):
                raise WsyncError(DATA_LOSS, "tensor %s: the daemon offered a region outside the replica or the tensor"
                                 % name)
        if _is_torch_tensor(array):
            import torch
            with torch.no_grad():
                src = array.detach()
                src = (src if src.is_contiguous() else src.contiguous()).reshape(-1).view(torch.uint8)
                for r in offer.regions:
                    if r.rows <= 0 or r.row_bytes == 0:
                        continue
                    dst = torch.frombuffer(self._maps[r.layout], dtype=torch.uint8)
                    # One copy per region: host memcpy, or torch's device-to-host copy for a CUDA tensor (synchronous,
                    # so it has landed before the commit).
                    # as_strided's offset counts from the storage's start, not the view's (a row slice of a fused
                    # tensor is a contiguous view into the middle of its storage).
                    dst.as_strided((r.rows, r.row_bytes), (r.pitch, 1), r.offset).copy_(
                        src.as_strided((r.rows, r.row_bytes), (r.src_pitch, 1), src.storage_offset() + r.src_offset))
        else:
            import numpy as np
            from numpy.lib.stride_tricks import as_strided
            src = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            for r in offer.regions:
                if r.rows <= 0 or r.row_bytes == 0:
                    continue
                dst = np.frombuffer(self._maps[r.layout], dtype=np.uint8)
                np.copyto(as_strided(dst[r.offset:], (r.rows, r.row_bytes), (r.pitch, 1)),
                          as_strided(src[r.src_offset:], (r.rows, r.row_bytes), (r.src_pitch, 1)))
        self._placed.append(name)
        self._placed_pending += nbytes
        self._stats["tensors"] += 1
        self._stats["bytes"] += nbytes
        self._stats["placed"] += 1
        self._stats["placed_bytes"] += nbytes
        if self._placed_pending >= self.bucket_limit:
            self._commit_placed()
        return True

    def _commit_placed(self) -> None:
        if not self._placed:
            return
        names, self._placed, self._placed_pending = self._placed, [], 0
        try:
            self._stub.CommitPlaced(trainer_pb2.CommitPlacedRequest(
                session_id=self.session_id, version=self._version, replica_generation=self._mapped_gen, names=names),
                timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "committing %d placed tensors" % len(names)) from None

    def _push(self, name: str, array: Any, dtype: Optional[str]) -> None:
        if self._offers and self._try_place(name, array, dtype):
            return
        ring = self._live()
        dt, shape, nbytes, fill = _describe(name, array, dtype)
        want = getattr(self, "_expected", None)
        want = want.dtypes.get(name) if want is not None else None
        if want is not None and dt != want and (dt, want) not in self._converted and dt in ("float32", "float16"):
            # Accepted and converted by the daemon (docs/operations.md, "Validation"): said once per update and kind.
            self._converted.add((dt, want))
            _log.warning("wsync: update %d: %s tensors are converted to the model's %s by the daemon (first: %s)",
                         self._version, dt, want, name)
        nb = len(name.encode("utf-8"))
        if nbytes > ring.max_tensor_bytes(nb):
            raise WsyncError(INVALID_ARGUMENT, "tensor %s has %d bytes, more than this %d MiB ring can hold: start "
                             "wsyncd with a larger --ring-mib" % (name, nbytes, ring.capacity >> 20))
        alone = nbytes > self.bucket_limit  # travels alone, after the ring has drained
        if alone:
            self.flush()
        elif not ring.fits_in_bucket(nb, nbytes) or ring.bucket_payload + nbytes > self.bucket_limit:
            self._commit_async()
        slot = ring.begin_tensor(name, dt, shape, nbytes, self.timeout, on_wait=self._wait_in_flight)
        try:
            fill(slot)
        except BaseException:
            dropped = ring.bucket_tensors
            ring.abort_bucket()
            raise WsyncError(FAILED_PRECONDITION, "copying tensor %s into the ring failed; the open bucket (%d tensors "
                             "before it) was dropped: abort this update" % (name, dropped))
        finally:
            try:
                slot.release()
            except BufferError:
                pass  # an array over it is still referenced (e.g. by a traceback); the GC drops it
        ring.finish_tensor()
        self._stats["tensors"] += 1
        self._stats["bytes"] += nbytes
        if alone:
            self._commit_async()

    def push_many(self, named_tensors: Iterable[Tuple[str, Any]], names: Optional[Sequence[str]] = None,
                  dtype: Optional[str] = None) -> Dict[str, Any]:
        """Pushes every `(name, tensor)` of an iterable that this rank must push — what `model.state_dict().items()`,
        `model.named_parameters()` or an FSDP/DTensor `full_tensor()` loop yields. `names` is the push filter (the list
        begin_push returned); tensors outside it are skipped. Raises WsyncError (INVALID_ARGUMENT) naming the filter's
        tensors the iterable did not yield, after pushing the others. Returns {"pushed": n, "skipped": [names]}."""
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

    def push_update(self, version: int, named_tensors: Iterable[Tuple[str, Any]],
                    dtype: Optional[str] = None) -> Dict[str, Any]:
        """begin_push(version), push_many over the filter it returns, end_push(version): one rank's whole part."""
        names = self.begin_push(version)
        result = self.push_many(named_tensors, names=names, dtype=dtype)
        self.end_push(version)
        return result

    def push_adapter(self, version: int, adapter: Any) -> Dict[str, Any]:
        """One rank's part of an adapter-only update (docs/engines.md, "LoRA adapters"): the engines serve a LoRA
        adapter and the update carries its lora_A/lora_B tensors alone, under PEFT's names — a dict or the items of
        `peft.get_peft_model_state_dict(model)`. Every tensor is checked against what the engines hold (begin_push's
        names and shapes) before any byte is pushed: a missing, unknown or wrongly shaped tensor (another rank,
        other target modules) raises WsyncError INVALID_ARGUMENT naming it, and inside Coordinator.update the update
        is then aborted with nothing written. Returns push_many's result."""
        tensors = dict(adapter.items() if hasattr(adapter, "items") else adapter)
        names = self.begin_push(version)
        problems = []
        for n in names:
            if n not in tensors:
                problems.append("%s is missing" % n)
            elif n in names.shapes and tuple(int(d) for d in tensors[n].shape) != tuple(names.shapes[n]):
                problems.append("%s has shape %s, the engines' adapter needs %s"
                                % (n, list(tensors[n].shape), list(names.shapes[n])))
        wanted = set(names)
        problems += ["%s is not a tensor of the engines' adapter" % n for n in sorted(tensors) if n not in wanted]
        if problems:
            raise WsyncError(INVALID_ARGUMENT, "the adapter does not fit the one the engines serve (%d problems): %s%s"
                             % (len(problems), "; ".join(problems[:4]), " ..." if len(problems) > 4 else ""))
        result = self.push_many(tensors.items(), names=names)
        self.end_push(version)
        return result

    def flush(self) -> None:
        """Commits the current bucket and waits until the daemon took everything committed so far."""
        self._commit_async()
        self._wait_in_flight()
        self._commit_placed()

    def end_push(self, version: int) -> None:
        """Flushes, then tells the daemon this rank is done with `version`."""
        self.flush()
        try:
            self._stub.EndPush(trainer_pb2.EndPushRequest(session_id=self.session_id, version=int(version)),
                               timeout=30)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "end push of update %d" % int(version)) from None

    def stats(self) -> Dict[str, int]:
        """{'tensors', 'bytes', 'buckets', 'fp8_quantized', 'placed', 'placed_bytes'} pushed since the last
        begin_push (placed: copied straight into the replica, counted in tensors and bytes too)."""
        return dict(self._stats)
