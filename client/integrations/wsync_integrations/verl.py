"""The `wsync` backend of verl's checkpoint engine (`verl.checkpoint_engine`, verl >= 0.8; tested with 0.9.1).

Switch a verl run to wsync with one override (from verl 0.9 the backend registers itself on `import verl`, through
this package's `verl.plugins` entry point):

    actor_rollout_ref.rollout.checkpoint_engine.backend=wsync

With verl 0.8 (no plugin discovery), or with it turned off (VERL_USE_EXTERNAL_PLUGINS=none), add
`actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=wsync_integrations.verl`. Options go in
`checkpoint_engine.engine_kwargs.wsync` (the constructor's keywords below); without them the coordinator is
$WSYNC_COORDINATOR and the trainer socket $WSYNC_TRAINER_SOCKET (else /run/wsync/wsyncd.sock).

How verl's CheckpointEngineManager.update_weights maps onto wsync, per update:
- `prepare` / `build_topology` / `init_process_group`: the actor workers become wsync trainer ranks (rank = actor
  worker rank; each opens its node's source wsyncd session once, on the first update, and keeps it); actor rank 0
  (verl's `is_master`) is the driver and also opens the Coordinator. The rollout workers take no part in the data
  path: wsync's target daemons write straight into the engines' weight memory.
- `send_weights(weights, global_steps)`: on the driver, `begin_update(global_steps)` (the coordinator pauses every
  engine); on every actor rank, `begin_push`, the tensors of its filter from verl's `get_per_tensor_param()` stream
  (every rank iterates the whole stream: the gathers are collective), `end_push`; then the driver's
  `commit_update` (the engines load, take the version and resume). A failure on the driver aborts the update (the
  engines go back to their old version when nothing of it reached them). The driver returns the update's phase
  seconds and bytes as verl's sync metrics (`wsync/<phase>_seconds`, `wsync/bytes`).
- `receive_weights`: yields nothing (the bytes are already in the engine when the driver's commit returns; verl's
  server adapter then only clears its caches and records the step).
- `finalize`: nothing (sessions are kept across updates: the ring and the plan are set up once).

The versions are verl's `global_steps` (they must increase; a call without one takes the last version + 1).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, AsyncGenerator

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ._push import close_clients, push_filtered, record_metrics

BACKEND = "wsync"
ENV_TRAINER_SOCKET = "WSYNC_TRAINER_SOCKET"
DEFAULT_TRAINER_SOCKET = "/run/wsync/wsyncd.sock"
TRAINER = "trainer"
ROLLOUT = "rollout"


@CheckpointEngineRegistry.register(BACKEND)
class WsyncCheckpointEngine(CheckpointEngine):
    """One per verl worker: actor workers push through wsync, rollout workers wait for nothing.

    Args (verl passes `bucket_size` and, on actor workers, `is_master`; the rest come from
    `checkpoint_engine.engine_kwargs.wsync`):
        bucket_size: verl's bucket size in bytes; wsync's ring has its own buckets, so it only caps the trainer's
            bucket (0: the ring's default).
        is_master: actor rank 0: opens and commits each update.
        coordinator: the coordinator's endpoint(s) (default $WSYNC_COORDINATOR), used by the master only.
        trainer_socket: this node's source wsyncd trainer socket (default $WSYNC_TRAINER_SOCKET or
            /run/wsync/wsyncd.sock).
        local_rank: this rank's index among the trainer ranks of its node (default $LOCAL_RANK, which verl's workers
            set, else the worker rank: one node).
        timeout: seconds a rank waits for the update to open and for each bucket; also the commit's bound.
        pause_mode, mode, delta: passed to Coordinator.begin_update (e.g. mode="staged": engines serve on during the
            push and switch at the commit).

    Blocking calls (opening sessions, begin/commit, the pushes) run in a worker thread: verl's workers are asyncio
    actors and keep serving while an update runs.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False, coordinator: str | None = None,
                 trainer_socket: str | None = None, local_rank: int | None = None, timeout: float = 300.0,
                 pause_mode: str = "", mode: str = "", delta: str = "") -> None:
        self.bucket_size = int(bucket_size or 0)
        self.is_master = bool(is_master)
        self.coordinator_endpoint = coordinator
        self.trainer_socket = trainer_socket or os.environ.get(ENV_TRAINER_SOCKET, DEFAULT_TRAINER_SOCKET)
        self.local_rank = local_rank
        self.timeout = float(timeout)
        self.begin_args = {"pause_mode": pause_mode, "mode": mode, "delta": delta}
        self.role: str | None = None
        self.rank = -1
        self.world_size = 0
        self.trainer = None
        self.coordinator = None
        self.last_version: int | None = None
        self.last_push: dict = {}

    # --- topology ------------------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {"is_master": self.is_master, "host": socket.gethostname(), "pid": os.getpid()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actors = metadata[:actor_wg_world_size]
        masters = [i for i, m in enumerate(actors) if m.get("is_master")]
        if masters != [0]:
            raise ValueError(f"wsync checkpoint engine: exactly actor rank 0 must be the master (is_master), got "
                             f"actor ranks {masters}")
        a, r = actor_wg_world_size, rollout_world_size
        return ({"role": [TRAINER] * a, "rank": list(range(a)), "world_size": [a] * a},
                {"role": [ROLLOUT] * r, "rank": list(range(r)), "world_size": [r] * r})

    def init_process_group(self, role: str, rank: int, world_size: int) -> None:
        """Records this worker's role; an actor rank opens its wsync session (and the master its coordinator
        client) the first time, and keeps them for the following updates."""
        if role not in (TRAINER, ROLLOUT):
            raise ValueError(f"wsync checkpoint engine: role {role!r}")
        self.role, self.rank, self.world_size = role, int(rank), int(world_size)
        if role != TRAINER:
            return
        from wsync_client import Coordinator, Trainer

        if self.trainer is None:
            local = self.local_rank
            if local is None:
                local = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else self.rank
            self.trainer = Trainer(self.trainer_socket, local_rank=local, global_rank=self.rank,
                                   bucket_bytes=self.bucket_size, timeout=self.timeout)
        if self.is_master and self.coordinator is None:
            self.coordinator = Coordinator(self.coordinator_endpoint)

    def finalize(self) -> None:
        pass

    def close(self) -> None:
        """Closes the session and the coordinator client (verl never calls it; a process exit does the same)."""
        close_clients(self)

    # --- one update ----------------------------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        if self.role != TRAINER or self.trainer is None:
            raise RuntimeError("wsync checkpoint engine: send_weights on a worker that init_process_group did not "
                               "make a trainer rank")
        version = int(global_steps) if global_steps is not None else (self.last_version or 0) + 1
        stream = _blocking_stream(weights, asyncio.get_running_loop())
        if not self.is_master:
            self.last_push = await asyncio.to_thread(push_filtered, self.trainer, version, stream)
            self.last_version = version
            return {}
        update = self.coordinator.update(version, timeout=self.timeout, **self.begin_args)
        await asyncio.to_thread(update.__enter__)
        try:
            self.last_push = await asyncio.to_thread(push_filtered, self.trainer, version, stream)
        except BaseException as exc:
            # The client's own abort path: the update is recorded as aborted by this exception, and the engines
            # resumed at their old version when nothing of it reached them.
            await asyncio.to_thread(update.__exit__, type(exc), exc, exc.__traceback__)
            raise
        await asyncio.to_thread(update.__exit__, None, None, None)  # commit_update
        self.last_version = version
        return record_metrics(self.coordinator.last_record, BACKEND)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, Any], None]:
        return
        yield  # an async generator that yields nothing: wsync wrote the weights into the engine already


def _blocking_stream(weights, loop):
    """verl hands a generator or an async generator; the push runs in a worker thread, which takes an async one's
    items one at a time from the event loop (free meanwhile: it awaits the thread)."""
    if not hasattr(weights, "__aiter__"):
        return weights

    def items():
        it = weights.__aiter__()
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(it.__anext__(), loop).result()
            except StopAsyncIteration:
                return

    return items()
