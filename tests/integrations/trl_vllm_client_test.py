#!/usr/bin/env python3
"""TRL's vLLM server mode with wsync's weight sync, driven through TRL's own code (TRL 1.16.0) against a real vLLM and
a real wsync cluster (tests/integrations/framework_cluster.py: examples/rl_loop's cluster, one trainer rank).

What of TRL runs: `VLLMGeneration` (trl/generation/vllm_generation.py) in mode "server", built as TRL's trainers build
it, on an accelerate `Accelerator` (CPU, one process) and the tiny Qwen3 policy in fp32: its `_init_vllm` makes the
client (WsyncVLLMClient, through the one-line `use_wsync()`), checks the server (`check_server`, `/v1/models`) and
calls `init_communicator`; its `generate` (TRL's VLLMClient.generate: vLLM's /v1/completions with token ids,
`parse_logprobs`); its `sync_weights` (the metadata pass, `_iter_named_params` over the model's parameters with
`DistributedBackend.gather_params`, `update_named_params`, `reset_prefix_cache`). Not run: GRPOTrainer itself (its
loss and data pipeline), FSDP/DeepSpeed gathers (one CPU process), PEFT merging, colocate mode.

Checks: after each `sync_weights` (and a `weight_update()` group of `update_named_param` calls) vLLM serves the next
version; vLLM's SHA-256 of every parameter equals what vLLM's
own reload of the same fp32 tensors gives (wsync converts fp32 to the engine's bf16 as vLLM's loader does: bit-exact);
the logprobs TRL's `generate` returns equal the trainer's for the sampled tokens; the client refuses a server without
wsync's backend, naming the flag.

Run: tests/integrations/run_framework_test.sh trl-1.16.0 tests/integrations/trl_vllm_client_test.py --bin build/bin
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import framework_cluster as fc  # noqa: E402
from framework_cluster import harness, rl_loop  # noqa: E402

TRL_VERSION = "1.16.0"
SAMPLES = 4


def trainer_logprobs(model, prompt_ids, completion_ids):
    import torch
    with torch.no_grad():
        seqs = torch.tensor([p + c for p, c in zip(prompt_ids, completion_ids)])
        logits = model(seqs).logits[:, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, 1:].unsqueeze(-1)).squeeze(-1)
    start = len(prompt_ids[0]) - 1
    return lp[:, start:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--keep", action="store_true")
    opts = ap.parse_args()
    check = harness.Checks()
    t0 = time.time()

    import torch
    import trl
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerFast
    from trl.generation import vllm_generation

    import wsync_integrations.trl as wtrl

    torch.set_num_threads(1)
    check(trl.__version__ == TRL_VERSION, f"TRL {trl.__version__} is the pinned {TRL_VERSION}")
    out = tempfile.mkdtemp(prefix="wsync-trl-test-")
    args = rl_loop.parse_args(["--bin", opts.bin, "--lr", "3e-2", "--out", out] + (["--keep"] if opts.keep else []))
    loop = fc.FrameworkLoop(args, trainer_ranks=1)
    gen = None
    try:
        loop.start()
        wtrl.use_wsync(coordinator=loop.coord_addr, trainer_socket=loop.trainer_socket, timeout=120)
        check(vllm_generation.VLLMClient is wtrl.WsyncVLLMClient,
              "use_wsync() makes TRL's VLLMGeneration build WsyncVLLMClient")
        tok_dir = os.path.join(loop.wd, "ckpt-0")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        model = loop.policy.model  # fp32 master weights: TRL streams the parameters as the model holds them
        gen = vllm_generation.VLLMGeneration(model, Accelerator(cpu=True), tokenizer, mode="server",
                                             server_base_url=loop.base, server_timeout=60,
                                             max_completion_length=args.tokens, temperature=1.0, logprobs=0,
                                             generation_kwargs={"seed": 7, "ignore_eos": True})
        client = gen.vllm_client
        check(isinstance(client, wtrl.WsyncVLLMClient) and client.trainer is not None and client.model == "policy",
              f"VLLMGeneration's _init_vllm built WsyncVLLMClient and init_communicator opened the wsync session "
              f"(served model {client.model!r})")
        before = loop.checksums()
        prompts = [[p] for p in loop.task.prompts[:4] for _ in range(SAMPLES)]
        for step in range(2):
            version = step + 1
            prompt_ids, completion_ids, engine_lp, _ = gen.generate(prompts, None, SAMPLES)
            rewards = [loop.task.reward(p[0], c) for p, c in zip(prompt_ids, completion_ids)]
            loop.policy.step([p[0] for p in prompt_ids], completion_ids, rewards, SAMPLES)
            t = time.time()
            gen.sync_weights()
            check(client.version == version and loop.weight_version() == str(version),
                  f"sync_weights {version}: one wsync update, vLLM serves version {loop.weight_version()!r} "
                  f"({time.time() - t:.2f}s; phases "
                  f"{[p['phase'] for p in (client.last_record or {}).get('phases', [])]})")
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
            check(client.last_push.get("pushed") == len(state), f"sync_weights {version}: all {len(state)} "
                  f"parameters went through wsync ({client.last_push.get('pushed')})")
            got = loop.checksums()
            oracle = loop.oracle_checksums(version, state)
            fc.compare_checksums(check, got, oracle, before, f"sync_weights {version} (fp32 parameters)")
            before = oracle
            prompt_ids, completion_ids, engine_lp, _ = gen.generate(prompts, None, SAMPLES)
            mine = trainer_logprobs(model, prompt_ids, completion_ids)
            flat = [(a, b[0]) for xs, ys in zip(mine, engine_lp) for a, b in zip(xs, ys)]
            gap = sum(abs(a - b) for a, b in flat) / len(flat)
            check(len(flat) == len(prompts) * args.tokens and gap < 0.05,
                  f"after sync_weights {version}: the logprobs of TRL's generate equal the trainer's (mean gap "
                  f"{gap:.4f} over {len(flat)} tokens)")

        # TRL's grouping API (VLLMClient.weight_update around update_named_param calls): one wsync update.
        try:
            client.update_named_param("lm_head.weight", model.lm_head.weight.data)
            check(False, "update_named_param outside weight_update() is refused")
        except RuntimeError as e:
            check("weight_update" in str(e), f"update_named_param outside weight_update() is refused: {e}")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        with client.weight_update():
            for name, p in model.named_parameters():
                client.update_named_param(name, p.data)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        check(client.version == 3 and loop.weight_version() == "3",
              f"weight_update() with update_named_param per tensor is one wsync update: vLLM serves "
              f"{loop.weight_version()!r}")
        fc.compare_checksums(check, loop.checksums(), loop.oracle_checksums(3, state), before,
                             "weight_update() (fp32 parameters)")

        # A server without wsync's backend is refused, naming the flag (TRL's own server_info answer).
        bad = wtrl.WsyncVLLMClient.__new__(wtrl.WsyncVLLMClient)
        bad.base_url = loop.base
        bad.session = client.session
        bad.get_server_info = lambda: {"weight_transfer_config": {"backend": "nccl"}}
        try:
            bad.init_communicator("cpu")
            check(False, "a server with weight-transfer backend nccl is refused")
        except RuntimeError as e:
            check("--weight-transfer-config" in str(e) and "wsync" in str(e),
                  f"a server with weight-transfer backend nccl is refused: {e}")
    except Exception:
        import traceback
        traceback.print_exc()
        if loop.procs is not None:
            print(loop.tails(), flush=True)
        check(False, "the test ran to its end")
    finally:
        if gen is not None and getattr(gen, "vllm_client", None) is not None:
            gen.vllm_client.close_communicator()
        loop.close()
        if not opts.keep:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
    harness.log(f"TRL vLLM client test: {time.time() - t0:.0f}s")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
