"""Adapter mode (init_info.mode "adapter"): wsync updates the engine's LoRA adapter, never its base weights.

The engine is started with LoRA enabled and serves one adapter from a PEFT directory (`--lora-modules NAME=DIR`, or
/v1/load_lora_adapter); WSYNC_VLLM_LORA_ADAPTER names that DIR in the engine's environment. At attach the backend
reads the adapter's config with vLLM's PEFTHelper (refusing what vLLM's validate_legal refuses, a rank over
--max-lora-rank included) and its tensor names and shapes from the adapter file, and exposes a staging segment with
one entry per lora_A/lora_B tensor (PEFT names, the model dtype). The attach reports the base model's config plus a
"lora_adapter" section ({"r", "target_modules"}): the replica plans exactly these tensors from the base config's module
shapes, and the coordinator's planning refuses an engine whose table differs, before any write.

An update: the target writes the adapter's bytes into staging while vLLM serves (nothing of vLLM reads staging);
update_weights waits for the commit, copies the staged tensors and builds vLLM's LoRAModel from them
(LoRAModel.from_lora_tensors) to validate them, the engine still serving the previous adapter; finish_weight_update
publishes the copy as the adapter's contents. vLLM's worker then drops its loaded adapters (its finish resets the LoRA
state), and the next request for the adapter loads it again through vLLM's own path (WorkerLoRAManager._load_adapter
→ PEFTHelper, validate_legal → LoRAModel.from_local_checkpoint), where the hook below returns the published tensors
instead of the file's. The API server's name and id for the adapter stay as they were.

vLLM's own /v1/load_lora_adapter (load_inplace) re-binds a name to the directory it loads: from then on that name
serves that directory, not the one wsync updates. The hook records which directory each name was last loaded from,
and an update refuses (rebound()) while a name that served wsync's directory now loads another one: the engine's
update fails naming it, instead of a version label over an adapter wsync did not write. Loading wsync's directory
under that name again (/v1/load_lora_adapter with its path, load_inplace) ends it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("wsync_vllm")

ENV_ADAPTER = "WSYNC_VLLM_LORA_ADAPTER"
ADAPTER_FILE = "adapter_model.safetensors"

_lock = threading.Lock()
_published: dict[str, dict[str, torch.Tensor]] = {}  # realpath of the adapter dir -> tensors served for it
_installed = False
# adapter name -> realpath of the directory vLLM's worker last loaded it from (WorkerLoRAManager._load_adapter)
_loaded_from: dict[str, str] = {}


@dataclass
class AdapterSpec:
    path: str                     # the PEFT directory the engine serves (realpath)
    rank: int
    target_modules: list[str]     # short module names present in the adapter file, e.g. ["q_proj", "v_proj"]
    tensors: list[tuple[str, tuple[int, ...]]]  # (PEFT name, shape) in file order
    peft_helper: Any


def _module_of(name: str) -> str:
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> q_proj
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in ("lora_A", "lora_B") and i > 0:
            return parts[i - 1]
    raise ValueError(f"wsync: adapter tensor {name!r} is not a lora_A/lora_B weight")


def read_adapter(vllm_config: Any) -> AdapterSpec:
    """The adapter this engine serves, checked as vLLM checks it; RuntimeError with the reason otherwise."""
    from safetensors import safe_open
    from vllm.lora.peft_helper import PEFTHelper

    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        raise RuntimeError("wsync: adapter mode needs vLLM started with --enable-lora")
    path = os.environ.get(ENV_ADAPTER, "")
    if not path:
        raise RuntimeError(f"wsync: adapter mode needs {ENV_ADAPTER}=<the PEFT directory of the served adapter> in "
                           "vLLM's environment")
    path = os.path.realpath(path)
    hf = vllm_config.model_config.hf_config.get_text_config()
    try:
        helper = PEFTHelper.from_local_dir(path, getattr(hf, "max_position_embeddings", None))
        helper.validate_legal(lora_config)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"wsync: adapter {path} refused: {e}") from e
    if helper.rank_pattern or helper.alpha_pattern:
        raise RuntimeError(f"wsync: adapter {path}: per-module rank/alpha patterns are not supported")
    tensors = []
    with safe_open(os.path.join(path, ADAPTER_FILE), framework="pt") as f:
        for name in f.keys():
            shape = tuple(int(d) for d in f.get_slice(name).get_shape())
            _module_of(name)  # a lora_A/lora_B weight, or the reason it is not
            r_dim = shape[0] if ".lora_A." in name else shape[-1]
            if len(shape) != 2 or r_dim != helper.r:
                raise RuntimeError(f"wsync: adapter {path}: {name} has shape {list(shape)}, not rank {helper.r}")
            tensors.append((name, shape))
    if not tensors:
        raise RuntimeError(f"wsync: adapter {path} holds no lora_A/lora_B tensors")
    modules = sorted({_module_of(n) for n, _ in tensors})
    return AdapterSpec(path, int(helper.r), modules, tensors, helper)


def model_config_json(base_json: str, spec: AdapterSpec) -> str:
    cfg = json.loads(base_json) if base_json.strip() else {}
    cfg["lora_adapter"] = {"r": spec.rank, "target_modules": spec.target_modules}
    return json.dumps(cfg)


def build_lora_model(vllm_config: Any, spec: AdapterSpec, tensors: dict[str, torch.Tensor], lora_id: int = 1) -> Any:
    """vLLM's own LoRAModel from in-memory tensors (what its loader builds from the file)."""
    from vllm.lora.lora_model import LoRAModel

    lora_config = vllm_config.lora_config
    return LoRAModel.from_lora_tensors(lora_model_id=lora_id, tensors=tensors, peft_helper=spec.peft_helper,
                                       device="cpu", dtype=lora_config.lora_dtype,
                                       model_vocab_size=vllm_config.model_config.get_vocab_size())


