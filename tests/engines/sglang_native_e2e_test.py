#!/usr/bin/env python3
"""wsync updating SGLang's own code through SGLang's P2P contract (issue 9, item 3a "better still"; item 3b).

The peer (tests/engines/sglang_native_peer.py, TP=2, one process) is SGLang 0.5.23 itself wherever the contract
lives: its model class built on the CPU and loaded by its own loader, its own RemoteInstanceWeightTransporter and
register_memory_region (the real Mooncake TransferEngine, tcp), its own EngineInfoBootstrapServer, and its own HTTP
app (routes, io_struct request validation, response texts) with a recording tokenizer manager behind it.

Processes: coordinator, a source wsyncd driven by the trainer demo, a target wsyncd started as the engine's adapter
(--engine sglang+http://…?bootstrap=…&config=…), and the peer. Checks:
  * every update lands bit-exactly: the peer's sha256 of every parameter of both ranks, taken when the version is set,
    equals the expectation computed by SGLang's own loaders fed the trainer's tensors for that step, in a separate
    process (sglang_native_peer.py --expect), i.e. not through wsync's replica;
  * nothing is written while the engine serves (each pause sees the previous version's bytes);
  * every control request passes SGLang's own validation (none rejected), as the io_struct classes SGLang built from
    them: PauseGenerationReqInput(mode=retract), BeginWeightUpdateReqInput(selector=target),
    UpdateWeightVersionReqInput(abort_all_requests=False), ContinueGenerationReqInput; and the validation is live: a
    body SGLang must refuse is refused (400) and recorded;
  * failure paths: a rank that never registered (SGLang's bootstrap answers 404) is refused naming the rank; the
    engine dying in end_weight_update fails the update naming the engine, which is never continued;
  * a speculative draft (--draft-model, a DeepSeek-V3 with a next-n layer; the peer with --draft): each rank's NextN
    draft runner registers after its target through SGLang's own transporter, as SGLang's scheduler orders them, and
    SGLang's bootstrap then holds the draft's table for every rank, the target's gone; the adapter refuses the engine
    before anything is paused or written, naming each rank's entry as the draft runner's.

  sglang_native_e2e_test.py --bin build/bin --model tests/data/tiny/qwen3-tiny.json
  (WSYNC_MOONCAKE_PYTHON: run_mooncake_test.sh; WSYNC_PYTHON: tests/replica/sglang_venv.sh)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

TP = 2
check = harness.Checks()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True, help="an HF config.json (tests/data/tiny/qwen3-tiny.json)")
    ap.add_argument("--draft-model", default=os.path.join(HERE, "..", "data", "tiny", "deepseek-v3-mtp-tiny.json"),
                    help="an HF config.json with a next-n layer, served with a NextN draft (the draft phase, tcp)")
    ap.add_argument("--protocol", choices=["tcp", "rdma"], default="tcp",
                    help="the engine's MOONCAKE_PROTOCOL and the sources' WSYNC_MOONCAKE_PROTOCOL (rdma: inside the "
                         "soft-RoCE VM, device $RXE_DEV; only the three updates: the failure phases do not depend "
                         "on the protocol and run in the tcp variant)")
    ap.add_argument("--expect-file", help="the expectation (sglang_native_peer.py --expect 0,1,2,3 output) computed "
                                          "beforehand, e.g. on the host before the VM boots")
    args = ap.parse_args()
    os.environ["WSYNC_MOONCAKE_PROTOCOL"] = args.protocol  # the source daemon's mooncake transport
    if args.protocol == "rdma":
        if not os.environ.get("RXE_DEV"):
            ap.error("--protocol rdma runs inside the soft-RoCE VM (RXE_DEV unset)")
        os.environ["WSYNC_MOONCAKE_DEVICE"] = os.environ["RXE_DEV"]
    mpy, spy = os.environ.get("WSYNC_MOONCAKE_PYTHON"), os.environ.get("WSYNC_PYTHON")
    if not mpy or not spy:
        ap.error("WSYNC_MOONCAKE_PYTHON (run_mooncake_test.sh) and WSYNC_PYTHON (sglang_venv.sh) are required")
    msite = subprocess.run([mpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    b = os.path.abspath(args.bin)
    peer_py = os.path.join(HERE, "sglang_native_peer.py")

    with harness.workdir("wsync-sglang-native-") as wd:
        procs = harness.Procs(wd)
        model_dir = os.path.join(wd, "model")
        os.makedirs(model_dir)
        cfg = os.path.join(model_dir, "config.json")
        shutil.copy(args.model, cfg)
        env = {"MOONCAKE_PROTOCOL": args.protocol}  # read by SGLang's transporter (envs.MOONCAKE_PROTOCOL)
        if args.protocol == "rdma":
            env["MOONCAKE_DEVICE"] = os.environ["RXE_DEV"]

        t0 = time.time()
        if args.expect_file:
            exps = json.load(open(args.expect_file))
        else:
            r = subprocess.run([spy, "-W", "ignore", peer_py, "--config", cfg, "--tp", str(TP), "--mooncake-site",
                                msite, "--expect", "0,1,2,3"], capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                harness.fail(f"expectation (SGLang's loaders) failed:\n{r.stderr[-3000:]}")
            exps = json.loads(r.stdout.strip().splitlines()[-1])
            harness.log(f"expectation: SGLang's own loaders, 4 steps x {TP} ranks, {time.time() - t0:.1f} s")
        check(sorted(exps) == ["0", "1", "2", "3"] and all(len(exps[k]) == TP for k in exps),
              "expectation for steps 0..3, both ranks")

        def start_peer(name, extra=(), config=cfg):
            t = time.time()
            procs.start(name, [spy, "-W", "ignore", peer_py, "--config", config, "--tp", str(TP), "--mooncake-site",
                               msite, *extra], env=env)
            log = os.path.join(wd, f"{name}.log")

            def ready():
                for line in open(log).read().splitlines():
                    if line.startswith("{") and '"ready"' in line:
                        return json.loads(line)
                return None
            # Under the VM's software emulation SGLang's import and model build take many minutes.
            p = harness.wait_for(f"{name} ready", ready, 300 if args.protocol == "tcp" else 1000, procs, [name])
            harness.log(f"{name}: SGLang peer up in {time.time() - t:.1f} s, sessions {p['sessions']}")
            return p

        def start_target(name, peer, coord, config=cfg):
            addr = f"sglang+http://{peer['http']}?bootstrap={peer['bootstrap']}&config={config}&id=sgl0"
            procs.start(name, [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id", "sgl-node",
                               "--coordinator", coord, "--engine", addr, "--engine-timeout", "20",
                               "--port-file", os.path.join(wd, f"{name}.port")])
            return os.path.join(wd, f"{name}.port")

        def start_coord(name):
            procs.start(name, [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0",
                               "--port-file", os.path.join(wd, f"{name}.port")])
            return "127.0.0.1:%d" % harness.wait_for(name, lambda: harness.read_port_file(
                os.path.join(wd, f"{name}.port")), 30, procs, [name])

        try:
            if args.protocol == "tcp":
                # --- failure: rank 1 never registered with SGLang's bootstrap -> 404 -> refused before any write
                peer = start_peer("peer404", ["--missing-rank", "1"])
                coord0 = start_coord("coord0")
                start_target("target404", peer, coord0)
                rc = procs.procs["target404"].wait(60)
                log = procs.tail("target404", 20)
                check(rc != 0 and "TP rank 1" in log and "No transfer engine info for rank 1" in log,
                      f"SGLang's bootstrap 404 for rank 1: the adapter exits {rc} naming the rank and SGLang's text "
                      f"({log[-700:]!r})")
                procs.kill("peer404")

                # --- a speculative draft: SGLang's draft runner replaces each rank's bootstrap entry -> refused
                ddir = os.path.join(wd, "model-draft")
                os.makedirs(ddir)
                dcfg = os.path.join(ddir, "config.json")
                shutil.copy(args.draft_model, dcfg)
                t = time.time()
                peer = start_peer("peerdraft", ["--draft"], dcfg)
                pub = peer["published"]
                boot = {r: harness.http("GET", f"http://{peer['bootstrap']}/get_transfer_engine_info?rank={r}")
                        ["remote_instance_transfer_engine_info"] for r in map(str, range(TP))}
                check(all(boot[r] == pub[r]["draft"] and pub[r]["draft"][0] != pub[r]["target"][0] and
                          "model.layers.0.input_layernorm.weight" in pub[r]["target"][1] and
                          "model.layers.0.input_layernorm.weight" not in boot[r][1] and
                          "model.eh_proj.weight" in boot[r][1] for r in boot),
                      "SGLang's bootstrap holds each rank's draft table (the draft runner's own session), the target's "
                      f"replaced: {[(r, boot[r][0], len(boot[r][1]), pub[r]['target'][0]) for r in boot]}")
                start_target("targetdraft", peer, coord0, dcfg)
                rc = procs.procs["targetdraft"].wait(60)
                log = procs.tail("targetdraft", 5)
                want = ["SGLang engine sgl0", "runs a speculative draft model (speculative_algorithm NEXTN)",
                        "The target's memory cannot be located"] + [
                        f"TP rank {r}'s entry (Mooncake session {boot[str(r)][0]}, " for r in range(TP)]
                check(rc != 0 and all(w in log for w in want) and log.count("is the draft runner's") == TP,
                      f"the adapter refuses the draft-running engine (exit {rc}), naming each rank's entry as the "
                      f"draft runner's: {log[-900:]!r}")
                calls = [c["call"] for c in harness.http("GET", f"http://{peer['http']}/wsync_test/log")["calls"]
                         if "call" in c]
                check(calls == [], f"nothing was paused or opened on the draft-running engine: {calls}")
                procs.kill("peerdraft")
                procs.kill("coord0")
                harness.log(f"draft phase: {time.time() - t:.1f} s")

            # --- three updates into SGLang's own registered memory
            peer = start_peer("peer")
            check(all(len(v) == 3 for v in peer["registered"].values()),
                  f"SGLang's register_memory_region merged each rank into 3 registered buffers: {peer['registered']}")
            snaps0 = harness.http("GET", f"http://{peer['http']}/wsync_test/log")["snapshots"]["initial"]
            check(snaps0 == exps["0"], "the peer's initial weights are SGLang's load of step 0 (same expectation path)")
            coord = start_coord("coord")
            tport = start_target("target", peer, coord)
            harness.wait_for("target registered", lambda: harness.read_port_file(tport), 60, procs, ["target"])
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                   "train0", "--coordinator", coord, "--trainer-ranks", "1", "--ring-mib", "32",
                                   "--port-file", os.path.join(wd, "source.port"),
                                   "--trainer-socket", os.path.join(wd, "source.sock")])
            harness.wait_for("source", lambda: harness.read_port_file(os.path.join(wd, "source.port")), 60, procs,
                             ["source"])
            src = os.path.join(wd, "source.sock")  # the trainer socket
            t = time.time()
            r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", args.model, "--updates", "3",
                                "--first-version", "1", "--drive", "--coordinator", coord],
                               capture_output=True, text=True, timeout=300)
            print(r.stdout[-1500:], r.stderr[-1500:])
            harness.log(f"3 updates through the coordinator in {time.time() - t:.2f} s")
            check(r.returncode == 0, f"3 updates driven through the coordinator (trainer exit {r.returncode})")
            if args.protocol == "rdma":
                src_log = open(os.path.join(wd, "source.log"), errors="replace").read()
                check(f"verbs: using {os.environ['RXE_DEV']}" in src_log,
                      "the source wrote over rdma (its mooncake transport opened the RDMA device)")
            log = harness.http("GET", f"http://{peer['http']}/wsync_test/log")
            snaps = log["snapshots"]
            nparams = sum(len(v) for v in exps["1"].values())
            for v in (1, 2, 3):
                got = snaps.get(f"version:{v}")
                want = exps[str(v)]
                bad = [] if got is None else [(rk, n) for rk in want for n in want[rk] if got[rk].get(n) != want[rk][n]]
                check(got is not None and not bad and got != exps[str(v - 1)],
                      f"update {v}: all {nparams} parameters of both ranks equal SGLang's own load ({len(bad)} differ: "
                      f"{bad[:3]})")
            pauses = sorted((k for k in snaps if k.startswith("pause@")), key=lambda k: int(k.split("@")[1]))
            prev = [snaps["initial"]] + [snaps.get(f"version:{v}") for v in (1, 2)]
            check(len(pauses) == 3 and all(snaps[p] == q for p, q in zip(pauses, prev)),
                  f"the engine's bytes never changed while it served ({len(pauses)} pauses)")
            check(log["rejected"] == [], f"SGLang's own validation accepted every request: {log['rejected'][:2]}")
            calls = [c for c in log["calls"] if "call" in c]
            seq = [c["call"] for c in calls]
            one = ["pause_generation", "begin_weight_update", "end_weight_update", "update_weight_version",
                   "flush_cache", "continue_generation"]
            check(seq == one * 3, f"SGLang's call sequence, three times: {seq}")
            paths = [c["path"] for c in log["calls"] if "http" in c]
            check("/health" not in paths, "/health never called")
            body = {c["call"]: c["body"] for c in calls}
            check(body["pause_generation"] == {"__class__": "PauseGenerationReqInput", "mode": "retract"} and
                  body["begin_weight_update"] == {"__class__": "BeginWeightUpdateReqInput", "selector": "target"} and
                  body["end_weight_update"] == {"__class__": "EndWeightUpdateReqInput"} and
                  body["update_weight_version"] == {"__class__": "UpdateWeightVersionReqInput", "new_version": "3",
                                                    "abort_all_requests": False} and
                  body["continue_generation"]["__class__"] == "ContinueGenerationReqInput" and
                  log["aborted_all"] == 0,
                  f"the requests as SGLang's io_struct classes built them: {body}")
            check(harness.http("GET", f"http://{peer['http']}/model_info")["weight_version"] == "3",
                  "SGLang's /model_info reports version 3")
            # The validation is live: what SGLang refuses is refused here too, and recorded.
            try:
                harness.http("POST", f"http://{peer['http']}/pause_generation", {"mode": "pause"})
                refused = False
            except harness.HttpError as e:
                refused = e.status == 400 and "retract" in e.body
            rej = harness.http("GET", f"http://{peer['http']}/wsync_test/log")["rejected"]
            check(refused and len(rej) == 1 and rej[0]["path"] == "/pause_generation",
                  "a body SGLang's io_struct refuses (mode 'pause') is refused with SGLang's 400 and recorded")

            if args.protocol == "tcp":
                # --- the engine dies while post-processing update 4: the update fails naming it, nothing continues
                procs.kill("peer")
                procs.kill("target")
                peer = start_peer("peer2", ["--die-on", "end_weight_update"])
                tport = start_target("target2", peer, coord)
                harness.wait_for("target2 registered", lambda: harness.read_port_file(tport), 60, procs, ["target2"])
                r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", args.model, "--updates",
                                    "1", "--first-version", "4", "--drive", "--coordinator", coord],
                                   capture_output=True, text=True, timeout=180)
                last = harness.last_update_record(b, coord)
                check(r.returncode != 0 and str(last.get("version")) == "4" and last.get("success") is False and
                      "sgl0" in last.get("error", "") and "post_process" in last.get("error", ""),
                      f"engine death in end_weight_update fails update 4 naming it: {last.get('error', '')[:300]}")
        finally:
            procs.close()
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
