#!/usr/bin/env python3
"""Soak: 100 (or --updates) consecutive updates through real processes (coordinator, source and target wsyncd, a reference
engine at TP=2, two trainer ranks), every update verified bit-exactly by the engine's own loader, while the test
samples each daemon's resident memory, open fds and threads from /proc.

Asserts, between a sample taken once the first --warmup updates are done (caches warm) and one taken 5 updates before
the end (trainer sessions still open, so per-session memory is counted in both):
  * RSS grows by at most --rss-slack-mib (default 24 MiB) per process;
  * the number of open fds and of threads does not grow (slack 2 each for transient connections);
and that all updates succeeded. The coordinator keeps --history updates (default --warmup): its history is full
before the first sample. Prints one line per daemon with the three measures (RSS also per update).
CTest runs it twice: 100 updates (daemon_soak_test) and 1000 updates with a 4 MiB slack (daemon_soak_1000_test,
label faults: a leak of ~5 KiB per update shows).

  soak_test.py --bin build/bin --model tests/data/tiny/qwen3-tiny.json [--updates 100] [--warmup 10]
"""
import argparse
import os
import re
import socket
import subprocess
import urllib.request
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import harness  # noqa: E402


def sample(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """The Prometheus text of http://127.0.0.1:PORT/metrics as {series: value}; /healthz must answer ok."""
    base = f"http://127.0.0.1:{port}"
    if urllib.request.urlopen(base + "/healthz", timeout=10).read() != b"ok\n":
        harness.fail(f"soak: {base}/healthz did not answer ok")
    out = {}
    for line in urllib.request.urlopen(base + "/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rss-slack-mib", type=float, default=24.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--history", type=int, default=0,
                    help="the coordinator's --history (updates kept); default: --warmup, so that the history, which "
                         "grows by design up to its limit (held twice: the coordinator's records and the published "
                         "model's), is full before the first sample and the growth measured is a leak's")
    args = ap.parse_args()
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)

    with harness.workdir("wsync-soak-") as wd:
        procs = harness.Procs(wd)
        try:
            def port_of(name: str) -> int:
                path = os.path.join(wd, f"{name}.port")
                return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name])

            mports = {n: free_port() for n in ("coordinator", "source", "target")}
            procs.start("coordinator", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0",
                                        "--history", str(args.history or args.warmup),
                                        "--metrics-listen", f"127.0.0.1:{mports['coordinator']}",
                                        "--port-file", os.path.join(wd, "coordinator.port")])
            coord = f"127.0.0.1:{port_of('coordinator')}"
            procs.start("engine", [f"{b}/wsync-engine-ref", "--id", "engine0", "--model", model, "--tp", "2",
                                   "--listen", "127.0.0.1:0", "--port-file", os.path.join(wd, "engine.port")])
            eng = f"127.0.0.1:{port_of('engine')}"
            procs.start("target", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id", "infer0", "--coordinator", coord,
                                   "--engine", f"reference+grpc://{eng}",
                                   "--metrics-listen", f"127.0.0.1:{mports['target']}", "--engine-socket",
                                   os.path.join(wd, "target.sock"), "--port-file", os.path.join(wd, "target.port")])
            port_of("target")
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id", "train0", "--coordinator", coord,
                                   "--trainer-socket", os.path.join(wd, "source.sock"),
                                   "--trainer-ranks", "2", "--ring-mib", "64",
                                   "--metrics-listen", f"127.0.0.1:{mports['source']}",
                                   "--port-file", os.path.join(wd, "source.port")])
            port_of('source')
            src = os.path.join(wd, "source.sock")

            outs = []
            trainers = []
            for r in range(2):
                extra = ["--drive", "--coordinator", coord, "--verify-engine", eng] if r == 0 else []
                out = open(os.path.join(wd, f"trainer{r}.out"), "w")
                outs.append(out)
                trainers.append(subprocess.Popen(
                    [f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--local-rank", str(r),
                     "--global-rank", str(r), "--updates", str(args.updates)] + extra,
                    stdout=out, stderr=open(os.path.join(wd, f"trainer{r}.log"), "w")))

            daemons = {n: procs.procs[n].pid for n in ("coordinator", "source", "target")}
            out0 = os.path.join(wd, "trainer0.out")

            def done_updates() -> int:
                with open(out0) as f:
                    return len(re.findall(r"^update \d+: \S+ MiB to \d+ engine ranks", f.read(), re.M))  # the commit line

            early = late = None
            deadline = time.time() + args.timeout
            while any(t.poll() is None for t in trainers):
                if time.time() > deadline:
                    harness.fail(f"soak: {done_updates()} of {args.updates} updates after {args.timeout:.0f} s")
                n_done = done_updates()
                if early is None and n_done >= args.warmup:
                    early = {n: dict(sample(p), updates=n_done) for n, p in daemons.items()}
                if late is None and n_done >= args.updates - 5:
                    late = {n: dict(sample(p), updates=n_done) for n, p in daemons.items()}
                for n in daemons:
                    if not procs.alive(n):
                        harness.fail(f"soak: {n} died:\n{procs.tail(n)}")
                time.sleep(0.05)
            for o in outs:
                o.close()
            rcs = [t.returncode for t in trainers]
            text = open(out0).read()
            if rcs != [0, 0] or done_updates() != args.updates or "MISMATCH" in text:
                print(text[-3000:])
                harness.fail(f"soak: trainers exited {rcs}, {done_updates()} of {args.updates} updates recorded")
            if early is None or late is None:
                harness.fail("soak: the updates ran too fast to sample; raise --updates")
            bad = []
            for n in daemons:
                e, l = early[n], late[n]
                drss = (l["rss_kib"] - e["rss_kib"]) / 1024
                per_update = (l["rss_kib"] - e["rss_kib"]) / max(1, l["updates"] - e["updates"])
                print(f"soak: {n}: rss {e['rss_kib'] / 1024:.1f} -> {l['rss_kib'] / 1024:.1f} MiB ({drss:+.1f}, "
                      f"{per_update:+.2f} KiB/update over updates {e['updates']}-{l['updates']}), "
                      f"fds {e['fds']} -> {l['fds']}, threads {e['threads']} -> {l['threads']}")
                if drss > args.rss_slack_mib:
                    bad.append(f"{n} RSS grew {drss:.1f} MiB")
                if l["fds"] > e["fds"] + 2:
                    bad.append(f"{n} fds {e['fds']} -> {l['fds']}")
                if l["threads"] > e["threads"] + 2:
                    bad.append(f"{n} threads {e['threads']} -> {l['threads']}")
            if bad:
                harness.fail("soak: growth over " + f"{args.updates - args.warmup} updates: " + "; ".join(bad))
            # The operator's view must agree with what happened: counted by the coordinator and by the source.
            cm, sm, tm = (scrape(mports[n]) for n in ("coordinator", "source", "target"))
            ok_key = 'wsync_updates_total{result="ok"}'
            if cm.get(ok_key) != args.updates:
                harness.fail(f"soak: coordinator metrics count {cm.get(ok_key)} ok updates, not {args.updates}")
            if cm.get('wsync_update_phase_seconds_count{phase="push"}') != args.updates:
                harness.fail("soak: push phase histogram count disagrees with the number of updates")
            if sm.get('wsync_source_updates_total{result="ok"}') != args.updates:
                harness.fail("soak: source metrics disagree with the number of updates")
            if not sm.get("wsync_source_bytes_written_total") or \
                    sm["wsync_source_bytes_written_total"] != cm.get("wsync_update_bytes_total"):
                harness.fail(f"soak: bytes written per source metrics {sm.get('wsync_source_bytes_written_total')} "
                             f"!= coordinator's {cm.get('wsync_update_bytes_total')}")
            if tm.get("wsync_target_engine_ranks") != 2:
                harness.fail(f"soak: target metrics show {tm.get('wsync_target_engine_ranks')} engine ranks, not 2")
            print(f"soak: metrics agree: {args.updates} ok updates, "
                  f"{cm['wsync_update_bytes_total'] / 1e6:.1f} MB written")
            print(f"soak: {args.updates} updates verified bit-exact; no growth beyond the bounds")
            return 0
        finally:
            procs.close()


if __name__ == "__main__":
    sys.exit(main())
