#!/usr/bin/env python3
"""A process the test harness starts (in its own session, as every daemon and engine of the tests is) ends when the
test process that started it dies, however it dies: here that test is SIGKILLed, as a CTest timeout or a killed CI
run would do, and the process it started must be gone within a bounded time (issue 42: a stopped run left vLLM
servers and daemons running)."""
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import os, sys, tempfile, time
sys.path.insert(0, %r)
import harness
procs = harness.Procs(tempfile.mkdtemp())
p = procs.start("sleeper", ["sleep", "300"])
print(p.pid, flush=True)
time.sleep(300)
""" % HERE


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def main() -> int:
    test = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    line = test.stdout.readline()
    if not line.strip().isdigit():
        print(f"FAIL: the harness did not start its process: {line!r}")
        test.kill()
        return 1
    pid = int(line)
    sleeper_alive = alive(pid)
    os.kill(test.pid, signal.SIGKILL)
    test.wait()
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc: the process is not our child, no wait() can tell us
    gone = not alive(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    print(f"{'ok' if sleeper_alive else 'FAIL'}: the harness's process ran (pid {pid})")
    print(f"{'ok' if gone else 'FAIL'}: it ended once the test that started it was killed")
    return 0 if sleeper_alive and gone else 1


if __name__ == "__main__":
    sys.exit(main())