def publish(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with _lock:
        _published[os.path.realpath(path)] = tensors


def withdraw(path: str) -> None:
    with _lock:
        _published.pop(os.path.realpath(path), None)


def published(path: str) -> dict[str, torch.Tensor] | None:
    with _lock:
        return _published.get(os.path.realpath(path))


def rebound(path: str) -> list[tuple[str, str]]:
    """Adapter names this worker once loaded from `path` that vLLM has since loaded from another directory
    (/v1/load_lora_adapter with load_inplace re-binds the name): wsync's updates of `path` no longer reach what those
    names serve. [(name, directory it now loads from)]."""
    real = os.path.realpath(path)
    with _lock:
        return sorted((n, d) for n, d in _loaded_from.items() if n in _served_names.get(real, set()) and d != real)


_served_names: dict[str, set[str]] = {}  # realpath of a directory -> adapter names ever loaded from it


def _record_load(name: str, path: str) -> None:
    real = os.path.realpath(path)
    with _lock:
        _loaded_from[name] = real
        _served_names.setdefault(real, set()).add(name)


def install() -> None:
    """Hooks LoRAModel.from_local_checkpoint (idempotent): a load of a directory wsync has published tensors for
    builds the LoRAModel from those tensors (LoRAModel.from_lora_tensors, as the original does after reading the
    file); any other directory loads as before."""
    global _installed
    from vllm.lora.lora_model import LoRAModel

    if _installed:
        return
    original = LoRAModel.from_local_checkpoint.__func__

    def from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper, *, lora_model_id=None,
                              device="cuda", dtype=None, model_vocab_size=None, weights_mapper=None,
                              skip_prefixes=None, moe_ep_spec=None):
        tensors = published(lora_dir)
        if tensors is None:
            return original(cls, lora_dir, expected_lora_modules, peft_helper, lora_model_id=lora_model_id,
                            device=device, dtype=dtype, model_vocab_size=model_vocab_size,
                            weights_mapper=weights_mapper, skip_prefixes=skip_prefixes, moe_ep_spec=moe_ep_spec)
        unexpected = sorted({_module_of(n) for n in tensors} - set(expected_lora_modules))
        if unexpected:
            raise ValueError(f"wsync: adapter {lora_dir}: modules {unexpected} are not LoRA targets of this model "
                             f"(expected {sorted(expected_lora_modules)})")
        from vllm.lora.utils import get_lora_id

        # A copy per load: vLLM's LoRALayerWeights.optimize() scales lora_b in place (`lora_b *= scaling`), and
        # from_lora_tensors keeps the tensor it is given when no cast is needed, so a second load of the same
        # published tensors (an LRU eviction and reload, a load_inplace request) would scale them again.
        return cls.from_lora_tensors(lora_model_id=get_lora_id() if lora_model_id is None else lora_model_id,
                                     tensors={k: v.clone() for k, v in tensors.items()}, peft_helper=peft_helper, device=device, dtype=dtype,
                                     model_vocab_size=model_vocab_size, weights_mapper=weights_mapper,
                                     skip_prefixes=skip_prefixes)

    LoRAModel.from_local_checkpoint = classmethod(from_local_checkpoint)

    # Which directory each adapter name is loaded from, so that an update can refuse to claim a version for a name
    # that vLLM re-bound to another directory (rebound()).
    from vllm.lora.worker_manager import WorkerLoRAManager

    original_load = WorkerLoRAManager._load_adapter

    def _load_adapter(self, lora_request):
        model = original_load(self, lora_request)
        _record_load(lora_request.lora_name, lora_request.lora_path)
        return model

    WorkerLoRAManager._load_adapter = _load_adapter
    _installed = True
