#!/usr/bin/env python3
"""tools/cli/demo.sh tells what it does while it does it (issue: "the demo is silent for ~30 s").

The demo runs on the tiny model (2 updates, mTLS, every engine rank verified) with its sources' writes slowed down
(WSYNC_FAULTS=delay_ms, each update then takes seconds), and its standard output is read line by line as it comes:

* before the first update: how long an update and the whole demo take;
* per update, in order: begun (pause and configure times), this rank's push (MiB, GB/s), the committed update
  (MiB, engine ranks, GB/s, every phase with its time), every engine verified bit-exact; then the summary;
* as it goes: the first update's "begun" line is read while the driving trainer process is still running (a demo
  that printed its output only at the end, e.g. from a buffer, would show it only after that process exited).
"""
import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import harness  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
UPDATES = 2


def driving_trainer_alive(demo_pid: int) -> bool:
    """Whether the demo's driving trainer rank (wsync-trainer-demo ... --drive), a child of demo.sh, still runs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == demo_pid and argv and argv[0].endswith(b"wsync-trainer-demo") and b"--drive" in argv:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    check = harness.Checks()
    # 400 ms per written batch: each update takes seconds, so that its lines have time to show before it ends.
    env = dict(os.environ, WSYNC_FAULTS="delay_ms=400")
    # Its own process group: a test stopped from outside (ctest's timeout sends SIGTERM) or failing stops the demo
    # with every daemon, engine and trainer it started.
    demo = subprocess.Popen([os.path.join(ROOT, "tools", "cli", "demo.sh"), "--bin", os.path.abspath(args.bin),
                             "--model", os.path.abspath(args.model), "--updates", str(UPDATES)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    def stop(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGTERM)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    lines, live_at_first = [], None
    try:
        for line in demo.stdout:
            line = line.rstrip("\n")
            print(line, flush=True)
            lines.append(line)
            if live_at_first is None and line.startswith("update 1: begun"):
                live_at_first = driving_trainer_alive(demo.pid)
        rc = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    check(rc == 0, f"the demo passes (exit {rc})")

    def index(pattern: str, after: int = -1) -> int:
        for i in range(after + 1, len(lines)):
            if re.search(pattern, lines[i]):
                return i
        return -1

    note = index(r"^\(each update: .* \d+ to \d+ s per update")
    first = index(r"^update 1: begun")
    check(0 <= note < first, "before the first update the demo says how long an update takes")
    check(note >= 0 and "minutes in all" in " ".join(lines[note:note + 2]), "and how long the whole demo takes")
    at = -1
    for v in range(1, UPDATES + 1):
        steps = [
            (rf"^update {v}: begun \(engines paused in [\d.]+s, sources configured in [\d.]+s\); pushing$", "begun"),
            (rf"^update {v}: this rank pushed [\d.]+ MiB in [\d.]+s \([\d.]+ GB/s\); committing", "its push"),
            (rf"^update {v}: [\d.]+ MiB to 4 engine ranks in [\d.]+s \([\d.]+ GB/s over the push phase\); "
             r"pause=[\d.]+s .*push=[\d.]+s .*continue=[\d.]+s$", "committed with bytes, rate and phases"),
            (r"^  engine \S+: verified bit-exact", "engine verified"),
            (r"^  engine \S+: verified bit-exact", "second engine verified"),
        ]
        for pattern, what in steps:
            i = index(pattern, at)
            check(i > at, f"update {v}: {what}, in order")
            at = max(at, i)
    check(index(rf"^wsync demo: {UPDATES} updates, 4 engine ranks, .* all verified bit-exact$", at) > at,
          "the summary comes last")
    check(live_at_first is True, "the first update's progress shows while the driving trainer still runs "
                                 f"(alive when read: {live_at_first})")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
