"""wsync adapters for RL frameworks (client/integrations/README.md).

- `wsync_integrations.verl`: the `wsync` backend of verl's checkpoint engine (registered on `import verl` through
  the `verl.plugins` entry point).
- `wsync_integrations.trl`: `WsyncVLLMClient`, TRL's `VLLMClient` with its weight sync done by wsync, and `use_wsync()`.

Each submodule imports its framework; this package itself imports neither.
"""

try:
    from ._version import __version__  # written by setup.py when the wheel is built
except ImportError:  # imported from the source tree, not built
    __version__ = "unknown"
