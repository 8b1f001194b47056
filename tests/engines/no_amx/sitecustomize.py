"""Imported at start by every Python whose PYTHONPATH holds this directory (tests/engines/run_vllm_e2e.sh puts it
there, so vLLM's API server and the workers it spawns get it): vLLM's CPU attention is told the host has no AMX tiles, so it takes its AVX-512 kernel.

Why: on the test machines (a microVM guest kernel), vLLM's AMX attention kernel intermittently died with SIGILL
("Fatal Python error: Illegal instruction" in cpu_attention_with_kv_cache) on the engine's first request; 3 runs in 7
of examples/rl_loop failed so, a clean-clone CI run once. The engine tests check wsync's weights and the engine's
outputs, not vLLM's choice of attention kernel; every other kernel is left as it is."""

try:
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
except ImportError:  # no torch in this interpreter: nothing to patch
    pass
