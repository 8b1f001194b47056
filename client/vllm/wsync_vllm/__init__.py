"""wsync's vLLM weight-transfer backend (engine side). See README.md."""

try:
    from ._version import __version__  # written by setup.py when the wheel is built
except ImportError:  # imported from the source tree, not built
    __version__ = "unknown"
