#!/usr/bin/env python3
"""wsync updating an SGLang-shaped engine through SGLang's own P2P contract, with the real Mooncake Transfer Engine
holding the engine memory (tests/engines/sglang_peer.py, TP=2, every rank in two registered allocations).

Processes: coordinator, a source wsyncd (one trainer rank, tools' trainer demo driving 3 updates), a target wsyncd
started as the engine's adapter process (--engine sglang+http://…?bootstrap=…&config=…; nothing of wsync runs
"on" the engine), and the peer. Checks:
  * every update lands bit-exactly: the peer's sha256 of every parameter of every rank, taken when the version is
    set, equals this test's own expectation — the trainer's tensors regenerated here (numpy port of the generator)
    and laid out by the independent numpy model of SGLang's layout (tests/replica/golden_oracle.py);
  * nothing is written while the engine serves: the bytes at each pause equal the previous version's;
  * the call sequence per update is SGLang's: pause_generation(retract) → begin_weight_update(target) →
    end_weight_update → update_weight_version(abort_all_requests false) → flush_cache → continue_generation, and
    /health is never called;
failure paths: the bootstrap answering 404 for a rank, a parameter whose published size disagrees, and the engine
dying during post-processing (the update fails naming the engine; it is never continued).

  sglang_e2e_test.py --bin build/bin --model tests/data/tiny/qwen3-tiny.json --mooncake-python PY
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "replica"))
sys.path.insert(0, os.path.join(HERE, "..", "client"))
import golden_oracle  # noqa: E402  (independent numpy model of SGLang's layout)
import harness  # noqa: E402
from python_client_test import generate_bf16  # noqa: E402  (numpy port of the trainer demo's generator)

TP = 2
check = harness.Checks()


def expected(cfg_json, step):
    """{rank: {name: (sha256, numel, element_size)}} of SGLang's parameters after an update with `step`'s tensors."""
    c = golden_oracle.Cfg(cfg_json)
    hf = {n: generate_bf16(n, step, tuple(sh)) for n, dt, sh in golden_oracle.hf_tensors(c)}
    out = {}
    for r in range(TP):
        out[r] = {}
        for name, dtype, arr in golden_oracle.engine_params(c, {"tp_size": TP, "tp_rank": r}, hf, {}):
            a = np.ascontiguousarray(arr)
            out[r][name] = (hashlib.sha256(a.tobytes()).hexdigest(), int(a.size), int(a.itemsize))
    return out


def layout_file(path, exp, corrupt=None):
    ranks = []
    for r in range(TP):
        params = [{"name": n, "numel": numel + (1 if (r, n) == corrupt else 0), "element_size": es}
                  for n, (_, numel, es) in exp[r].items()]
        half = len(params) // 2
        ranks.append({"regions": [params[:half], params[half:]]})  # two allocations per rank
    with open(path, "w") as f:
        json.dump({"ranks": ranks}, f)


def http_json(url, data=None):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mooncake-python", default=os.environ.get("WSYNC_MOONCAKE_PYTHON"),
                    help="python of the Mooncake venv (tests/engines/run_mooncake_test.sh sets it)")
    args = ap.parse_args()
    if not args.mooncake_python:
        ap.error("--mooncake-python (or WSYNC_MOONCAKE_PYTHON) is required")
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)
    cfg = json.load(open(model))
    exps = {v: expected(cfg, v) for v in (1, 2, 3)}

    with harness.workdir("wsync-sglang-") as wd:
        procs = harness.Procs(wd)

        def start_peer(name, layout, extra=()):
            p = procs.start(name, [args.mooncake_python, os.path.join(HERE, "sglang_peer.py"), "--layout", layout,
                                   "--tp", str(TP), *extra])
            log = os.path.join(wd, f"{name}.log")

            def ready():
                for line in open(log).read().splitlines():
                    if line.startswith("{") and '"ready"' in line:
                        return json.loads(line)
                return None
            return harness.wait_for(f"{name} ready", ready, 60, procs, [name])

        def start_target(name, peer, coord):
            addr = f"sglang+http://{peer['http']}?bootstrap={peer['bootstrap']}&config={model}&id=sgl0"
            procs.start(name, [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id", "sgl-node",
                               "--coordinator", coord, "--engine", addr, "--engine-timeout", "20",
                               "--port-file", os.path.join(wd, f"{name}.port")])
            return os.path.join(wd, f"{name}.port")

        try:
            layout = os.path.join(wd, "layout.json")
            layout_file(layout, expected(cfg, 0))
            # --- failure: the bootstrap knows no rank 1 -> the adapter refuses before anything is written
            peer = start_peer("peer404", layout, ["--missing-rank", "1"])
            procs.start("coord0", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0",
                                   "--port-file", os.path.join(wd, "coord0.port")])
            coord0 = "127.0.0.1:%d" % harness.wait_for("coordinator", lambda: harness.read_port_file(
                os.path.join(wd, "coord0.port")), 30, procs, ["coord0"])
            start_target("target404", peer, coord0)
            p = procs.procs["target404"]
            rc = p.wait(60)
            log = procs.tail("target404", 20)
            check(rc != 0 and "TP rank 1" in log and "bootstrap" in log,
                  f"bootstrap 404 for rank 1: the adapter exits {rc} naming the rank")
            procs.kill("peer404")
            # --- failure: a published parameter size disagrees with SGLang's layout
            bad_layout = os.path.join(wd, "bad.json")
            name = "model.layers.1.mlp.down_proj.weight"
            layout_file(bad_layout, expected(cfg, 0), corrupt=(0, name))
            peer = start_peer("peerbad", bad_layout)
            start_target("targetbad", peer, coord0)
            rc = procs.procs["targetbad"].wait(60)
            log = procs.tail("targetbad", 20)
            check(rc != 0 and name in log and "TP rank 0" in log,
                  f"a size mismatch is refused naming the parameter (exit {rc})")
            procs.kill("peerbad")
            procs.kill("coord0")

            # --- three updates through the real Mooncake engine
            peer = start_peer("peer", layout)
            procs.start("coord", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0",
                                  "--port-file", os.path.join(wd, "coord.port")])
            coord = "127.0.0.1:%d" % harness.wait_for("coordinator", lambda: harness.read_port_file(
                os.path.join(wd, "coord.port")), 30, procs, ["coord"])
            tport = start_target("target", peer, coord)
            harness.wait_for("target registered", lambda: harness.read_port_file(tport), 60, procs, ["target"])
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                   "train0", "--coordinator", coord, "--trainer-ranks", "1", "--ring-mib", "32",
                                   "--trainer-socket", os.path.join(wd, "source.sock"),
                                   "--port-file", os.path.join(wd, "source.port")])
            harness.wait_for("source", lambda: harness.read_port_file(os.path.join(wd, "source.port")), 60, procs,
                             ["source"])
            src = os.path.join(wd, "source.sock")  # the trainer socket
            r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "3",
                                "--first-version", "1", "--drive", "--coordinator", coord],
                               capture_output=True, text=True, timeout=180)
            print(r.stdout[-1500:], r.stderr[-1500:])
            check(r.returncode == 0, f"3 updates driven through the coordinator (trainer exit {r.returncode})")
            log = http_json(f"http://{peer['http']}/wsync_test/log")
            snaps = log["snapshots"]
            for v in (1, 2, 3):
                got = snaps.get(f"version:{v}")
                want = {str(rk): {n: h for n, (h, _, _) in ps.items()} for rk, ps in exps[v].items()}
                bad = [] if got is None else [(rk, n) for rk in want for n in want[rk] if got[rk].get(n) != want[rk][n]]
                check(got is not None and not bad,
                      f"update {v}: every parameter of both ranks bit-exact ({len(bad)} differ: {bad[:3]})")
            # Nothing written while serving: each pause saw the previous version's bytes.
            pauses = sorted((k for k in snaps if k.startswith("pause@")), key=lambda k: int(k.split("@")[1]))
            prev = [snaps["initial"]] + [snaps.get(f"version:{v}") for v in (1, 2)]
            check(len(pauses) == 3 and all(snaps[p] == q for p, q in zip(pauses, prev)),
                  f"the engine's bytes never changed while it served ({len(pauses)} pauses)")
            seq = [c["path"] for c in log["calls"] if c["path"] not in ("/server_info", "/model_info")]
            one = ["/pause_generation", "/begin_weight_update", "/end_weight_update", "/update_weight_version",
                   "/flush_cache", "/continue_generation"]
            check(seq == one * 3, f"SGLang's call sequence, three times: {seq}")
            bodies = {c["path"]: c for c in log["calls"]}
            check(bodies["/pause_generation"]["body"] == {"mode": "retract"} and
                  bodies["/begin_weight_update"]["body"] == {"selector": "target"} and
                  bodies["/update_weight_version"]["body"].get("abort_all_requests") is False and
                  not any(c.get("aborted_all_requests") for c in log["calls"]),
                  "request bodies: retract, selector target, abort_all_requests false")
            check(http_json(f"http://{peer['http']}/model_info")["weight_version"] == "3", "SGLang reports version 3")

            # --- the engine dies while post-processing update 4: the update fails naming it, nothing continues
            procs.kill("peer")
            procs.kill("target")
            peer = start_peer("peer2", layout, ["--die-on", "/end_weight_update"])
            tport = start_target("target2", peer, coord)
            harness.wait_for("target2 registered", lambda: harness.read_port_file(tport), 60, procs, ["target2"])
            r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                                "--first-version", "4", "--drive", "--coordinator", coord],
                               capture_output=True, text=True, timeout=180)
            last = harness.last_update_record(b, coord)
            check(r.returncode != 0 and str(last.get("version")) == "4" and last.get("success") is False and
                  "sgl0" in last.get("error", "") and "post_process" in last.get("error", ""),
                  f"engine death in post-processing fails update 4 naming it: {last.get('error', '')[:300]}")
        finally:
            procs.close()
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
