#!/usr/bin/env python3
"""wsync as verl's checkpoint engine, driven through verl's own code (verl 0.9.1) against a real vLLM and a real wsync
cluster (tests/integrations/framework_cluster.py: examples/rl_loop's cluster with two trainer ranks).

What of verl runs: `import verl` and its plugin discovery (the `verl.plugins` entry point of wsync-integrations is
what registers the backend; checked in a fresh interpreter that imports nothing of wsync), verl's shipped trainer
config (`trainer/config/_generated_ppo_trainer.yaml`) with the one override
`actor_rollout_ref.rollout.checkpoint_engine.backend=wsync`, converted by verl's `omega_conf_to_dataclass` into its
`CheckpointEngineConfig`; `CheckpointEngineRegistry.new`/`get` with the arguments verl's actor and rollout workers
pass; then per update the sequence of `CheckpointEngineManager.update_weights` through verl's own worker methods:
`execute_checkpoint_engine` (prepare, init_process_group with the backend's build_topology kwargs, finalize) of
`ActorRolloutRefWorker` (verl/workers/engine_workers.py) and `CheckpointEngineWorker`, then the two actor ranks'
`ActorRolloutRefWorker.update_weights(global_steps, mode)` (which takes `get_per_tensor_param()` from its model engine
and calls `send_weights`) concurrently with the rollout worker's `CheckpointEngineWorker.update_weights` (which feeds
`receive_weights` to its server adapter). Not run: Ray (verl's worker groups and dispatch: the methods are called on
stand-in `self` namespaces holding what they read), the manager object, the workers' constructors, FSDP's
`get_per_tensor_param` (a stand-in model engine yields the trainer's bf16 state dict, to one rank as a plain generator,
to the other as an async generator), verl's vLLM server adapter (a stand-in records what it is handed).

Checks: the engine serves each step's version after send_weights returns; vLLM's SHA-256 of every parameter equals
what vLLM's own reload of the trainer's tensors gives (bit-exact); vLLM's logprobs of its next rollout equal the
trainer's; the driver's metrics carry wsync's phases; a stream that raises aborts the update, which the history
records with the exception, and the engine serves on at the old version.

Run: tests/integrations/run_framework_test.sh verl-0.9.1 tests/integrations/verl_checkpoint_engine_test.py --bin build/bin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import framework_cluster as fc  # noqa: E402
from framework_cluster import harness, rl_loop  # noqa: E402

VERL_VERSION = "0.9.1"
SWITCH = "actor_rollout_ref.rollout.checkpoint_engine.backend=wsync"
ACTOR_RANKS = 2


def registered_in_fresh_interpreter(check) -> None:
    code = ("import verl, verl.checkpoint_engine as c; cls = c.CheckpointEngineRegistry.get('wsync'); "
            "print(verl.__version__, cls.__module__ + '.' + cls.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto"))
    out = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    check(r.returncode == 0 and out.startswith(f"{VERL_VERSION} wsync_integrations.verl.WsyncCheckpointEngine"),
          f"a fresh `import verl` (verl {VERL_VERSION}) registers backend 'wsync' through the verl.plugins entry "
          f"point: {out or r.stderr[-500:]!r}")


def verl_config():
    """verl's shipped PPO trainer config with the one-line switch, as verl's workers read it: (its checkpoint-engine
    section as verl's CheckpointEngineConfig, the whole config)."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import CheckpointEngineConfig

    base = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_trainer.yaml"))
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([SWITCH]))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine, CheckpointEngineConfig), cfg


class StandInEngine:
    """What verl's actor worker asks of its model engine here: `get_per_tensor_param()` (FSDP's yields each full
    tensor in HF names; this one the trainer's bf16 state dict, as a plain or an async generator)."""

    def __init__(self, stream):
        self.stream = stream

    def get_per_tensor_param(self):
        return self.stream, None  # (weights, peft_config)


class StandInServerAdapter:
    """Records what verl's CheckpointEngineWorker.update_weights hands its vLLM server adapter."""

    def __init__(self):
        self.calls = []

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        items = [item async for item in weights]
        self.calls.append({"items": len(items), "global_steps": global_steps, "wire_format": wire_format})


