"""wsync client for Python: trainer ranks push weights to their node's wsyncd; drivers run updates.

    from wsync_client import Trainer, Coordinator, WsyncError

The package is pure Python over libwsync_client_c.so (the C API in client/c_api.h), found through the environment
variable WSYNC_CLIENT_LIB (the file or its directory), else next to this package, else in the build directories of
the source checkout the package sits in, else on the system library path.
"""

from .client import Coordinator, Trainer, DTYPE_SIZES
from .errors import CODE_NAMES, WsyncError
from ._lib import library_path_candidates


def library_version():
    """Version string of the loaded C library."""
    from . import _lib
    return _lib.lib().wsync_version().decode()


__all__ = ["Trainer", "Coordinator", "WsyncError", "CODE_NAMES", "DTYPE_SIZES", "library_version",
           "library_path_candidates"]
__version__ = "0.1.0"
