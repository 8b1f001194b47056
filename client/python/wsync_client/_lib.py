"""Locates and loads libwsync_client_c.so and declares the C API's prototypes (client/c_api.h)."""

import ctypes
import ctypes.util
import glob
import os

LIB_NAME = "libwsync_client_c.so"

_lib = None


def _candidates():
    env = os.environ.get("WSYNC_CLIENT_LIB")
    if env:
        # The variable is authoritative: a wrong value is an error, not a reason to load some other copy.
        yield os.path.join(env, LIB_NAME) if os.path.isdir(env) else env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, LIB_NAME)
    # A source checkout: client/python/wsync_client -> repository root, then its build directories.
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    builds = [os.path.join(root, "build")] + sorted(glob.glob(os.path.join(root, "build-*")))
    for b in builds:
        for sub in ("lib", "client", ""):
            yield os.path.join(b, sub, LIB_NAME)
    found = ctypes.util.find_library("wsync_client_c")
    if found:
        yield found


def _declare(lib):
    c_int, c_char_p, c_void_p, c_size_t = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t
    i64, u64, dbl = ctypes.c_int64, ctypes.c_uint64, ctypes.c_double
    # Buffers the library allocates come back as void* so they can be handed to wsync_free.
    out_buf = ctypes.POINTER(c_void_p)
    protos = {
        "wsync_version": (c_char_p, []),
        "wsync_last_error": (c_char_p, []),
        "wsync_free": (None, [c_void_p]),
        "wsync_trainer_connect": (c_int, [c_char_p, c_int, c_int, u64, dbl, ctypes.POINTER(c_void_p)]),
        "wsync_trainer_begin_push": (c_int, [c_void_p, i64, out_buf, ctypes.POINTER(c_size_t)]),
        "wsync_trainer_push": (c_int, [c_void_p, c_char_p, c_char_p, ctypes.POINTER(i64), c_int, c_void_p, u64]),
        "wsync_trainer_push_cuda": (c_int, [c_void_p, c_char_p, c_char_p, ctypes.POINTER(i64), c_int, c_void_p, u64,
                                            c_int, u64]),
        "wsync_trainer_flush": (c_int, [c_void_p]),
        "wsync_trainer_end_push": (c_int, [c_void_p, i64]),
        "wsync_trainer_push_slices": (c_int, [c_void_p, out_buf, ctypes.POINTER(c_size_t)]),
        "wsync_trainer_stats": (c_int, [c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u64)]),
        "wsync_trainer_last_error": (c_char_p, [c_void_p]),
        "wsync_trainer_close": (None, [c_void_p]),
        "wsync_coordinator_open": (c_int, [c_char_p, dbl, ctypes.POINTER(c_void_p)]),
        "wsync_coordinator_begin_update": (c_int, [c_void_p, i64, c_char_p, out_buf]),
        "wsync_coordinator_commit_update": (c_int, [c_void_p, i64, dbl, out_buf]),
        "wsync_coordinator_status": (c_int, [c_void_p, out_buf]),
        "wsync_coordinator_history": (c_int, [c_void_p, c_int, out_buf]),
        "wsync_coordinator_abort_update": (c_int, [c_void_p, i64, c_char_p, out_buf]),
        "wsync_coordinator_resume_engines": (c_int, [c_void_p, out_buf]),
        "wsync_coordinator_last_error": (c_char_p, [c_void_p]),
        "wsync_coordinator_close": (None, [c_void_p]),
    }
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def library_path_candidates():
    """Where the library is looked for, in order (for error messages and debugging)."""
    return list(_candidates())


def lib():
    """The loaded C library (loaded on first use)."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            _lib = _declare(ctypes.CDLL(path))
            return _lib
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise OSError(
        "cannot find %s; build it (ninja wsync_client_c) and set WSYNC_CLIENT_LIB to its path. Tried: %s"
        % (LIB_NAME, "; ".join(tried) or "nothing"))


def take_string(ptr):
    """Copies a library-allocated NUL-terminated buffer into a Python str and frees it."""
    if not ptr:
        return ""
    try:
        return ctypes.string_at(ptr).decode("utf-8")
    finally:
        lib().wsync_free(ptr)
