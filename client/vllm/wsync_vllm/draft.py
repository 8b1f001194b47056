"""The speculative draft a vLLM worker runs beside its target model (docs/engines.md, "Speculative drafts").

vLLM hands a weight-transfer engine the target model only; the draft model (MTP head, EAGLE drafter) lives in the
model runner's proposer, which loads it after the target (`SpecDecodeBaseProposer.load_model(target_model)`). The
plugin wraps that method (idempotent; installed by `plugin.register` in every worker before the model loads) to
remember which draft belongs to which target, so the backend can report the draft's parameters as a draft segment and
write them in the same update as the target's.
"""
from __future__ import annotations

import json
import os
import weakref
from typing import Any

import torch

_drafts: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    original = SpecDecodeBaseProposer.load_model

    def load_model(self: Any, target_model: torch.nn.Module) -> None:
        original(self, target_model)
        model = getattr(self, "model", None)
        if isinstance(model, torch.nn.Module):
            _drafts[target_model] = model

    SpecDecodeBaseProposer.load_model = load_model  # type: ignore[method-assign]
    _installed = True


def draft_of(vllm_config: Any, target_model: torch.nn.Module) -> torch.nn.Module | None:
    """The draft model loaded beside `target_model`, None when the engine runs no draft model (no speculative
    decoding, or a method without one such as ngram). RuntimeError when the config has a draft model but none was
    recorded (the plugin was not loaded before the worker loaded its models): updating the target alone would leave
    the draft stale, so the attach fails instead."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return None
    draft = _drafts.get(target_model)
    if draft is None and len(_drafts) == 1:  # one worker per process: the target may be reached through a wrapper
        draft = next(iter(_drafts.values()))
    if draft is None:
        raise RuntimeError(
            f"wsync: this engine runs speculative decoding ({getattr(spec, 'method', '?')}) with a draft model, but "
            "the wsync plugin did not see it load (vllm.general_plugins not loaded before the worker's models), so "
            "its draft could not be updated; refusing to attach")
    return draft


def shared_params(draft: torch.nn.Module, target: torch.nn.Module) -> set[int]:
    """ids of the draft's parameters that are the target's (vLLM's proposer shares the embedding and LM head with MTP
    drafts): they are written with the target, never as the draft's."""
    storages = {p.untyped_storage().data_ptr() for p in target.parameters() if p.numel() > 0}
    return {id(p) for p in draft.parameters() if p.numel() > 0 and p.untyped_storage().data_ptr() in storages}


# vLLM's speculative methods whose draft is a checkpoint of its own, with its own config.json.
SEPARATE_DRAFT_METHODS = ("eagle", "eagle3")
# The draft's parameter names in the attach message, for a separate draft: apart from the target's (both have
# model.layers.0.*, model.norm.weight, lm_head.weight); the replica's tables use the same prefix.
SEPARATE_DRAFT_PREFIX = "draft."


def separate_draft(vllm_config: Any, own_names: set[str]) -> dict[str, Any] | None:
    """The "speculative_draft" section the backend adds to the target's config.json for a draft that is a checkpoint
    of its own (`--speculative-config '{"method": "eagle3", "model": DIR, ...}'`): the method, the draft's
    config.json as published (DIR/config.json; vLLM's own parsed config when there is no such file) and whether the
    draft kept its own embedding and LM head after vLLM's proposer shared the target's (`own_names`: the draft's
    parameters that are not the target's tensors). None for drafts that live in the target's checkpoint (MTP)."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if spec is None or method not in SEPARATE_DRAFT_METHODS:
        return None
    dmc = spec.draft_model_config
    path = getattr(dmc, "model", None)
    config: dict[str, Any] | None = None
    if isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    else:
        hf = getattr(dmc, "hf_config", None)
        inner = getattr(hf, "model", None) or hf  # vLLM wraps EAGLE drafts' configs in an EAGLEConfig
        config = inner.to_dict() if inner is not None and hasattr(inner, "to_dict") else {}
    return {"method": method, "config": config, "own_embed_tokens": "model.embed_tokens.weight" in own_names,
            "own_lm_head": "lm_head.weight" in own_names}
