"""wsync's vLLM weight-transfer backend (engine side). See README.md."""

__version__ = "0.1.0"
