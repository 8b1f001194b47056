"""Host shared-memory segments (memfd) with torch views."""
from __future__ import annotations

import mmap
import os

import torch

ALIGN = 256  # every parameter starts at a multiple of this (bytes)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class MemfdSegment:
    """One anonymous shared-memory file (memfd), mapped MAP_SHARED here; its fd is handed to the target."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(nbytes, mmap.PAGESIZE))
            self._mm: mmap.mmap | None = mmap.mmap(self.fd, max(nbytes, mmap.PAGESIZE), mmap.MAP_SHARED,
                                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes) \
            if nbytes else torch.empty(0, dtype=torch.uint8)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        assert self._bytes is not None, "segment is closed"
        elem = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= int(d)
        return self._bytes[offset:offset + numel * elem].view(dtype).view(tuple(shape))

    def close(self) -> None:
        """Unmap and close. Views handed out must be gone; if some are still alive the mapping stays (it is
        released when they are), only the fd is closed."""
        self._bytes = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # still exported to live tensors
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