class VerlSide:
    """The checkpoint engines as verl's workers build them, driven through verl's own worker methods
    (ActorRolloutRefWorker.update_weights / execute_checkpoint_engine, CheckpointEngineWorker.update_weights /
    execute_checkpoint_engine) in the order of CheckpointEngineManager.update_weights. The workers' `self` is a
    namespace holding what those methods read: their config, checkpoint engine, model engine or server adapter."""

    def __init__(self, cfg, trainer_cfg):
        from verl.checkpoint_engine import CheckpointEngineRegistry

        self.cfg = cfg
        self.backend_cls = CheckpointEngineRegistry.get(cfg.backend)
        kwargs = cfg.engine_kwargs.get(cfg.backend, {})
        bucket = cfg.update_weights_bucket_megabytes << 20
        # Actor workers: is_master is torch.distributed rank 0; rollout workers: no is_master.
        self.actors = [types.SimpleNamespace(
            config=trainer_cfg.actor_rollout_ref, actor=types.SimpleNamespace(engine=None),
            checkpoint_engine=CheckpointEngineRegistry.new(cfg.backend, is_master=(r == 0), bucket_size=bucket,
                                                           **kwargs)) for r in range(ACTOR_RANKS)]
        self.adapter = StandInServerAdapter()
        self.rollout = types.SimpleNamespace(
            checkpoint_engine=CheckpointEngineRegistry.new(cfg.backend, bucket_size=bucket, **kwargs),
            server_adapter=self.adapter)

    @property
    def engines(self):
        return [w.checkpoint_engine for w in self.actors]

    def build_process_group(self) -> None:
        from verl.checkpoint_engine.base import CheckpointEngineWorker
        from verl.workers.engine_workers import ActorRolloutRefWorker

        metadata = [ActorRolloutRefWorker.execute_checkpoint_engine(w, "prepare") for w in self.actors]
        metadata.append(CheckpointEngineWorker.execute_checkpoint_engine(self.rollout, "prepare"))
        akw, rkw = self.backend_cls.build_topology(len(self.actors), 1, metadata)
        for i, w in enumerate(self.actors):
            ActorRolloutRefWorker.execute_checkpoint_engine(w, "init_process_group", **{k: v[i] for k, v in akw.items()})
        CheckpointEngineWorker.execute_checkpoint_engine(self.rollout, "init_process_group",
                                                         **{k: v[0] for k, v in rkw.items()})

    async def _update(self, global_steps):
        from verl.checkpoint_engine.base import CheckpointEngineWorker
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return await asyncio.gather(
            *[ActorRolloutRefWorker.update_weights(w, global_steps=global_steps, mode=self.cfg.backend)
              for w in self.actors],
            CheckpointEngineWorker.update_weights(self.rollout, global_steps=global_steps), return_exceptions=True)

    def update_weights(self, streams, global_steps: int):
        from verl.checkpoint_engine.base import CheckpointEngineWorker
        from verl.workers.engine_workers import ActorRolloutRefWorker

        for w, s in zip(self.actors, streams):
            w.actor.engine = StandInEngine(s)
        self.build_process_group()
        results = asyncio.run(self._update(global_steps))
        for w in self.actors:
            ActorRolloutRefWorker.execute_checkpoint_engine(w, "finalize")
        CheckpointEngineWorker.execute_checkpoint_engine(self.rollout, "finalize")
        return results

    def close(self):
        for e in self.engines:
            e.close()


