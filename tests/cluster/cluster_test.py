#!/usr/bin/env python3
"""Integration test on the emulated cluster (bench/cluster/emucluster.py): 2 trainer nodes and 2 inference nodes
(reference engines at TP=2) in network namespaces with tc-shaped links.

  1. update 1 goes through and every engine rank verifies every parameter bit-exactly;
  2. update 2: one inference node's link is taken down mid-push; the update must fail within --fail-within seconds
     (default 15) with an error naming that node and its engine ranks, and no engine may move to version 2 (they
     stay paused at version 1);
  3. the link comes back; update 3 succeeds and verifies bit-exactly on every engine.

    cluster_test.py --bin BUILD/bin [--rate-mbit 400] [--keep]

Exit 0 pass, 1 fail, 77 (skip) only when this machine cannot create network namespaces (not root, no netns).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "cluster"))
import emucluster as emu  # noqa: E402


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)
    print(f"ok: {what}", flush=True)


def ctl(c, *args):
    r = subprocess.run(["ip", "netns", "exec", c.coord_node.ns, os.path.join(c.bin, "wsyncctl"), *args, "--endpoints",
                        c.coordinator, "-w", "json", *c.tls("admin-emu")], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise Failed(f"wsyncctl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def cluster_view(c):
    """(cluster version, {engine id: state}) as the coordinator reports them."""
    status = ctl(c, "status")
    engines = ctl(c, "engines")
    return str(status.get("current_version", "")), {e["engine_id"]: e.get("state", "") for e in engines}


def run(a):
    with emu.Cluster(2, 2, a.rate_mbit, a.bin, keep_logs=a.keep) as c:
        c.network_up()
        mbit = c.measure_rate(seconds=2)
        expect(0.7 * a.rate_mbit <= mbit <= 1.1 * a.rate_mbit,
               f"iperf3 measures the shaped rate ({mbit:.0f} of {a.rate_mbit:.0f} Mbit/s)")
        c.start_wsync()

        t0 = time.time()
        ups = c.run_updates(1, 1)
        expect(len(ups) == 1 and ups[0]["verified"] and ups[0]["engine_ranks"] == 4,
               f"update 1 to 4 engine ranks verified bit-exact ({time.time() - t0:.1f} s)")
        v, st = cluster_view(c)
        expect(v == "1" and set(st.values()) == {"serving"}, f"cluster at version 1, both engines serving ({v}, {st})")

        # Update 2: pull inference node 1's cable once the push is under way.
        procs = c.start_trainers(2, 1, verify=False, tag="-u2")
        driver_name, driver = procs[0]
        time.sleep(a.pull_after)
        expect(driver.poll() is None, f"update 2 still running {a.pull_after} s in (the link goes down mid-push)")
        c.set_link(c.targets[1], up=False)
        t_down = time.time()
        try:
            driver.wait(a.fail_within)
        except subprocess.TimeoutExpired:
            raise Failed(f"update 2 did not fail within {a.fail_within} s of the link going down")
        took = time.time() - t_down
        out = c.log_tail(driver_name, 50)
        line = next((l for l in out.splitlines() if l.startswith("wsync demo: update 2 FAILED")), "")
        print(f"coordinator's error for update 2 ({took:.1f} s after the link went down):\n  {line}", flush=True)
        expect(driver.returncode != 0 and line, "update 2 failed")
        expect("node infer-node1" in line, "the error names the unreachable node by its id (infer-node1)")
        expect("engine engine1 rank 0" in line and "engine engine1 rank 1" in line,
               "the error names every affected engine rank (engine1 ranks 0 and 1)")
        for name, p in procs:
            c.stop(p)
        v, st = cluster_view(c)
        expect(v == "1" and "serving" not in st.values(),
               f"after the failed update the cluster stays at version 1 and no engine serves ({v}, {st})")

        c.set_link(c.targets[1], up=True)
        # The link is back once the node's lease is: its next heartbeat reaches the coordinator (an update opened
        # before that fails on the lease, as it should).
        t0 = time.time()
        while True:
            nodes = ctl(c, "nodes")
            nodes = nodes.get("nodes", []) if isinstance(nodes, dict) else nodes
            if len(nodes) == 4 and all(n.get("reachable") for n in nodes):
                break
            if time.time() - t0 > 60:
                raise Failed(f"infer-node1's lease did not return within 60 s of its link: {nodes}")
            time.sleep(0.5)
        expect(True, f"every node's lease is current again {time.time() - t0:.1f} s after the link returned")
        t0 = time.time()
        ups = c.run_updates(3, 1)
        expect(len(ups) == 1 and ups[0]["verified"] and ups[0]["engine_ranks"] == 4,
               f"update 3 after the link returned verified bit-exact on every engine rank ({time.time() - t0:.1f} s)")
        v, st = cluster_view(c)
        expect(v == "3" and set(st.values()) == {"serving"}, f"cluster at version 3, both engines serving ({v}, {st})")
    left = [l for l in emu.sh("ip", "-o", "link", "show", capture=True).stdout.splitlines() if c.run in l]
    left += [l for l in emu.sh("ip", "netns", "list", capture=True).stdout.splitlines() if c.run in l]
    expect(not left and not c.procs, f"no namespaces, links or processes of run {c.run} left ({left})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--pull-after", type=float, default=2.0, help="seconds after update 2 starts")
    ap.add_argument("--fail-within", type=float, default=15,
                    help="seconds the update may take to fail after the link goes down (the tcp progress timeout, "
                         "5 s, or the target's lease, ~6 s, plus the cancelled drains; docs/operations.md, Liveness)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    try:
        emu.check_privileges()
    except emu.Unsupported as e:
        print(f"SKIP: {e}")
        return emu.SKIP
    try:
        run(a)
    except (Failed, emu.HarnessError) as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    print("cluster_test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
