"""What every adapter does: push the tensors of its filter from a stream of (name, tensor), report an update's
record as metrics, close its wsync clients."""

from __future__ import annotations

from typing import Any, Iterable, Tuple


def push_filtered(trainer: Any, version: int, named_tensors: Iterable[Tuple[str, Any]]) -> dict:
    """begin_push(version), then every tensor of the stream whose name is in this rank's filter, then end_push.

    The whole stream is consumed even when the filter is empty: frameworks gather each parameter collectively
    (FSDP `full_tensor()`, ZeRO-3 `GatheredParameters`) while iterating, so every rank must iterate to the end.
    Raises WsyncError (INVALID_ARGUMENT) when a tensor of the filter never came (after pushing the others)."""
    names = trainer.begin_push(version)
    result = trainer.push_many(named_tensors, names=names)
    trainer.end_push(version)
    result["filter"] = len(names)
    result["bytes"] = trainer.stats().get("bytes", 0)
    return result


def record_metrics(record: dict | None, prefix: str) -> dict:
    """A committed update record (Coordinator.last_record) as flat metrics: seconds per phase and bytes."""
    record = record or {}
    out = {f"{prefix}/{p['phase']}_seconds": float(p.get("seconds", 0.0)) for p in record.get("phases", [])}
    out[f"{prefix}/bytes"] = int(record.get("bytes", 0) or 0)
    out[f"{prefix}/version"] = int(record.get("version", 0) or 0)
    return out


def close_clients(owner: Any) -> None:
    """Closes `owner.trainer` (the trainer session) and `owner.coordinator` (the coordinator client) where open, and
    clears them; safe to call twice."""
    if getattr(owner, "trainer", None) is not None:
        owner.trainer.close()
        owner.trainer = None
    if getattr(owner, "coordinator", None) is not None:
        owner.coordinator.close()
        owner.coordinator = None
