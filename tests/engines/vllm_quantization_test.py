#!/usr/bin/env python3
"""The vLLM backend reports its weight quantization from vLLM's own quantization config (attach message field
"quantization", docs/engines.md "Quantization"): block FP8 as fp8_block with vLLM's block size, unquantized as
nothing, any other vLLM quantization by its vLLM name (which the target daemon refuses). vLLM's real config classes,
no model loaded."""
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "vllm"))

from vllm.model_executor.layers.quantization.fp8 import Fp8Config  # noqa: E402
from wsync_vllm.backend import _quantization  # noqa: E402


def main() -> int:
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    def report(q):
        return _quantization(types.SimpleNamespace(quant_config=q))

    got = report(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 64]))
    check(got == {"method": "fp8_block", "block_size": [128, 64], "scale_format": ""}, f"block FP8 reported: {got}")
    check(report(None) is None, "unquantized: nothing reported")

    class OtherQuant:  # any quantization config vLLM may hold that wsync cannot write
        def get_name(self):
            return "awq"

        weight_block_size = None

    got = report(OtherQuant())
    check(got == {"method": "vllm:awq"}, f"another quantization reported by its vLLM name: {got}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