def streams_of(state: dict):
    """Rank 0: a plain generator; rank 1: an async generator (verl's engines hand either)."""
    def plain():
        yield from state.items()

    async def agen():
        for item in state.items():
            yield item

    return [plain(), agen()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--keep", action="store_true")
    opts = ap.parse_args()
    check = harness.Checks()
    t0 = time.time()
    registered_in_fresh_interpreter(check)

    import torch
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="wsync-verl-test-")
    args = rl_loop.parse_args(["--bin", opts.bin, "--lr", "3e-2", "--out", out] + (["--keep"] if opts.keep else []))
    # --min-source-mib 0: the planner gives every rank a share however small the model (its cost model would leave
    # rank 1 out for a model of 0.7 MiB), so both ranks push.
    loop = fc.FrameworkLoop(args, trainer_ranks=ACTOR_RANKS, coordinator_args=("--min-source-mib", "0"))
    side = None
    try:
        loop.start()
        os.environ["WSYNC_COORDINATOR"] = loop.coord_addr        # what a deployment sets for verl's workers
        os.environ["WSYNC_TRAINER_SOCKET"] = loop.trainer_socket
        cfg, trainer_cfg = verl_config()
        check(cfg.backend == "wsync" and cfg.engine_kwargs == {} and not cfg.custom_backend_module,
              f"verl's config with `{SWITCH}` alone selects backend wsync: {cfg}")
        side = VerlSide(cfg, trainer_cfg)
        check(type(side.engines[0]).__name__ == "WsyncCheckpointEngine" and side.engines[0].is_master
              and not side.engines[1].is_master, "CheckpointEngineRegistry.new builds wsync engines, rank 0 master")
        before = loop.checksums()
        for step in range(2):
            version = step + 1
            prompts, completions, engine_lp, _ = loop.rollout(step)  # checks the engine's version is the step's
            rewards = [loop.task.reward(p, c) for p, c in zip(prompts, completions)]
            trainer_lp, shift = loop.policy.step(prompts, completions, rewards, args.samples)
            loop.trained += 1
            if step > 0:
                gap = sum(abs(x - y) for a, b in zip(trainer_lp, engine_lp) for x, y in zip(a, b)) / sum(
                    len(a) for a in trainer_lp)
                check(gap < 0.05, f"step {step}: vLLM's logprobs equal the trainer's after verl's sync of version "
                      f"{version - 1} (mean gap {gap:.4f}; the step moved them by {shift:.4f})")
            state = loop.policy.engine_state_dict()
            t = time.time()
            results = side.update_weights(streams_of(state), global_steps=version)
            errors = [r for r in results if isinstance(r, BaseException)]
            check(not errors, f"update {version}: send_weights on both ranks and receive_weights returned "
                  f"({time.time() - t:.2f}s; errors: {errors})")
            metrics = results[0] if isinstance(results[0], dict) else {}
            check({"wsync/push_seconds", "wsync/post_process_seconds", "wsync/bytes"} <= set(metrics)
                  and metrics.get("wsync/version") == version and results[1] == {},
                  f"update {version}: the master's update_weights returns wsync's phases as verl's sync metrics: "
                  f"{json.dumps(metrics)[:300]}")
            call = side.adapter.calls[-1] if side.adapter.calls else {}
            check(call == {"items": 0, "global_steps": version, "wire_format": "named_tensors"},
                  f"update {version}: the rollout worker's update_weights hands its server adapter an empty stream "
                  f"(the weights are in the engine already): {call}")
            check(loop.weight_version() == str(version), f"update {version}: vLLM serves version {version} when "
                  f"send_weights returns ({loop.weight_version()!r})")
            pushed = [e.last_push.get("pushed", -1) for e in side.engines]
            filters = [e.last_push.get("filter", -2) for e in side.engines]
            check(pushed == filters and sum(pushed) == len(state) and min(pushed) > 0,
                  f"update {version}: each rank pushed its filter, both a share, together every tensor once "
                  f"(pushed {pushed}, filters {filters}, {len(state)} tensors)")
            got = loop.checksums()
            oracle = loop.oracle_checksums(version, state)
            fc.compare_checksums(check, got, oracle, before, f"update {version}")
            before = oracle
        prompts, completions, engine_lp, _ = loop.rollout(2)
        rewards = [loop.task.reward(p, c) for p, c in zip(prompts, completions)]
        trainer_lp, _ = loop.policy.step(prompts, completions, rewards, args.samples)
        gap = sum(abs(x - y) for a, b in zip(trainer_lp, engine_lp) for x, y in zip(a, b)) / sum(
            len(a) for a in trainer_lp)
        check(gap < 0.05, f"after update 2: vLLM's logprobs equal the trainer's (mean gap {gap:.4f})")

        # A stream that raises (a gather failing in the trainer): the driver aborts, nothing reached the engine, so
        # it serves on at version 2.
        def broken():
            raise RuntimeError("gather failed on purpose")
            yield  # noqa: unreachable - makes this a generator

        results = side.update_weights([broken(), broken()], global_steps=3)
        check(all(isinstance(r, BaseException) for r in results[:2]),
              f"update 3 with a failing stream: send_weights raises on both ranks ({results[:2]})")
        rec = {h["version"]: h for h in loop.coord.history()}.get(3, {})
        check(rec and not rec.get("success") and "gather failed on purpose" in json.dumps(rec),
              f"update 3 is in the history as failed, naming the exception: {json.dumps(rec)[:300]}")
        check(loop.weight_version() == "2" and loop.rollout(3) is not None,
              "after the aborted update the engine serves version 2 again")
    except Exception:
        import traceback
        traceback.print_exc()
        if loop.procs is not None:
            print(loop.tails(), flush=True)
        check(False, "the test ran to its end")
    finally:
        if side is not None:
            side.close()
        loop.close()
        if not opts.keep:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
    harness.log(f"verl checkpoint engine test: {time.time() - t0:.0f}s")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
