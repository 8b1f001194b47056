#!/usr/bin/env python3
"""End-to-end test of the Python client (wsync_client over libwsync_client_c.so).

Starts a tiny local cluster on 127.0.0.1 (coordinator, one reference engine at TP 2, one target and one source
wsyncd), pushes update 1 from Python with weights generated here by an independent numpy port of the deterministic
generator (tools/weight_gen.cc), commits it and asks the engine to verify bit-exactly (wsyncctl verify). Then checks
that a tensor of the wrong shape comes back as a WsyncError naming it. Exit 0 pass, 1 fail, 77 skipped.
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

DEADLINE_S = 50  # the whole test, cluster start included (CTest's TIMEOUT is 60)

try:
    import numpy as np
except ImportError:
    print("SKIP: numpy is not installed for %s (apt-get install python3-numpy)" % sys.executable)
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))

U64 = (1 << 64) - 1


def splitmix_int(x):
    x = (x + 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def splitmix_np(x):
    # uint64 arithmetic in numpy wraps modulo 2^64, as in C++.
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def tensor_seed(name, step):
    h = 1469598103934665603  # FNV-1a over the name's bytes
    for c in name.encode():
        h = ((h ^ c) * 1099511628211) & U64
    return splitmix_int(h ^ splitmix_int(step & U64))


def generate_bf16(name, step, shape):
    """bf16 bits (uint16 array of `shape`) of tensor `name` at `step`: four 16-bit lanes per 64-bit draw."""
    n = int(np.prod(shape)) if len(shape) else 1
    seed = np.uint64(tensor_seed(name, step))
    with np.errstate(over="ignore"):
        draws = splitmix_np(seed + np.arange(0, n, 4, dtype=np.uint64))
    lanes = ((draws[:, None] >> (np.arange(4, dtype=np.uint64) * np.uint64(16))) & np.uint64(0xFFFF))
    lanes = lanes.astype(np.uint16).reshape(-1)[:n]
    # random sign and mantissa, exponent in [0x77, 0x7e]
    bits = (lanes & np.uint16(0x807F)) | ((np.uint16(0x77) + ((lanes >> np.uint16(7)) & np.uint16(7))) << np.uint16(7))
    return bits.astype(np.uint16).reshape(shape)


def qwen3_checkpoint(cfg):
    """HF tensor name -> shape of a dense Qwen3 checkpoint (all bf16), written from the HF modeling code's layout."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    t = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        t[p + "self_attn.q_proj.weight"] = (nh * d, h)
        t[p + "self_attn.k_proj.weight"] = (kv * d, h)
        t[p + "self_attn.v_proj.weight"] = (kv * d, h)
        t[p + "self_attn.o_proj.weight"] = (h, nh * d)
        t[p + "self_attn.q_norm.weight"] = (d,)
        t[p + "self_attn.k_norm.weight"] = (d,)
        t[p + "mlp.gate_proj.weight"] = (i, h)
        t[p + "mlp.up_proj.weight"] = (i, h)
        t[p + "mlp.down_proj.weight"] = (h, i)
        t[p + "input_layernorm.weight"] = (h,)
        t[p + "post_attention_layernorm.weight"] = (h,)
    t["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (v, h)
    return t


def _die_with_parent():
    # PR_SET_PDEATHSIG: a daemon must not outlive this script, even if the script is killed (e.g. by a CTest timeout).
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Cluster:
    def __init__(self, args, work):
        self.args, self.work, self.procs = args, work, []

    def start(self, name, cmd):
        log = open(os.path.join(self.work, name + ".log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             preexec_fn=_die_with_parent)
        log.close()
        self.procs.append((name, p))
        return p

    def wait_port(self, name, proc, deadline):
        f = os.path.join(self.work, name + ".port")
        while time.monotonic() < deadline:
            if os.path.exists(f) and os.path.getsize(f) > 0:
                return "127.0.0.1:%d" % int(open(f).read().strip())
            if proc.poll() is not None:
                raise RuntimeError("%s exited (%d) before serving:\n%s" % (name, proc.returncode, self.log(name)))
            time.sleep(0.05)
        raise RuntimeError("%s did not serve in time:\n%s" % (name, self.log(name)))

    def log(self, name, lines=20):
        try:
            with open(os.path.join(self.work, name + ".log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


def run(args, cluster, deadline):
    from wsync_client import Coordinator, Trainer, WsyncError

    work = cluster.work
    with open(args.model) as f:
        specs = qwen3_checkpoint(json.load(f))
    p = cluster.start("coordinator", [args.coordinator, "--listen", "127.0.0.1:0",
                                      "--port-file", os.path.join(work, "coordinator.port")])
    coord_addr = cluster.wait_port("coordinator", p, deadline)
    p = cluster.start("engine", [args.engine_ref, "--id", "pyengine%d" % os.getpid(), "--model", args.model,
                                 "--tp", "2", "--listen", "127.0.0.1:0",
                                 "--port-file", os.path.join(work, "engine.port")])
    engine_addr = cluster.wait_port("engine", p, deadline)
    p = cluster.start("target", [args.wsyncd, "--role", "target", "--node-id", "py-infer0",
                                 "--coordinator", coord_addr, "--engine", engine_addr, "--transport", "tcp",
                                 "--engine-socket", os.path.join(work, "target.sock"), "--listen", "127.0.0.1:0", "--port-file", os.path.join(work, "target.port")])
    cluster.wait_port("target", p, deadline)
    p = cluster.start("source", [args.wsyncd, "--role", "source", "--node-id", "py-train0",
                                 "--coordinator", coord_addr, "--trainer-ranks", "1", "--ring-mib", "16",
                                 "--transport", "tcp", "--listen", "127.0.0.1:0",
                                 "--port-file", os.path.join(work, "source.port")])
    source_addr = cluster.wait_port("source", p, deadline)
    print("cluster: coordinator %s, engine %s, source %s" % (coord_addr, engine_addr, source_addr))

    version = 1
    with Coordinator(coord_addr) as coord, Trainer(source_addr, local_rank=0, global_rank=0) as trainer:
        st = coord.status()
        check(len(st.get("nodes", [])) == 2, "status lists the 2 daemons")

        coord.begin_update(version)
        names = trainer.begin_push(version)
        check(sorted(names) == sorted(specs), "push filter names every checkpoint tensor (%d)" % len(names))
        for k, name in enumerate(names):
            bits = generate_bf16(name, version, specs[name])
            if k % 2 == 0:
                trainer.push(name, bits, dtype="bfloat16")
            else:
                trainer.push(name, bits.view(np.uint16), dtype="bf16")  # alias spelling
        trainer.end_push(version)
        stats = trainer.stats()
        want_bytes = sum(2 * int(np.prod(s)) for s in specs.values())
        check(stats["tensors"] == len(specs) and stats["bytes"] == want_bytes,
              "stats count %d tensors / %d bytes" % (stats["tensors"], stats["bytes"]))
        rec = coord.commit_update(version, timeout=max(5.0, deadline - time.monotonic() - 15))
        check(rec.get("success") is True, "update %d committed: %s" % (version, rec.get("error") or "success"))
        check(rec.get("version") == version and rec.get("engine_ranks") == 2 and rec.get("bytes", 0) > 0,
              "record has version %s, %s engine ranks, %s bytes" % (rec.get("version"), rec.get("engine_ranks"),
                                                                   rec.get("bytes")))
        hist = coord.history(5)
        check(len(hist) >= 1 and hist[-1]["version"] == version, "history ends with update %d" % version)

        verify = [args.wsyncctl, "verify", "--engine", engine_addr, "--step", str(version)]
        r = subprocess.run(verify, capture_output=True, text=True, timeout=20)
        print(r.stdout.strip())
        check(r.returncode == 0, "engine verifies step %d bit-exact (wsyncctl rc %d %s)"
              % (version, r.returncode, r.stderr.strip()))
        # The engine must notice other bits; otherwise the check above proves nothing.
        r = subprocess.run(verify[:-1] + [str(version + 1)], capture_output=True, text=True, timeout=20)
        check(r.returncode != 0, "engine rejects step %d (wsyncctl rc %d)" % (version + 1, r.returncode))

        # Errors: caught in Python, then one only the daemon can catch (a shape its model does not have).
        try:
            trainer.push("model.norm.weight", np.zeros(specs["model.norm.weight"], np.uint16))
            check(False, "uint16 without dtype is refused")
        except WsyncError as e:
            check(e.code == 3 and "model.norm.weight" in e.message, "uint16 without dtype: %s" % e)

        # The C API itself checks the byte count against shape and dtype, naming the tensor.
        from wsync_client import _lib
        lib = _lib.lib()
        shape = (ctypes.c_int64 * 1)(64)
        buf = ctypes.create_string_buffer(64)
        rc = lib.wsync_trainer_push(trainer._handle(), b"model.norm.weight", b"bfloat16", shape, 1, buf, 64)
        msg = lib.wsync_last_error().decode()
        check(rc == 3 and "model.norm.weight" in msg and "128" in msg, "C API refuses 64 bytes for [64] bf16: " + msg)
        check(lib.wsync_trainer_last_error(trainer._handle()).decode() == msg, "the handle keeps the same message")

        bad_version = version + 1
        coord.begin_update(bad_version)
        names = trainer.begin_push(bad_version)
        bad = "model.embed_tokens.weight"
        check(bad in names, "%s is asked for again" % bad)
        wrong = tuple(reversed(specs[bad]))  # same bytes, wrong shape
        try:
            trainer.push(bad, generate_bf16(bad, bad_version, wrong), dtype="bfloat16")
            trainer.flush()  # the daemon validates the bucket when it is handed over
            check(False, "a wrong shape is refused")
        except WsyncError as e:
            check(e.code == 3 and bad in e.message, "wrong shape refused by the daemon: %s" % e)
        trainer.end_push(bad_version)  # the refused bucket is this update's failure, not the session's
        t0 = time.monotonic()
        try:
            coord.commit_update(bad_version, timeout=10)
            check(False, "the refused update does not commit")
        except WsyncError as e:
            check(e.code == 10 and bad in e.message,
                  "commit of the refused update aborts after %.2f s: %s" % (time.monotonic() - t0, e))
        last = coord.history(1)
        check(last and last[-1]["version"] == bad_version and last[-1]["success"] is False,
              "history records update %d as failed" % bad_version)

        # `with coord.update(v)`: an exception in the body aborts the update (recorded, engines stay paused), the
        # exception propagates; then a clean update through the context manager commits.
        aborted_version = bad_version + 1
        try:
            with coord.update(aborted_version):
                trainer.begin_push(aborted_version)
                raise RuntimeError("loss is NaN")
            check(False, "the body's exception propagates")
        except RuntimeError as e:
            check("NaN" in str(e), "the body's exception propagates: %s" % e)
        last = coord.history(1)[-1]
        check(last["version"] == aborted_version and last.get("aborted") is True and "loss is NaN" in last["error"],
              "history records update %d as aborted with the reason: %s" % (aborted_version, last.get("error")))
        try:
            trainer.end_push(aborted_version)
            check(False, "pushes of an aborted update are refused")
        except WsyncError as e:
            check(e.code == FAILED_PRECONDITION_CODE, "end_push of the aborted update refused: %s" % e)
        try:
            coord.resume_engines()  # update 2 failed after its sources started: engines may hold its bytes
            check(False, "resume refused while engines may hold partial writes")
        except WsyncError as e:
            check(e.code == FAILED_PRECONDITION_CODE and "mixed" in e.message, "resume refused: %s" % e)
        # push_many over a state-dict-like iterable: the filter's tensors pushed, others skipped, a missing one named.
        many = aborted_version + 1
        coord.begin_update(many)
        names = trainer.begin_push(many)
        items = [(n, generate_bf16(n, many, specs[n]).view(np.uint16)) for n in names] + \
                [("not.in.the.filter", np.zeros(4, np.uint16))]
        r = trainer.push_many(iter(items), names=names, dtype="bfloat16")
        check(r["pushed"] == len(names) and r["skipped"] == ["not.in.the.filter"],
              "push_many pushes the filter, skips the rest: %s" % r)
        trainer.end_push(many)
        rec = coord.commit_update(many, timeout=20)
        check(rec.get("success") is True, "update %d via push_many committed" % many)
        try:
            trainer.push_many([("not.in.the.filter", np.zeros(4, np.uint16))], names=names[:1], dtype="bfloat16")
            check(False, "push_many names the filter tensors it did not get")
        except WsyncError as e:
            check(names[0] in e.message, "push_many names the missing tensor: %s" % e)
        good = many + 1
        # `wsyncctl watch` follows the next update from the outside and ends with it.
        watch = subprocess.Popen([args.wsyncctl, "watch", "-w", "json", "--interval", "0.02", "--for", "60",
                                  "--endpoints", coord_addr], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        with coord.update(good):
            for k, name in enumerate(trainer.begin_push(good)):
                bits = generate_bf16(name, good, specs[name])
                if len(bits.shape) == 2 and bits.shape[0] % 2 == 0 and name.endswith("q_proj.weight"):
                    # Slices: two row halves; the daemon assembles the tensor (the engine verifies it below).
                    half = bits.shape[0] // 2
                    trainer.push_slice(name, bits[half:], bits.shape, [half, 0], dtype="bfloat16")
                    trainer.push_slice(name, np.ascontiguousarray(bits[:half]), bits.shape, [0, 0], dtype="bfloat16")
                else:
                    trainer.push(name, bits, dtype="bfloat16")
                if k % 8 == 7:
                    trainer.flush()
                    time.sleep(0.1)  # slow enough for the watcher to see progress
            trainer.end_push(good)
        check(coord.last_record.get("success") is True, "update %d committed through coord.update()" % good)
        out, _ = watch.communicate(timeout=60)
        samples = [json.loads(line) for line in out.splitlines() if line.strip()]
        running = [s for s in samples if s["state"] in ("updating", "committing")]
        check(watch.returncode == 0 and samples and samples[-1]["state"] == "idle" and
              samples[-1]["current_version"] == str(good),
              "wsyncctl watch ends with the update (rc %s, %d samples, last %s)"
              % (watch.returncode, len(samples), samples[-1] if samples else None))
        check(any(s["bytes_expected"] > 0 and s["sources"] and s["sources"][0]["trainer_ranks"] == 1
                  for s in running), "watch saw the update running with its expected bytes (%d running samples)"
              % len(running))
        r = subprocess.run([args.wsyncctl, "verify", "--engine", engine_addr, "--step", str(good)],
                           capture_output=True, text=True, timeout=20)
        check(r.returncode == 0, "engine verifies step %d bit-exact (rc %d)" % (good, r.returncode))
        check(str(coord.resume_engines().get("version")) == str(good), "resume allowed after a successful update")

FAILED_PRECONDITION_CODE = 9


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--coordinator", required=True, help="wsync-coordinator binary")
    ap.add_argument("--wsyncd", required=True, help="wsyncd binary")
    ap.add_argument("--engine-ref", required=True, help="wsync-engine-ref binary")
    ap.add_argument("--wsyncctl", required=True, help="wsyncctl binary")
    ap.add_argument("--lib", required=True, help="libwsync_client_c.so")
    ap.add_argument("--model", required=True, help="HF config.json of a dense Qwen3 model")
    args = ap.parse_args()
    for path in (args.coordinator, args.wsyncd, args.engine_ref, args.wsyncctl, args.lib, args.model):
        if not os.path.exists(path):
            print("FAIL: %s does not exist (build the targets first)" % path)
            return 1
    os.environ["WSYNC_CLIENT_LIB"] = args.lib

    deadline = time.monotonic() + DEADLINE_S
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="wsync-pytest.", dir=base)
    cluster = Cluster(args, work)
    rc = 0
    # A call blocked in the C library cannot be interrupted from Python; stopping the cluster makes it fail instead.
    watchdog = threading.Timer(DEADLINE_S, cluster.stop)
    watchdog.daemon = True
    watchdog.start()
    try:
        run(args, cluster, deadline)
        print("PASS (%.1f s)" % (DEADLINE_S - (deadline - time.monotonic())))
    except Exception:
        traceback.print_exc()
        for name, _ in cluster.procs:
            print("--- %s log (tail)\n%s" % (name, cluster.log(name)))
        print("FAIL")
        rc = 1
    finally:
        watchdog.cancel()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
