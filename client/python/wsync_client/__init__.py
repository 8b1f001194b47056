"""wsync client for Python: trainer ranks push weights to their node's wsyncd; drivers run updates.

    from wsync_client import Trainer, Coordinator, WsyncError

Pure Python on grpcio and protobuf (stubs generated from wsync's protos when the wheel is built): a Trainer opens its
session on the source daemon's local trainer socket, receives the ring's memfd over it and writes tensors straight
into the mapped ring.
"""

from ._ring import DTYPE_SIZES
from .coordinator import Coordinator
from .errors import CODE_NAMES, WsyncError
from .trainer import DEFAULT_SOCKET, Trainer

__all__ = ["Trainer", "Coordinator", "WsyncError", "CODE_NAMES", "DTYPE_SIZES", "DEFAULT_SOCKET"]
try:
    from ._version import __version__  # written by setup.py when the wheel is built
except ImportError:  # imported from the source tree, not built
    __version__ = "unknown"
