#!/usr/bin/env python3
"""Coordinator restarts through real processes (docs/operations.md, "Coordinator restarts"):

1. With a state store (--state): update 1 succeeds; update 2 is opened, then the coordinator is killed (SIGKILL)
   mid-update and restarted on the same address with the same store. It must know both nodes at once, report
   version 1, record update 2 as failed because of the restart, keep the engine paused (it may hold partial
   writes) and refuse to resume it; update 3 then succeeds and the engine's own loader verifies it bit-exactly.
2. Without a state store: the coordinator is killed and restarted empty; the daemons notice through their lease
   (heartbeat) and register again by themselves within a few seconds; update 4 succeeds, verified bit-exactly.

  restart_test.py --bin build/bin --lib build/lib/libwsync_client_c.so --model tests/data/tiny/qwen3-tiny.json
"""
import argparse
import json
import ctypes
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
import harness  # noqa: E402

check = harness.Checks()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    os.environ["WSYNC_CLIENT_LIB"] = os.path.abspath(args.lib)
    lib = ctypes.CDLL(os.path.abspath(args.lib))  # the C API (client/c_api.h): this test's python has no grpcio
    lib.wsync_coordinator_open.argtypes = [ctypes.c_char_p, ctypes.c_double, ctypes.POINTER(ctypes.c_void_p)]
    lib.wsync_coordinator_begin_update.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p,
                                                   ctypes.POINTER(ctypes.c_void_p)]
    lib.wsync_coordinator_close.argtypes = [ctypes.c_void_p]
    lib.wsync_last_error.restype = ctypes.c_char_p

    def begin_update(coord, version):
        h, out = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.wsync_coordinator_open(coord.encode(), 5.0, ctypes.byref(h)) != 0:
            raise RuntimeError(lib.wsync_last_error().decode())
        try:
            if lib.wsync_coordinator_begin_update(h, version, b"", ctypes.byref(out)) != 0:
                raise RuntimeError(lib.wsync_last_error().decode())
        finally:
            lib.wsync_coordinator_close(h)
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)

    with harness.workdir("wsync-restart-") as wd:
        procs = harness.Procs(wd)
        try:
            def port_of(name):
                path = os.path.join(wd, f"{name}.port")
                return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name])

            coord = f"127.0.0.1:{harness.free_port()}"
            db = os.path.join(wd, "coordinator.db")

            def start_coordinator(name, state=True):
                argv = [f"{b}/wsync-coordinator", "--listen", coord]
                if state:
                    argv += ["--state", db]
                procs.start(name, argv)

            def ctl(*a):
                r = subprocess.run([f"{b}/wsyncctl", *a, "--endpoints", coord, "-w", "json"], capture_output=True,
                                   text=True, timeout=30)
                return r.returncode, (json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {})

            def wait_serving(name):
                harness.wait_for(f"{name} serving", lambda: ctl("status")[0] == 0 or None, 30, procs, [name])

            def run_update(v):
                r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                                    "--first-version", str(v), "--drive", "--coordinator", coord,
                                    "--verify-engine", eng], capture_output=True, text=True, timeout=120)
                print(r.stdout.strip()[-600:])
                return r.returncode == 0 and "MISMATCH" not in r.stdout

            start_coordinator("coordinator")
            wait_serving("coordinator")
            procs.start("engine", [f"{b}/wsync-engine-ref", "--id", "engine0", "--model", model, "--tp", "2",
                                   "--listen", "127.0.0.1:0", "--port-file", os.path.join(wd, "engine.port")])
            eng = f"127.0.0.1:{port_of('engine')}"
            procs.start("target", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                   "infer0", "--coordinator", coord, "--engine", f"reference+grpc://{eng}",
                                   "--engine-socket", os.path.join(wd, "target.sock"),
                                   "--port-file", os.path.join(wd, "target.port")])
            port_of("target")
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                   "train0", "--coordinator", coord, "--trainer-ranks", "1", "--ring-mib", "64",
                                   "--trainer-socket", os.path.join(wd, "source.sock"),
                                   "--port-file", os.path.join(wd, "source.port")])
            port_of('source')
            src = os.path.join(wd, "source.sock")

            check(run_update(1), "update 1 lands, verified by the engine")
            begin_update(coord, 2)
            procs.kill("coordinator")  # SIGKILL mid-update: nothing is flushed on the way out
            start_coordinator("coordinator2")
            wait_serving("coordinator2")
            rc, st = ctl("status")
            nodes = sorted(n["node_id"] for n in st.get("nodes", []))
            check(nodes == ["infer0", "train0"], f"restored coordinator knows its nodes at once: {nodes}")
            check(st.get("current_version") == "1", f"version restored: {st.get('current_version')!r}")
            check(st.get("state") == "failed" and st.get("engines_hold_partial_writes") is True,
                  f"update 2 ended as failed, engines flagged: state {st.get('state')!r}")
            rc, h = ctl("history")
            recs = h.get("records", [])
            check(len(recs) == 2 and recs[0].get("success") is True and recs[1].get("success") is False
                  and "restarted during it" in recs[1].get("error", ""),
                  f"history survived and records update 2's fate: {[(r.get('version'), r.get('success')) for r in recs]}")
            rc, _ = ctl("resume")
            check(rc == 1, f"resume refused while the engine may hold partial writes (rc {rc})")
            info = subprocess.run([f"{b}/wsyncctl", "verify", "--engine", eng, "--step", "1"], capture_output=True,
                                  text=True, timeout=60)
            check(info.returncode in (0, 1), "engine still answers")
            check(run_update(3), "update 3 after the restart lands, verified by the engine")
            rc, st = ctl("status")
            check(st.get("current_version") == "3" and st.get("engines_hold_partial_writes") is False,
                  f"version 3, engines clean: {st.get('current_version')!r}")

            # Without a store: the daemons' leases bring them back.
            procs.kill("coordinator2")
            start_coordinator("coordinator3", state=False)
            wait_serving("coordinator3")
            t0 = time.time()
            nodes = []
            while time.time() - t0 < 20:
                rc, st = ctl("status")
                nodes = sorted(n["node_id"] for n in st.get("nodes", []))
                if nodes == ["infer0", "train0"]:
                    break
                time.sleep(0.2)
            check(nodes == ["infer0", "train0"],
                  f"daemons registered again by themselves in {time.time() - t0:.1f} s: {nodes}")
            check(all(n.get("reachable") for n in st.get("nodes", [])), "their leases are current")
            check(run_update(4), "update 4 with the empty coordinator lands, verified by the engine")
            log = procs.tail("source", 400)
            check("registering again" in log, "the source logged why it registered again")
        finally:
            procs.close()
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
