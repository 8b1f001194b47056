#!/usr/bin/env python3
"""Coordinator fail-over on etcd through real processes (docs/operations.md, "High availability (etcd)"):

A real etcd (Debian's etcd-server, installed when missing) and two coordinators sharing one prefix; a source and a
target wsyncd and the reference engine, every one of them given both coordinators.
1. One coordinator leads, the other stands by and refuses calls naming the leader; update 1 succeeds, verified by
   the engine's own loader bit-exactly.
2. Update 2 is stretched (WSYNC_FAULTS delay_ms on the source) and the leader is SIGKILLed while bytes are being
   written. Within the lease TTL plus a few seconds the standby leads; update 2 is reported failed with the cause;
   the engine stays paused (it may hold partial writes) and resume is refused; the daemons' heartbeats reach the new
   leader; update 3 succeeds, verified bit-exactly.
3. Fencing end to end: the old leader is started again and stands by; the current leader is frozen (SIGSTOP) past
   its lease, the other takes over, and the frozen one, thawed, finds itself deposed and exits without writing;
   update 4 succeeds through the new leader.

  failover_test.py --bin build/bin --lib build/lib/libwsync_client_c.so --model tests/data/tiny/qwen3-tiny.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, HERE)
import etcd_harness  # noqa: E402
import harness  # noqa: E402

check = harness.Checks()
LEASE_TTL = 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)
    timings = {}

    with etcd_harness.Etcd() as etcd, harness.workdir("wsync-failover-") as wd:
        procs = harness.Procs(wd)
        try:
            def port_of(name):
                path = os.path.join(wd, f"{name}.port")
                return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name])

            c1 = f"127.0.0.1:{harness.free_port()}"
            c2 = f"127.0.0.1:{harness.free_port()}"
            both = f"{c1},{c2}"
            state = f"etcd://{etcd.endpoint}/wsync-failover-test"

            c2_metrics = f"127.0.0.1:{harness.free_port()}"
            c2_page = f"127.0.0.1:{harness.free_port()}"  # c2's status page (--http-listen)

            def start_coordinator(name, addr, metrics=None, page=None):
                procs.start(name, [f"{b}/wsync-coordinator", "--listen", addr, "--state", state,
                                   "--lease-ttl", str(LEASE_TTL)] + (["--metrics-listen", metrics] if metrics else [])
                            + (["--http-listen", page] if page else []))

            def page_of_c2():
                """(HTTP status, body) of c2's status page."""
                try:
                    with urllib.request.urlopen(f"http://{c2_page}/", timeout=5) as r:
                        return r.status, r.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, e.read().decode()

            def leader_gauge():
                text = urllib.request.urlopen(f"http://{c2_metrics}/metrics", timeout=5).read().decode()
                return [ln for ln in text.splitlines() if ln.startswith("wsync_coordinator_leader")]

            def ctl(endpoints, *a, timeout=60):
                r = subprocess.run([f"{b}/wsyncctl", *a, "--endpoints", endpoints, "-w", "json"],
                                   capture_output=True, text=True, timeout=timeout)
                out = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
                return r.returncode, out, r.stderr

            def leads(addr):
                rc, _, _ = ctl(addr, "status", "--dial-timeout", "1")
                return rc == 0

            def run_update(v, coordinators):
                r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                                    "--first-version", str(v), "--drive", "--coordinator", coordinators,
                                    "--verify-engine", eng], capture_output=True, text=True, timeout=180)
                print(r.stdout.strip()[-600:])
                return r.returncode == 0 and "all verified bit-exact" in r.stdout

            # Bad --state values: a usage error (2) names what is wrong; an etcd nobody answers at is a failure (1).
            r = subprocess.run([f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0", "--state", "etcd://h:2379"],
                               capture_output=True, text=True, timeout=30)
            check(r.returncode == 2 and "PREFIX" in r.stdout + r.stderr, f"--state without a prefix: rc {r.returncode}")
            r = subprocess.run([f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0", "--state",
                                f"etcd://127.0.0.1:{harness.free_port()}/x"], capture_output=True, text=True, timeout=30)
            check(r.returncode == 1 and "no endpoint answered" in r.stdout + r.stderr,
                  f"--state naming a dead etcd: rc {r.returncode}")

            # 1. Election: c1 first, so it leads; c2 stands by.
            start_coordinator("c1", c1)
            harness.wait_for("c1 leading", lambda: leads(c1), 30, procs, ["c1"])
            start_coordinator("c2", c2, c2_metrics, c2_page)
            harness.wait_for("c2 standing by", lambda: "standing by" in procs.tail("c2", 50) or None, 30, procs, ["c2"])
            check(leader_gauge() == ["wsync_coordinator_leader 0"], f"the standby's leader gauge: {leader_gauge()}")
            rc, _, err = ctl(c2, "status", "--dial-timeout", "1")
            check(rc == 3 and "not the leader" in err and f"current leader: {c1}" in err,
                  f"the standby refuses calls naming the leader (rc {rc}): {err.strip()[:200]}")
            code, body = page_of_c2()
            check(code == 503 and f"current leader: {c1}" in body,
                  f"the standby's status page answers 503 naming the leader ({code}: {body.strip()[:200]})")

            procs.start("engine", [f"{b}/wsync-engine-ref", "--id", "engine0", "--model", model, "--tp", "2",
                                   "--listen", "127.0.0.1:0", "--port-file", os.path.join(wd, "engine.port")])
            eng = f"127.0.0.1:{port_of('engine')}"
            procs.start("target", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                   "infer0", "--coordinator", both, "--engine", f"reference+grpc://{eng}",
                                   "--engine-socket", os.path.join(wd, "target.sock"),
                                   "--port-file", os.path.join(wd, "target.port")])
            port_of("target")
            # The source lists the standby first: it must find the leader by itself. Its writes are slowed down so
            # that the leader can be killed in the middle of them.
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                   "train0", "--coordinator", f"{c2},{c1}", "--trainer-ranks", "1",
                                   "--ring-mib", "64", "--port-file", os.path.join(wd, "source.port"),
                                   "--trainer-socket", os.path.join(wd, "source.sock")],
                        env={"WSYNC_FAULTS": "delay_ms=3000"})
            port_of("source")
            src = os.path.join(wd, "source.sock")  # trainer ranks reach their daemon through its local socket

            t = time.time()
            check(run_update(1, both), "update 1 lands, verified by the engine")
            timings["update_1_s"] = round(time.time() - t, 2)

            # 2. Update 2 through the list with the standby first; the leader dies while bytes are moving.
            def holds():  # the source's fault transport logs each delayed batch as its hold starts
                return procs.tail("source", 100000).count("injected fault: holding a batch")
            holds_before = holds()
            demo = subprocess.Popen([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                                     "--first-version", "2", "--drive", "--coordinator", f"{c2},{c1}",
                                     "--bucket-mib", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def opened():
                rc, w, _ = ctl(both, "watch", "--once", timeout=20)
                return rc == 0 and w.get("state") in ("updating", "committing")
            harness.wait_for("update 2 open", opened, 30, procs, ["c1"], interval=0.05)
            # The leader is killed as soon as one of update 2's batches is held on its way (3 s each).
            harness.wait_for("a batch of update 2 on its way", lambda: holds() > holds_before, 60, procs,
                             ["source", "c1"], interval=0.05)
            rc, w, _ = ctl(c1, "watch", "--once")
            check(demo.poll() is None and w.get("state") in ("updating", "committing"),
                  f"update 2 is in progress at the kill (state {w.get('state')!r}, "
                  f"{w.get('bytes_written', 0)}/{w.get('bytes_expected', 0)} bytes written)")
            t_kill = time.time()
            procs.kill("c1")
            harness.wait_for("c2 leading", lambda: leads(c2), LEASE_TTL + 10, procs, ["c2"], interval=0.1)
            timings["failover_s"] = round(time.time() - t_kill, 2)
            check(timings["failover_s"] <= LEASE_TTL + 4,
                  f"the standby leads {timings['failover_s']} s after the kill (lease TTL {LEASE_TTL} s)")
            check(leader_gauge() == ["wsync_coordinator_leader 1"], f"the new leader's gauge: {leader_gauge()}")
            out, _ = demo.communicate(timeout=120)
            timings["update_2_reported_s"] = round(time.time() - t_kill, 2)
            print(out.strip()[-800:])
            check(demo.returncode != 0 and "restarted during" in out,
                  f"the trainer's update 2 fails with the cause, {timings['update_2_reported_s']} s after the kill "
                  f"(rc {demo.returncode})")
            rc, st, _ = ctl(both, "status")
            check(st.get("current_version") == "1" and st.get("state") == "failed",
                  f"new leader: version 1, update 2 failed (state {st.get('state')!r}, version "
                  f"{st.get('current_version')!r})")
            check(st.get("engines_hold_partial_writes") is True, "engines flagged as possibly holding partial writes")
            engines = [e for n in st.get("nodes", []) for e in n.get("engine_details", [])]
            check([e.get("state") for e in engines] == ["paused"],
                  f"the engine stays paused: {[e.get('state') for e in engines]}")
            rc, h, _ = ctl(both, "history")
            recs = h.get("records", [])
            check([(str(r.get("version")), r.get("success")) for r in recs] == [("1", True), ("2", False)]
                  and "restarted during it" in recs[-1].get("error", ""),
                  f"history: {[(r.get('version'), r.get('success')) for r in recs]}")
            code, body = page_of_c2()
            check(code == 200 and 'data-version="2" data-outcome="FAILED"' in body and "restarted during it" in body,
                  f"the new leader's status page shows the failed update 2 ({code})")
            # The C API (what non-C++ trainers bind to), given the dead leader first, finds the new leader.
            import ctypes  # noqa: E402
            lib = ctypes.CDLL(os.path.abspath(args.lib))
            lib.wsync_coordinator_open.argtypes = [ctypes.c_char_p, ctypes.c_double, ctypes.POINTER(ctypes.c_void_p)]
            lib.wsync_coordinator_status.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
            lib.wsync_coordinator_close.argtypes = [ctypes.c_void_p]
            lib.wsync_free.argtypes = [ctypes.c_void_p]
            h, out, pst = ctypes.c_void_p(), ctypes.c_void_p(), {}
            if lib.wsync_coordinator_open(f"{c1},{c2}".encode(), 5.0, ctypes.byref(h)) == 0:
                if lib.wsync_coordinator_status(h, ctypes.byref(out)) == 0:
                    pst = json.loads(ctypes.string_at(out.value).decode())
                    lib.wsync_free(out)
                lib.wsync_coordinator_close(h)
            check(pst.get("state") == "failed" and str(pst.get("current_version")) == "1",
                  f"the C API client finds the new leader past the dead one: {pst.get('state')!r}")
            rc, _, err = ctl(both, "resume")
            check(rc == 1 and "mixed weights" in err, f"resume refused while the engine may hold partial writes "
                                                       f"(rc {rc})")

            def heartbeats_at_c2():
                rc, s, _ = ctl(c2, "status")
                ns = s.get("nodes", [])
                return rc == 0 and len(ns) == 2 and all(n.get("reachable") for n in ns)
            t = time.time()
            harness.wait_for("daemons' leases at the new leader", heartbeats_at_c2, 15, procs, ["source", "target"],
                             interval=0.2)
            timings["daemons_follow_s"] = round(time.time() - t_kill, 2)
            check(True, f"both daemons hold their leases with the new leader {timings['daemons_follow_s']} s after "
                        f"the kill")
            check(f"trying {c2}" in procs.tail("target", 400), "the target logged the move to the new leader")

            t = time.time()
            check(run_update(3, both), "update 3 through the new leader lands, verified by the engine")
            timings["update_3_s"] = round(time.time() - t, 2)
            rc, st, _ = ctl(both, "status")
            check(st.get("current_version") == "3" and st.get("engines_hold_partial_writes") is False,
                  f"version 3, engines clean and serving: {st.get('current_version')!r}")

            # 3. Fencing: c1 comes back as a standby; c2 freezes past its lease; c1 takes over; c2 thaws and exits.
            start_coordinator("c1b", c1)
            harness.wait_for("c1 standing by", lambda: "standing by" in procs.tail("c1b", 50) or None, 30, procs,
                             ["c1b"])
            check(not leads(c1) and leads(c2), "the restarted old leader stands by")
            c2_proc = procs.procs["c2"]
            os.kill(c2_proc.pid, signal.SIGSTOP)
            t = time.time()
            harness.wait_for("c1 leading again", lambda: leads(c1), LEASE_TTL + 10, procs, ["c1b"], interval=0.1)
            timings["freeze_takeover_s"] = round(time.time() - t, 2)
            os.kill(c2_proc.pid, signal.SIGCONT)
            try:
                c2_proc.wait(timeout=LEASE_TTL + 5)
            except subprocess.TimeoutExpired:
                pass
            log = procs.tail("c2", 60)
            check(c2_proc.poll() == 1 and "no longer the leader" in log,
                  f"the thawed, deposed leader exits on its own (rc {c2_proc.poll()})")
            rc, st, _ = ctl(both, "status")
            check(st.get("current_version") == "3", f"state intact at the new leader: {st.get('current_version')!r}")
            check(run_update(4, both), "update 4 through the leader that took over lands, verified by the engine")
        finally:
            procs.close()
    print(json.dumps({"failover_timings": timings, "lease_ttl_s": LEASE_TTL}))
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
