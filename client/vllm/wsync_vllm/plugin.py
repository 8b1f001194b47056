"""vLLM general plugin (entry point group vllm.general_plugins, name "wsync").

vLLM calls it in every process that loads plugins (API server, engine core, each worker), possibly more than once:
registration is idempotent."""
from __future__ import annotations

import logging

logger = logging.getLogger("wsync_vllm")

BACKEND_NAME = "wsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        try:
            WeightTransferEngineFactory.register_engine(BACKEND_NAME, "wsync_vllm.backend",
                                                        "WsyncWeightTransferEngine")
        except ValueError:  # registered concurrently / by an earlier call
            pass

    from . import cpu_plain, draft

    # before the worker loads its models: the proposer's load_model tells which draft model belongs to the target
    draft.install()
    if cpu_plain.requested():
        cpu_plain.install()
