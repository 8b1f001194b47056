"""TRL's vLLM server mode with its weight sync done by wsync (TRL >= 1.16; tested with 1.16.0).

TRL's server mode talks to a `vllm serve` (VLLM_SERVER_DEV_MODE=1, `--weight-transfer-config`) through
`trl.generation.vllm_client.VLLMClient`: generation over vLLM's OpenAI API, weight sync over vLLM's NCCL
weight-transfer engine (a CUDA process group between the trainer and the server). `WsyncVLLMClient` is that client
with the weight sync replaced: the server runs wsync's weight-transfer backend (`--weight-transfer-config
'{"backend": "wsync"}'`, a target wsyncd beside it), the trainer's main process is a wsync trainer rank of its node's
source wsyncd, and each `update_named_params` (what `VLLMGeneration.sync_weights` calls once per step) is one wsync
update: the coordinator pauses the engines, the tensors of this rank's filter go to the source daemon, the commit has
vLLM load them, set the version and resume. Generation, `reset_prefix_cache` and everything else stay TRL's.

The one-line switch, before the trainer is built (TRL's `VLLMGeneration` makes its client from this name):

    import wsync_integrations.trl; wsync_integrations.trl.use_wsync()

Configuration: WSYNC_COORDINATOR (the coordinator) and WSYNC_TRAINER_SOCKET (the source wsyncd's trainer socket,
default /run/wsync/wsyncd.sock), or `use_wsync(coordinator=..., trainer_socket=...)`. In TRL only the main process
talks to the server (the other processes iterate the parameters to take part in the gathers), so the source wsyncd
of the main process's node runs with `--trainer-ranks 1`.

Versions: each update is the coordinator's current version + 1 (TRL does not number its syncs); `client.version` is
the last one committed and `client.last_record` its record (phases, bytes).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Any, Iterator

import trl.generation.vllm_generation as _vllm_generation
from trl.generation.vllm_client import VLLMClient

from ._push import close_clients, push_filtered

BACKEND = "wsync"
ENV_TRAINER_SOCKET = "WSYNC_TRAINER_SOCKET"
DEFAULT_TRAINER_SOCKET = "/run/wsync/wsyncd.sock"

_defaults: dict[str, Any] = {}


class WsyncVLLMClient(VLLMClient):
    """TRL's VLLMClient whose weight updates go through wsync. Extra keywords: coordinator, trainer_socket, timeout
    (seconds for each wait of an update and for its commit); the others are VLLMClient's."""

    def __init__(self, *args, coordinator: str | None = None, trainer_socket: str | None = None,
                 timeout: float | None = None, **kwargs) -> None:
        self.coordinator_endpoint = coordinator if coordinator is not None else _defaults.get("coordinator")
        self.trainer_socket = (trainer_socket or _defaults.get("trainer_socket")
                               or os.environ.get(ENV_TRAINER_SOCKET, DEFAULT_TRAINER_SOCKET))
        self.timeout = float(timeout if timeout is not None else _defaults.get("timeout", 300.0))
        self.coordinator = None
        self.trainer = None
        self.version: int | None = None
        self.last_record: dict | None = None
        self.last_push: dict = {}
        self._open: tuple[Any, Any, int] | None = None  # (update context, push filter, version) inside weight_update
        super().__init__(*args, **kwargs)

    def init_communicator(self, device: Any = 0) -> None:
        """Checks that the server runs wsync's weight-transfer backend, then opens this rank's wsync session and the
        coordinator client. `device` is TRL's trainer device: any (CUDA tensors are copied by the wsync client)."""
        from wsync_client import Coordinator, Trainer

        wtc = self.get_server_info().get("weight_transfer_config")
        backend = (wtc or {}).get("backend") if isinstance(wtc, dict) else None
        if backend != BACKEND:
            raise RuntimeError(f"the vLLM server at {self.base_url} runs weight-transfer backend {backend!r}, not "
                               f"wsync's: start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                               f"'{{\"backend\": \"wsync\"}}' and a target wsyncd --engine vllm+http://...")
        self.coordinator = Coordinator(self.coordinator_endpoint)
        self.trainer = Trainer(self.trainer_socket, local_rank=0, global_rank=0, timeout=self.timeout)
        self.communicator = self.trainer  # TRL checks only that one exists
        atexit.register(self.close_communicator)

    def _next_version(self) -> int:
        current = str(self.coordinator.status().get("current_version", "") or "0")  # "" before any update
        return max(int(current) if current.lstrip("-").isdigit() else 0, self.version or 0) + 1

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """One wsync update around several update_named_param calls (TRL's grouping): opened on entry, committed on
        exit; aborted when the body raises or a tensor of the filter was not sent."""
        if self.trainer is None:
            raise RuntimeError("wsync: call init_communicator() first")
        if self._open is not None:
            raise RuntimeError("wsync: weight_update() does not nest")
        version = self._next_version()
        update = self.coordinator.update(version, timeout=self.timeout)
        update.__enter__()
        try:
            names = self.trainer.begin_push(version)
            self._open = (update, names, version)
            self._pushed: set[str] = set()
            yield
            missing = sorted(set(names) - self._pushed)
            if missing:
                raise RuntimeError(f"wsync: update {version} lacks {len(missing)} tensors of this rank's filter: "
                                   f"{', '.join(missing[:8])}")
            self.trainer.end_push(version)
        except BaseException as exc:
            self._open = None
            update.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._open = None
        update.__exit__(None, None, None)
        self._committed(version)

    def update_named_param(self, name: str, weights: Any) -> None:
        """Inside weight_update(): pushes the tensor when it is in this rank's filter. Alone: an update needs every
        tensor of the filter, so a single tensor is refused (use update_named_params or weight_update)."""
        if self._open is None:
            raise RuntimeError("wsync: update_named_param outside weight_update(): a wsync update carries every "
                               "tensor of the model; use update_named_params(...) or `with client.weight_update():`")
        _, names, _ = self._open
        if name in names:
            self.trainer.push(name, weights)
            self._pushed.add(name)

    def update_named_params(self, metadata: list, named_params: Iterator[tuple[str, Any]]) -> None:
        """One wsync update of the streamed tensors (TRL's `VLLMGeneration.sync_weights` calls this once per step);
        `metadata` is TRL's (name, dtype, shape) list: wsync takes shapes and dtypes from the tensors themselves."""
        if self._open is not None:  # inside weight_update(): part of that update
            for name, tensor in named_params:
                self.update_named_param(name, tensor)
            return
        if self.trainer is None:
            raise RuntimeError("wsync: call init_communicator() first")
        version = self._next_version()
        with self.coordinator.update(version, timeout=self.timeout):
            self.last_push = push_filtered(self.trainer, version, named_params)
        self._committed(version)

    def _committed(self, version: int) -> None:
        self.version = version
        self.last_record = self.coordinator.last_record

    def close_communicator(self) -> None:
        close_clients(self)
        self.communicator = None


def use_wsync(coordinator: str | None = None, trainer_socket: str | None = None, timeout: float | None = None):
    """Makes TRL's server mode build WsyncVLLMClient instead of VLLMClient (call before the trainer is built).
    Returns the class."""
    for key, value in (("coordinator", coordinator), ("trainer_socket", trainer_socket), ("timeout", timeout)):
        if value is not None:
            _defaults[key] = value
    _vllm_generation.VLLMClient = WsyncVLLMClient
    return WsyncVLLMClient
