"""Producer side of the trainer ring (client/ring/ring.h is the specification; this is a port of RingProducer).

The ring is a memfd the source daemon created and handed over (SCM_RIGHTS): a 4 KiB header page, then `capacity`
data bytes. Positions are 64-bit byte counters; the byte at position p lives at data[p % capacity]. The producer
writes frames in [commit, read + capacity) and publishes a bucket by storing `commit`; the daemon reads only up to
`commit` and gives space back by storing `read`.

Memory ordering: the header's 64-bit words are read and stored whole through an aligned 'Q' view (one 8-byte load or
store). Before `commit` is stored, `_store_fence()` orders every earlier store of the frames before it (a lock
release followed by an acquire of the same lock, which the CPU may not reorder: needed on arm64, free on x86-64).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
from typing import Callable, Optional, Sequence

from .errors import ABORTED, DATA_LOSS, DEADLINE_EXCEEDED, FAILED_PRECONDITION, INVALID_ARGUMENT, WsyncError

RING_MAGIC = 0x474E495243595357  # "WSYCRING"
RING_VERSION = 1
HEADER_PAGE = 4096
FRAME_ALIGN = 64
FRAME_MAGIC = 0x4D415246  # "FRAM"
MAX_DIMS = 8
MAX_NAME_BYTES = 4096
MIN_CAPACITY = 4096

KIND_TENSOR, KIND_BUCKET_END, KIND_PADDING = 1, 2, 3
STATE_PRODUCER_ATTACHED, STATE_CONSUMER_CLOSED = 1, 2

# base/dtype.h numbering and element sizes.
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3, "float8_e4m3fn": 4, "int32": 5, "int64": 6, "uint8": 7,
               "float64": 8}
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int32": 4, "int64": 8, "uint8": 1,
               "float64": 8}

# RingHeader byte offsets (client/ring/ring.h static_asserts the three 128-byte lines).
_OFF_MAGIC, _OFF_VERSION, _OFF_HEADER_BYTES, _OFF_CAPACITY, _OFF_NAME = 0, 8, 12, 16, 32
_OFF_WRITE, _OFF_COMMIT, _OFF_NEXT_SEQ, _OFF_COMMIT_FUTEX, _OFF_CONSUMER_WAITERS = 128, 136, 144, 152, 156
_OFF_READ = 256
_OFF_STATE, _OFF_PRODUCER_PID, _OFF_PRODUCER_SESSIONS = 384, 388, 392

# FrameHeader: magic, kind, dtype, ndim, reserved0, position, total_bytes, data_bytes, seq, name_bytes, data_offset,
# count, header_bytes, reserved1, checksum (64 bytes); tensor frames add int64 shape[8].
_FRAME = struct.Struct("<IBBBBQQQQIIIIII")
_SHAPE = struct.Struct("<8q")
assert _FRAME.size == FRAME_ALIGN and _SHAPE.size == FRAME_ALIGN
_CHECKSUM_OFF = 60

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAKE = 1
_libc = None


def _futex_wake(addr: int) -> None:
    global _libc
    if _SYS_FUTEX is None:
        return  # the daemon's waits are bounded (100 ms), so a missed wake-up only costs latency
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                  ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


def align_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def tensor_frame_bytes(name_bytes: int, data_bytes: int) -> int:
    return align_up(2 * FRAME_ALIGN + name_bytes, FRAME_ALIGN) + align_up(data_bytes, FRAME_ALIGN)


def frame_checksum(header: bytes, name: bytes = b"") -> int:
    """FNV-1a over the frame header (checksum word taken as zero), then over the name."""
    h = 2166136261
    for i, b in enumerate(header):
        if _CHECKSUM_OFF <= i < _CHECKSUM_OFF + 4:
            b = 0
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    for b in name:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


class RingProducer:
    """Writes tensor frames into a ring handed over as `fd` (the fd is not kept; the mapping is).

    One thread at a time. begin_tensor returns a writable memoryview of the tensor's slot; after filling it call
    finish_tensor; commit_bucket publishes the bucket and returns its seq.
    """

    def __init__(self, fd: int):
        size = os.fstat(fd).st_size
        if size < HEADER_PAGE + MIN_CAPACITY:
            raise WsyncError(INVALID_ARGUMENT, "not a wsync ring (file is %d bytes)" % size)
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mm)
        hdr = self._view[:HEADER_PAGE]
        self._q = hdr.cast("Q")  # 64-bit header words, index = offset / 8
        self._i = hdr.cast("I")  # 32-bit header words, index = offset / 4
        magic, version, header_bytes, capacity = struct.unpack_from("<QIIQ", self._mm, 0)
        if magic != RING_MAGIC:
            self._unmap()
            raise WsyncError(INVALID_ARGUMENT, "not a wsync ring (magic 0x%x)" % magic)
        if version != RING_VERSION or header_bytes != HEADER_PAGE:
            self._unmap()
            raise WsyncError(FAILED_PRECONDITION, "ring version %d / header %d bytes, this client speaks %d / %d"
                             % (version, header_bytes, RING_VERSION, HEADER_PAGE))
        if capacity % 4096 or capacity + HEADER_PAGE != size:
            self._unmap()
            raise WsyncError(DATA_LOSS, "ring header capacity %d does not match file size %d" % (capacity, size))
        self.capacity = capacity
        self.name = bytes(self._mm[_OFF_NAME:_OFF_NAME + 64]).split(b"\0", 1)[0].decode("utf-8", "replace")
        self._data = self._view[HEADER_PAGE:]
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._fence_lock = threading.Lock()
        self._fence_lock.acquire()

        state = self._i[_OFF_STATE // 4]
        if state & STATE_CONSUMER_CLOSED:
            self._unmap()
            raise WsyncError(ABORTED, "ring '%s': the consumer closed it" % self.name)
        if state & STATE_PRODUCER_ATTACHED:
            pid = self._i[_OFF_PRODUCER_PID // 4]
            self._unmap()
            raise WsyncError(FAILED_PRECONDITION, "ring '%s' already has a producer (pid %d)" % (self.name, pid))
        # The daemon made this ring for this session alone and handed it to this process only: no other producer
        # can race for the attach bit.
        self._i[_OFF_STATE // 4] = state | STATE_PRODUCER_ATTACHED
        self._i[_OFF_PRODUCER_PID // 4] = os.getpid()
        self._q[_OFF_PRODUCER_SESSIONS // 8] += 1
        self._commit = self._q[_OFF_COMMIT // 8]
        self._write = self._bucket_begin = self._commit
        self._seq = self._q[_OFF_NEXT_SEQ // 8]
        self._q[_OFF_WRITE // 8] = self._commit
        self.bucket_tensors = 0
        self.bucket_payload = 0
        self._open_bytes: Optional[int] = None

    # ---- lifetime ----
    def _unmap(self) -> None:
        for attr in ("_data", "_q", "_i", "_view"):
            v = self.__dict__.pop(attr, None)
            if v is not None:
                v.release()
        self.__dict__.pop("_addr", None)
        mm = self.__dict__.pop("_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view handed out by begin_tensor is still referenced; the GC unmaps later
                pass

    def close(self) -> None:
        """Detaches (drops an uncommitted bucket) and unmaps. Idempotent."""
        if "_mm" not in self.__dict__:
            return
        self._q[_OFF_WRITE // 8] = self._commit
        self._i[_OFF_PRODUCER_PID // 4] = 0
        self._i[_OFF_STATE // 4] = self._i[_OFF_STATE // 4] & ~STATE_PRODUCER_ATTACHED
        self._unmap()

    # ---- space ----
    def _store_fence(self) -> None:
        self._fence_lock.release()
        self._fence_lock.acquire()

    def _padding_at(self, pos: int, nbytes: int) -> int:
        room = self.capacity - pos % self.capacity
        return room if room < nbytes else 0

    def max_tensor_bytes(self, name_bytes: int) -> int:
        head = align_up(2 * FRAME_ALIGN + name_bytes, FRAME_ALIGN)
        return self.capacity - head - FRAME_ALIGN if self.capacity > head + FRAME_ALIGN else 0

    def fits_in_bucket(self, name_bytes: int, data_bytes: int) -> bool:
        frame = tensor_frame_bytes(name_bytes, data_bytes)
        if frame + FRAME_ALIGN > self.capacity:
            return False
        if self.bucket_tensors == 0 and self._open_bytes is None:
            return True
        return (self._write + self._padding_at(self._write, frame) + frame + FRAME_ALIGN - self._bucket_begin
                <= self.capacity)

    def _wait_space(self, end: int, deadline: float, what: str, on_wait: Optional[Callable[[], None]]) -> None:
        sleep = 20e-6
        while True:
            if self._i[_OFF_STATE // 4] & STATE_CONSUMER_CLOSED:
                raise WsyncError(ABORTED, "ring '%s': the consumer closed it" % self.name)
            read = self._q[_OFF_READ // 8]
            if end - read <= self.capacity:
                return
            if on_wait is not None:
                on_wait()  # e.g. wait for the bucket in flight: the daemon releases it before it answers
                on_wait = None
                continue
            if time.monotonic() >= deadline:
                raise WsyncError(DEADLINE_EXCEEDED, "ring '%s': no space for %s: needs the ring up to position %d "
                                 "free, the daemon has released up to %d (capacity %d)"
                                 % (self.name, what, end, read, self.capacity))
            time.sleep(sleep)
            sleep = min(sleep * 2, 2e-3)

    def _write_header(self, pos: int, header: bytes) -> None:
        off = pos % self.capacity
        self._data[off:off + len(header)] = header

    def _write_padding(self, pos: int, nbytes: int) -> None:
        fields = [FRAME_MAGIC, KIND_PADDING, 0, 0, 0, pos, nbytes, 0, self._seq, 0, 0, 0, FRAME_ALIGN, 0, 0]
        fields[-1] = frame_checksum(_FRAME.pack(*fields))
        self._write_header(pos, _FRAME.pack(*fields))

    def _publish(self, new_commit: int) -> None:
        self._commit = new_commit
        self._q[_OFF_WRITE // 8] = self._write
        self._store_fence()  # the frames before the commit that publishes them
        self._q[_OFF_COMMIT // 8] = new_commit
        self._store_fence()
        self._i[_OFF_COMMIT_FUTEX // 4] = (self._i[_OFF_COMMIT_FUTEX // 4] + 1) & 0xFFFFFFFF
        self._store_fence()
        if self._i[_OFF_CONSUMER_WAITERS // 4] > 0:
            _futex_wake(self._addr + _OFF_COMMIT_FUTEX)

    # ---- frames ----
    def begin_tensor(self, name: str, dtype: str, shape: Sequence[int], data_bytes: int, timeout: float,
                     on_wait: Optional[Callable[[], None]] = None) -> memoryview:
        """Reserves a frame for one tensor of the current bucket; returns its `data_bytes`-byte slot."""
        if self._open_bytes is not None:
            raise WsyncError(FAILED_PRECONDITION, "ring '%s': begin_tensor('%s') while a tensor is open"
                             % (self.name, name))
        nb = name.encode("utf-8")
        if not 1 <= len(nb) <= MAX_NAME_BYTES:
            raise WsyncError(INVALID_ARGUMENT, "tensor name of %d bytes (must be 1..%d)" % (len(nb), MAX_NAME_BYTES))
        if dtype not in DTYPE_CODES:
            raise WsyncError(INVALID_ARGUMENT, "tensor '%s': invalid dtype %r" % (name, dtype))
        if len(shape) > MAX_DIMS:
            raise WsyncError(INVALID_ARGUMENT, "tensor '%s': %d dims, at most %d" % (name, len(shape), MAX_DIMS))
        expect = DTYPE_SIZES[dtype]
        for d in shape:
            if int(d) < 0:
                raise WsyncError(INVALID_ARGUMENT, "tensor '%s': bad shape %s" % (name, list(shape)))
            expect *= int(d)
        if expect != data_bytes:
            raise WsyncError(INVALID_ARGUMENT, "tensor '%s': shape %s of %s is %d bytes, not %d"
                             % (name, list(shape), dtype, expect, data_bytes))
        cap = self.capacity
        frame = tensor_frame_bytes(len(nb), data_bytes)
        if frame + FRAME_ALIGN > cap:
            raise WsyncError(INVALID_ARGUMENT, "tensor '%s' (%d bytes) does not fit ring '%s' of %d bytes (at most %d "
                             "data bytes per tensor with this name)"
                             % (name, data_bytes, self.name, cap, self.max_tensor_bytes(len(nb))))
        deadline = time.monotonic() + timeout
        what = "tensor '%s' (%d bytes)" % (name, frame)
        pos = self._write
        pad = self._padding_at(pos, frame)
        if pad > 0 and self.bucket_tensors == 0 and self._commit == pos and self._q[_OFF_READ // 8] == pos:
            # Drained ring (everything committed is released; the consumer stores no release mark until the next
            # bucket): skip to the wrap point by moving the release mark there ourselves, as the C++ producer does
            # (client/ring/ring.cc, RingProducer::BeginTensor). A padding frame would deadlock a frame longer than the room
            # before the wrap: the consumer parses padding only with the next bucket, which this frame is part of.
            self._write = self._bucket_begin = pos + pad
            self._store_fence()
            self._q[_OFF_READ // 8] = self._write
            self._publish(self._write)
            pos, pad = self._write, 0
        elif pad > 0 and self.bucket_tensors == 0:
            # Wrap before the bucket starts and publish the padding alone, so it does not count against the bucket.
            self._wait_space(pos + pad, deadline, what, on_wait)
            self._write_padding(pos, pad)
            self._write = self._bucket_begin = pos + pad
            self._publish(self._write)
            pos, pad = self._write, 0
        end = pos + pad + frame + FRAME_ALIGN  # the bucket-end frame is reserved now
        if end - self._bucket_begin > cap:
            raise WsyncError(INVALID_ARGUMENT, "ring '%s': bucket seq %d cannot take tensor '%s': a bucket spans at "
                             "most the ring capacity %d; commit the bucket first" % (self.name, self._seq, name, cap))
        self._wait_space(end, deadline, what, on_wait)
        if pad > 0:
            self._write_padding(pos, pad)
            pos += pad
        data_offset = align_up(2 * FRAME_ALIGN + len(nb), FRAME_ALIGN)
        dims = [int(d) for d in shape] + [0] * (MAX_DIMS - len(shape))
        fields = [FRAME_MAGIC, KIND_TENSOR, DTYPE_CODES[dtype], len(shape), 0, pos, frame, data_bytes, self._seq,
                  len(nb), data_offset, self.bucket_tensors, 2 * FRAME_ALIGN, 0, 0]
        fields[-1] = frame_checksum(_FRAME.pack(*fields) + _SHAPE.pack(*dims), nb)
        self._write_header(pos, _FRAME.pack(*fields) + _SHAPE.pack(*dims) + nb)
        self._write = pos + frame
        self._q[_OFF_WRITE // 8] = self._write
        self._open_bytes = data_bytes
        off = pos % cap + data_offset
        return self._data[off:off + data_bytes]

    def finish_tensor(self) -> None:
        if self._open_bytes is None:
            raise WsyncError(FAILED_PRECONDITION, "ring '%s': no tensor is open" % self.name)
        self.bucket_tensors += 1
        self.bucket_payload += self._open_bytes
        self._open_bytes = None

    def commit_bucket(self) -> int:
        """Publishes the current bucket; returns its seq."""
        if self._open_bytes is not None:
            raise WsyncError(FAILED_PRECONDITION, "ring '%s': commit with a tensor still open" % self.name)
        if self.bucket_tensors == 0:
            raise WsyncError(FAILED_PRECONDITION, "ring '%s': commit of an empty bucket" % self.name)
        fields = [FRAME_MAGIC, KIND_BUCKET_END, 0, 0, 0, self._write, FRAME_ALIGN, self.bucket_payload, self._seq, 0, 0,
                  self.bucket_tensors, FRAME_ALIGN, 0, 0]
        fields[-1] = frame_checksum(_FRAME.pack(*fields))
        # Aligned frames leave at least 64 contiguous bytes before the lap end: the end frame never wraps.
        self._write_header(self._write, _FRAME.pack(*fields))
        self._write += FRAME_ALIGN
        seq = self._seq
        self._seq += 1
        self._q[_OFF_NEXT_SEQ // 8] = self._seq
        self._publish(self._write)
        self._bucket_begin = self._write
        self.bucket_tensors = 0
        self.bucket_payload = 0
        return seq

    def abort_bucket(self) -> None:
        """Drops the current uncommitted bucket (an open tensor included)."""
        self._open_bytes = None
        self.bucket_tensors = 0
        self.bucket_payload = 0
        self._write = self._bucket_begin = self._commit
        if "_q" in self.__dict__:
            self._q[_OFF_WRITE // 8] = self._write
