#!/usr/bin/env python3
"""End-to-end test of the installable Python client (client/python), pure Python on grpcio + protobuf.

Outer stage (any python3): builds the wheel with `pip wheel` (its pyproject's build requirements, grpcio-tools
included, installed by pip into an isolated build environment) and installs it into a FRESH venv created for this
run, offline, from a wheelhouse of pinned versions (pyclient_wheel.PINS) that the harness downloads once from PyPI
into /var/cache/wsync/pyclient-wheelhouse-<pins>. No libwsync_client_c.so is anywhere on the path. PyPI's torch
(pyclient_wheel.TORCH_PIN, the CUDA build with its runtime wheels, ~4.7 GiB installed) is downloaded and installed
once into /var/cache/wsync/pyclient-site-<torch>-<python> and put on the venv's path by a .pth file, after the venv's
own packages: installing it into every fresh venv would cost minutes per run.

Inner stage (the fresh venv's python, `--inner`): starts a tiny local cluster on 127.0.0.1 (coordinator, one reference
engine at TP 2, one target and one source wsyncd), then
  * runs the README's Python quick-use block as written (the only name it is given is `state_dict`), and the engine
    verifies the weights bit-exactly (wsyncctl verify, the engine's independent check), and refuses the next step's;
  * pushes further updates (push, push_many, the update() context manager, an aborted update, a refused shape);
  * security of the trainer path: a process of another uid (run as `nobody` through setpriv) is refused with a
    message naming its uid and gid; a wrong session id is refused on every TrainerIngest call; the daemon's TCP
    listener does not serve TrainerIngest; a TCP address is refused by the client; a dead socket path fails within
    the connect timeout, naming the path (Python client and the C++ client through wsync-trainer-demo);
  * real torch tensors (run_torch): a module's state_dict() in bf16, row views of a fused tensor, a non-contiguous
    view, column slices through push_slice, named_parameters(); update() aborting mid-push; meta tensors and CUDA
    tensors in a process without CUDA refused; random torch weights checked by `wsyncctl verify` against the
    checksums the source recorded (and, independently, replicated norms found byte for byte in each engine rank's
    memory), then one byte of the engine's memory changed through /proc/PID/fd, which verify must name with its rank;
    client/python/README.md's block run as written with a torch `model`.
Exit 0 pass, 1 fail.
"""

import argparse
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

DEADLINE_S = 240  # the inner stage, cluster start and the first torch import included
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
FAILED_PRECONDITION_CODE = 9
sys.path.insert(0, HERE)

try:  # numpy: the inner stage imports it (the fresh venv has it); other tests import generate_bf16 from here
    import numpy as np
except ImportError:
    np = None

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


SPARSE_BASE = 1000000  # tools/testdata/weight_gen.h: kSparseStepBase, kSparseMaxSteps, kSparseChangePerMille
SPARSE_MAX_STEPS = 64
SPARSE_PER_MILLE = 20


def bf16_from_lanes(lanes):
    return (lanes & np.uint16(0x807F)) | ((np.uint16(0x77) + ((lanes >> np.uint16(7)) & np.uint16(7))) << np.uint16(7))


def generate_step_bf16(name, step, shape):
    """generate_bf16, with weight_gen's sparse steps: from SPARSE_BASE on, each step gives ~2 % of the elements a new
    value (that step's dense value), the others keeping the previous step's."""
    if step <= SPARSE_BASE or step > SPARSE_BASE + SPARSE_MAX_STEPS:
        return generate_bf16(name, step, shape)
    out = generate_bf16(name, SPARSE_BASE, shape).reshape(-1).copy()
    j = np.arange(out.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(SPARSE_BASE + 1, step + 1):
            seed = np.uint64(tensor_seed(name, k))
            pick = np.uint64(splitmix_int(int(seed) ^ 0x5DEECE66D))
            mask = splitmix_np(pick + j) % np.uint64(1000) < np.uint64(SPARSE_PER_MILLE)
            r = splitmix_np(seed + (j[mask] & ~np.uint64(3))) >> (np.uint64(16) * (j[mask] & np.uint64(3)))
            out[mask] = bf16_from_lanes((r & np.uint64(0xFFFF)).astype(np.uint16))
    return out.reshape(shape)


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


def start_one_box(args, cluster, deadline, model, prefix, source_args=()):
    """A coordinator, a reference engine of `model` at TP 2, a target and a source wsyncd (one trainer rank) on
    127.0.0.1, tcp. Returns (coordinator address, engine address, source address, the source's trainer socket)."""
    work = cluster.work
    p = cluster.start("coordinator", [args.coordinator, "--listen", "127.0.0.1:0",
                                      "--port-file", os.path.join(work, "coordinator.port")])
    coord_addr = cluster.wait_port("coordinator", p, deadline)
    p = cluster.start("engine", [args.engine_ref, "--id", "%sengine%d" % (prefix, os.getpid()), "--model", model,
                                 "--tp", "2", "--listen", "127.0.0.1:0",
                                 "--port-file", os.path.join(work, "engine.port")])
    engine_addr = cluster.wait_port("engine", p, deadline)
    p = cluster.start("target", [args.wsyncd, "--role", "target", "--node-id", prefix + "-infer0",
                                 "--coordinator", coord_addr, "--engine", engine_addr, "--transport", "tcp",
                                 "--engine-socket", os.path.join(work, "target.sock"), "--listen", "127.0.0.1:0",
                                 "--port-file", os.path.join(work, "target.port")])
    cluster.wait_port("target", p, deadline)
    sock = os.path.join(work, "source.sock")
    p = cluster.start("source", [args.wsyncd, "--role", "source", "--node-id", prefix + "-train0",
                                 "--coordinator", coord_addr, "--trainer-ranks", "1", "--transport", "tcp",
                                 "--listen", "127.0.0.1:0", "--trainer-socket", sock,
                                 "--port-file", os.path.join(work, "source.port")] + list(source_args))
    source_addr = cluster.wait_port("source", p, deadline)
    return coord_addr, engine_addr, source_addr, sock


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)




def readme_quick_use(path="README.md", marker="python-quick-use"):
    """A README's Python block after its `<!-- marker -->` line."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    m = re.search(r"<!-- %s -->\s*```python\n(.*?)```" % re.escape(marker), text, re.S)
    if not m:
        raise AssertionError("%s has no <!-- %s --> python block" % (path, marker))
    return m.group(1)


def check_tls(args, cluster, deadline):
    """The coordinator calls over mTLS (docs/security.md): certificates from WSYNC_TLS_*, the role checked by the
    coordinator; no certificate, no handshake; without TLS a non-loopback coordinator is refused before dialling."""
    from wsync_client import Coordinator, WsyncError
    certs = os.path.join(cluster.work, "certs")
    subprocess.run([os.path.join(ROOT, "tools", "cli", "wsync-certs.sh"), certs, "coordinator:py", "trainer:py"],
                   check=True, stdout=subprocess.DEVNULL, timeout=120)
    pem = lambda n: (os.path.join(certs, n + ".pem"), os.path.join(certs, n + "-key.pem"))
    cert, key = pem("coordinator-py")
    p = cluster.start("coordinator-tls", [args.coordinator, "--listen", "127.0.0.1:0", "--port-file",
                                          os.path.join(cluster.work, "coordinator-tls.port"),
                                          "--tls-ca", os.path.join(certs, "ca.pem"), "--tls-cert", cert,
                                          "--tls-key", key])
    ep = cluster.wait_port("coordinator-tls", p, deadline)
    saved = {k: os.environ.get(k) for k in ("WSYNC_TLS_CA", "WSYNC_TLS_CERT", "WSYNC_TLS_KEY")}
    try:
        os.environ["WSYNC_TLS_CA"] = os.path.join(certs, "ca.pem")
        os.environ["WSYNC_TLS_CERT"], os.environ["WSYNC_TLS_KEY"] = pem("trainer-py")
        with Coordinator(ep, dial_timeout=5) as c:
            check(c.status().get("state") == "idle", "mTLS: a trainer certificate reads the status")
            try:
                c.abort_update(99, "test")
                raise AssertionError("a trainer may not abort updates")
            except WsyncError as e:
                check(e.code_name == "PERMISSION_DENIED", "mTLS: AbortUpdate refused to a trainer (%s)" % e)
        for k in saved:
            os.environ.pop(k, None)
        with Coordinator(ep, dial_timeout=2) as c:
            try:
                c.status()
                raise AssertionError("a client without a certificate got an answer")
            except WsyncError as e:
                check(e.code_name == "UNAVAILABLE", "mTLS: no certificate, no handshake (%s)" % e.code_name)
        try:
            Coordinator("192.0.2.7:7600")
            raise AssertionError("a non-loopback coordinator was accepted without TLS")
        except WsyncError as e:
            check(e.code_name == "INVALID_ARGUMENT" and "loopback" in str(e),
                  "without TLS a non-loopback coordinator is refused: %s" % e)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_coordinator_from_env(Coordinator, WsyncError, coord_addr):
    """Coordinator() with no endpoint dials WSYNC_COORDINATOR, as wsyncctl and the deploy files do."""
    saved = os.environ.get("WSYNC_COORDINATOR")
    try:
        os.environ["WSYNC_COORDINATOR"] = coord_addr
        with Coordinator() as c:
            check(c.endpoint == coord_addr and c.status().get("state") == "idle",
                  "Coordinator() dials WSYNC_COORDINATOR=%s" % coord_addr)
        os.environ.pop("WSYNC_COORDINATOR")
        try:
            Coordinator()
            raise AssertionError("Coordinator() without WSYNC_COORDINATOR was accepted")
        except WsyncError as e:
            check(e.code_name == "INVALID_ARGUMENT" and "WSYNC_COORDINATOR" in str(e),
                  "Coordinator() without WSYNC_COORDINATOR names the variable: %s" % e)
    finally:
        if saved is None:
            os.environ.pop("WSYNC_COORDINATOR", None)
        else:
            os.environ["WSYNC_COORDINATOR"] = saved


def run(args, cluster, deadline):
    check_tls(args, cluster, deadline)
    from wsync_client import Coordinator, Trainer, WsyncError
    import grpc
    from wsync_client._proto.wsync.v1 import trainer_pb2, trainer_pb2_grpc

    work = cluster.work
    with open(args.model) as f:
        specs = qwen3_checkpoint(json.load(f))
    # One further allowed uid (not nobody's): the socket is then 0666 and SO_PEERCRED alone decides. A 1 MiB ring:
    # the updates below (~0.3 MiB each) wrap around it several times (padding frames, reuse of released space).
    coord_addr, engine_addr, source_addr, sock = start_one_box(
        args, cluster, deadline, args.model, "py", ["--ring-mib", "1", "--trainer-uid", "4242"])
    print("cluster: coordinator %s, engine %s, source %s (trainer socket %s)" % (coord_addr, engine_addr,
                                                                                 source_addr, sock))
    check(oct(os.stat(sock).st_mode & 0o777) == oct(0o666) and os.path.exists(sock + ".rpc"),
          "trainer socket is mode 0666 with --trainer-uid, its gRPC socket beside it")
    check_coordinator_from_env(Coordinator, WsyncError, coord_addr)

    def verify(step, expect_ok=True):
        r = subprocess.run([args.wsyncctl, "verify", "--engine", engine_addr, "--step", str(step)],
                           capture_output=True, text=True, timeout=20)
        check((r.returncode == 0) == expect_ok, "engine %s step %d (wsyncctl rc %d %s)"
              % ("verifies" if expect_ok else "rejects", step, r.returncode, r.stderr.strip()[-200:]))

    # 1. The README's quick use, as written; it is given the weights of step 1 as `state_dict` (bfloat16 arrays).
    os.environ["WSYNC_COORDINATOR"] = coord_addr
    os.environ["WSYNC_TRAINER_SOCKET"] = sock
    import ml_dtypes
    state_dict = {n: generate_bf16(n, 1, s).view(ml_dtypes.bfloat16) for n, s in specs.items()}
    scope = {"state_dict": state_dict}
    exec(compile(readme_quick_use(), "README.md:python-quick-use", "exec"), scope)
    verify(1)
    verify(2, expect_ok=False)  # the engine notices other bits; otherwise the check above proves nothing

    # 2. Security of the trainer path.
    probe = ("import sys\nfrom wsync_client import Trainer, WsyncError\n"
             "try:\n    Trainer(sys.argv[1], connect_timeout=5)\n    print('OPENED')\n"
             "except WsyncError as e:\n    print(e.code_name, e.message)\n")
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", probe,
                        sock], capture_output=True, text=True, timeout=30)
    out = (r.stdout + r.stderr).strip()
    nobody = int(subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True).stdout)
    nogroup = int(subprocess.run(["id", "-g", "nobody"], capture_output=True, text=True).stdout)
    check(out.startswith("PERMISSION_DENIED") and ("uid %d gid" % nobody) in out and "OPENED" not in out,
          "a process of uid %d (gid %d) is refused, named: %s" % (nobody, nogroup, out[-300:]))

    t0 = time.monotonic()
    missing = os.path.join(work, "no-daemon-here.sock")
    try:
        Trainer(missing, connect_timeout=5.0)
        check(False, "a missing socket path fails")
    except WsyncError as e:
        took = time.monotonic() - t0
        check(e.code == 5 and missing in e.message and "does not exist" in e.message and took < 0.5,
              "missing socket path fails at once: %s after %.2f s (connect timeout 5 s)" % (e, took))
    # A socket file nobody listens on (a daemon that died or restarts): retried until the connect timeout.
    dead = os.path.join(work, "dead-daemon.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(dead)
    t0 = time.monotonic()
    try:
        Trainer(dead, connect_timeout=1.0)
        check(False, "a dead socket path fails")
    except WsyncError as e:
        took = time.monotonic() - t0
        check(e.code == 4 and dead in e.message and 1.0 <= took < 1.6,
              "dead socket path: %s after %.2f s (connect timeout 1 s)" % (e, took))
    try:
        Trainer(source_addr)
        check(False, "a TCP address is refused")
    except WsyncError as e:
        check(e.code == 3 and "not a Unix socket path" in e.message, "TCP address refused: %s" % e)
    if args.trainer_demo:
        t0 = time.monotonic()
        r = subprocess.run([args.trainer_demo, "--daemon", dead, "--model", args.model, "--connect-timeout", "1"],
                           capture_output=True, text=True, timeout=30)
        took = time.monotonic() - t0
        check(r.returncode == 1 and dead in r.stderr and took < 2.5,
              "C++ client: dead socket path fails in %.2f s naming it: %s" % (took, r.stderr.strip()[-200:]))

    version = 2
    # Small buckets: many hand-overs, each overlapping the writing of the next (one in flight).
    with Coordinator(coord_addr) as coord, Trainer(sock, local_rank=0, global_rank=0, bucket_bytes=40000) as trainer:
        st = coord.status()
        check(len(st.get("nodes", [])) == 2, "status lists the 2 daemons")
        check(len(trainer.session_id) == 32 and int(trainer.session_id, 16) >= 0,
              "session id is 128 bits of hex (session %s)" % trainer.session)

        # A wrong session id is refused on every call; the TCP listener does not serve the trainer RPCs at all.
        stub = trainer_pb2_grpc.TrainerIngestStub(grpc.insecure_channel("unix:" + sock + ".rpc"))
        forged = "%032x" % (int(trainer.session_id, 16) ^ 1)
        for call, req in (("BeginPush", trainer_pb2.BeginPushRequest(session_id=forged, version=version)),
                          ("CommitBucket", trainer_pb2.CommitBucketRequest(session_id=forged, bucket_seq=0)),
                          ("EndPush", trainer_pb2.EndPushRequest(session_id=forged, version=version)),
                          ("CloseSession", trainer_pb2.CloseSessionRequest(session_id=forged))):
            try:
                getattr(stub, call)(req, timeout=5)
                check(False, "%s with a wrong session id is refused" % call)
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.PERMISSION_DENIED and forged not in e.details(),
                      "%s with a wrong session id: %s %s" % (call, e.code().name, e.details()))
        tcp = trainer_pb2_grpc.TrainerIngestStub(grpc.insecure_channel(source_addr))
        try:
            tcp.BeginPush(trainer_pb2.BeginPushRequest(session_id=trainer.session_id, version=version), timeout=5)
            check(False, "the TCP listener does not serve TrainerIngest")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.UNIMPLEMENTED, "TrainerIngest over TCP: %s" % e.code().name)

        # "no update is open" within the rank's own timeout.
        trainer.timeout = 2.0
        t0 = time.monotonic()
        try:
            trainer.begin_push(version)
            check(False, "begin_push without an open update fails")
        except WsyncError as e:
            took = time.monotonic() - t0
            check("no update is open" in e.message and took < 2.5,
                  "begin_push with no open update: %.2f s: %s" % (took, e))
        trainer.timeout = 60.0

        # Through the ring first (placement off).
        trainer.placement = False
        coord.begin_update(version)
        names = trainer.begin_push(version)
        check(sorted(names) == sorted(specs), "push filter names every checkpoint tensor (%d)" % len(names))
        # While it is open, status and watch show the update in progress (not the version served before it).
        rc, out, err = ctl(args, coord_addr, "status")
        check(rc == 0 and "in progress: update %d (updating)" % version in out,
              "wsyncctl status shows the open update %d: %s" % (version, (out + err).splitlines()[:1]))
        rc, out, err = ctl(args, coord_addr, "watch", "--once")
        check(rc == 0 and len(out.strip().splitlines()) == 1 and "update %d (serving" % version in out,
              "wsyncctl watch --once prints one line with the open update: %r" % out.strip())
        rc, out, _ = ctl(args, coord_addr, "status", "-o", "json")
        check(rc == 0 and json.loads(out).get("open_version") == version, "status -o json: open_version %d" % version)
        check(all(names.shapes.get(n) == tuple(specs[n]) and names.dtypes.get(n) == "bfloat16" for n in names),
              "begin_push returns the shape and dtype of each tensor (%s: %s %s)"
              % (names[0], names.shapes.get(names[0]), names.dtypes.get(names[0])))
        notes = []
        note_handler = logging.Handler()
        note_handler.emit = lambda rec: notes.append(rec.getMessage())
        logging.getLogger("wsync_client").addHandler(note_handler)
        for k, name in enumerate(names):
            bits = generate_bf16(name, version, specs[name])
            if k in (0, 3):
                # float32 for a bfloat16 tensor: converted by the daemon (exactly here: the values are bf16's), and
                # the client says so once for the update.
                import ml_dtypes
                trainer.push(name, bits.view(ml_dtypes.bfloat16).astype(np.float32))
            elif k % 3 == 0:
                trainer.push(name, bits, dtype="bfloat16")
            elif k % 3 == 1:
                trainer.push(name, bits.view(np.uint16), dtype="bf16")  # alias spelling
            else:
                trainer.push(name, np.asfortranarray(bits), dtype="bfloat16")  # non-contiguous source
        trainer.end_push(version)
        logging.getLogger("wsync_client").removeHandler(note_handler)
        check(len(notes) == 1 and "float32 tensors are converted to the model's bfloat16" in notes[0]
              and names[0] in notes[0], "one conversion note for the update: %s" % notes)
        stats = trainer.stats()
        want_bytes = sum(2 * int(np.prod(s)) for s in specs.values()) + \
            2 * sum(int(np.prod(specs[names[k]])) for k in (0, 3))  # the two float32 pushes are twice as big
        check(stats["tensors"] == len(specs) and stats["bytes"] == want_bytes and stats["buckets"] >= 7
              and stats["placed"] == 0,
              "stats count %d tensors / %d bytes in %d buckets" % (stats["tensors"], stats["bytes"], stats["buckets"]))
        rec = coord.commit_update(version, timeout=max(5.0, deadline - time.monotonic() - 30))
        check(rec.get("success") is True, "update %d committed: %s" % (version, rec.get("error") or "success"))
        check(rec.get("version") == version and rec.get("engine_ranks") == 2 and rec.get("bytes", 0) > 0,
              "record has version %s, %s engine ranks, %s bytes" % (rec.get("version"), rec.get("engine_ranks"),
                                                                   rec.get("bytes")))
        verify(version)
        # The same pushes copied straight into the replica (zero-copy placement, docs/operations.md: every tensor of
        # this bf16 model is offered), verified by the engine.
        version += 1
        trainer.placement = True
        coord.begin_update(version)
        names = trainer.begin_push(version)
        check(sorted(names) == sorted(specs), "push filter names every checkpoint tensor (%d)" % len(names))
        for k, name in enumerate(names):
            bits = generate_bf16(name, version, specs[name])
            if k % 3 == 0:
                trainer.push(name, bits, dtype="bfloat16")
            elif k % 3 == 1:
                trainer.push(name, bits.view(np.uint16), dtype="bf16")  # alias spelling
            else:
                trainer.push(name, np.asfortranarray(bits), dtype="bfloat16")  # non-contiguous source
        trainer.end_push(version)
        stats = trainer.stats()
        want_bytes = sum(2 * int(np.prod(s)) for s in specs.values())
        check(stats["tensors"] == len(specs) and stats["bytes"] == want_bytes
              and stats["placed"] == len(specs) and stats["buckets"] == 0,
              "placement: %d tensors / %d bytes, %d placed, %d buckets"
              % (stats["tensors"], stats["bytes"], stats["placed"], stats["buckets"]))
        rec = coord.commit_update(version, timeout=max(5.0, deadline - time.monotonic() - 30))
        check(rec.get("success") is True, "update %d committed: %s" % (version, rec.get("error") or "success"))
        verify(version)

        try:
            trainer.push("model.norm.weight", np.zeros(specs["model.norm.weight"], np.uint16))
            check(False, "uint16 without dtype is refused")
        except WsyncError as e:
            check(e.code == 3 and "model.norm.weight" in e.message, "uint16 without dtype: %s" % e)

        bad_version = version + 1
        coord.begin_update(bad_version)
        names = trainer.begin_push(bad_version)
        bad = "model.embed_tokens.weight"
        wrong = tuple(reversed(specs[bad]))  # same bytes, wrong shape
        try:
            trainer.push(bad, generate_bf16(bad, bad_version, wrong), dtype="bfloat16")
            trainer.flush()  # the daemon validates the bucket when it is handed over
            check(False, "a wrong shape is refused")
        except WsyncError as e:
            check(e.code == 3 and bad in e.message, "wrong shape refused by the daemon: %s" % e)
        # The source told the coordinator of the rejected bucket, which ends the update at once: the push may be
        # ended before or after that.
        try:
            trainer.end_push(bad_version)
        except WsyncError as e:
            check(e.code == FAILED_PRECONDITION_CODE and "has ended" in e.message,
                  "end_push after the update ended is refused as ended: %s" % e)
        try:
            coord.commit_update(bad_version, timeout=10)
            check(False, "the refused update does not commit")
        except WsyncError as e:
            check(e.code == 10 and bad in e.message, "commit of the refused update aborts: %s" % e)
        last = coord.history(1)
        check(last and last[-1]["version"] == bad_version and last[-1]["success"] is False,
              "history records update %d as failed" % bad_version)
        # After the failure, status names the failed update, why, and whether the engines hold partial writes.
        rc, out, _ = ctl(args, coord_addr, "status", "-w", "json")
        st = json.loads(out) if rc == 0 else {}
        check(st.get("state") == "failed" and st.get("failed_version") == bad_version and bad in st.get("failure", "")
              and st.get("open_version") == -1 and isinstance(st.get("engines_hold_partial_writes"), bool),
              "status -w json after the failure: failed_version %s, failure %r" % (st.get("failed_version"),
                                                                                   st.get("failure", "")[:160]))
        rc, out, _ = ctl(args, coord_addr, "status")
        check(rc == 0 and ("failed: update %d: " % bad_version) in out and bad in out,
              "wsyncctl status table names the failed update and why: %s" % out.splitlines()[:3])

        aborted_version = bad_version + 1
        try:
            with coord.update(aborted_version):
                trainer.begin_push(aborted_version)
                raise RuntimeError("loss is NaN")
        except RuntimeError as e:
            check("NaN" in str(e), "the body's exception propagates: %s" % e)
        last = coord.history(1)[-1]
        check(last["version"] == aborted_version and last.get("aborted") is True and "loss is NaN" in last["error"],
              "history records update %d as aborted with the reason: %s" % (aborted_version, last.get("error")))
        check(last.get("aborted_by") == "client exception: RuntimeError: loss is NaN",
              "history says who aborted it: %r" % last.get("aborted_by"))
        # Nothing of it was written. Whether the engines resume depends on the failed update before it: one whose bytes
        # may have reached them keeps them paused; the refused bucket above wrote nothing (the source ended that
        # update at once, and its end resumed them), so this abort resumes them too. Either way as the status said.
        dirty = st.get("engines_hold_partial_writes")
        states = {e["engine_id"]: e["state"] for n in coord.status()["nodes"] for e in n.get("engine_details", [])}
        check(coord.last_abort.get("engines_resumable") is (not dirty)
              and coord.last_abort.get("engines_resumed") is (not dirty)
              and states and all((s_ == "paused") == dirty for s_ in states.values()),
              "after an earlier failed update (partial writes: %s) the abort %s the engines: %s, engines %s"
              % (dirty, "leaves paused" if dirty else "resumes", coord.last_abort, states))
        try:
            trainer.end_push(aborted_version)
            check(False, "pushes of an aborted update are refused")
        except WsyncError as e:
            check(e.code == FAILED_PRECONDITION_CODE, "end_push of the aborted update refused: %s" % e)

        good = aborted_version + 1
        with coord.update(good):
            names = trainer.begin_push(good)
            # q_proj goes as two row-half slices (the daemon assembles it; the engine verifies it below).
            sliced = [n for n in names if n.endswith("q_proj.weight") and specs[n][0] % 2 == 0]
            whole = [n for n in names if n not in sliced]
            items = [(n, generate_bf16(n, good, specs[n]).view(np.uint16)) for n in whole] + \
                    [("not.in.the.filter", np.zeros(4, np.uint16))]
            r = trainer.push_many(iter(items), names=whole, dtype="bfloat16")
            check(r["pushed"] == len(whole) and r["skipped"] == ["not.in.the.filter"],
                  "push_many pushes the filter, skips the rest: %s" % r)
            for n in sliced:
                bits = generate_bf16(n, good, specs[n]).view(np.uint16)
                half = bits.shape[0] // 2
                trainer.push_slice(n, bits[half:], bits.shape, [half, 0], dtype="bfloat16")
                trainer.push_slice(n, np.ascontiguousarray(bits[:half]), bits.shape, [0, 0], dtype="bfloat16")
            check(len(sliced) > 0, "some tensors pushed as slices: %d" % len(sliced))
            trainer.end_push(good)
        check(coord.last_record.get("success") is True, "update %d committed through coord.update()" % good)
        verify(good)
        check(str(coord.resume_engines().get("version")) == str(good), "resume allowed after a successful update")

        # An operator's abort through wsyncctl: recorded as such, with the reason.
        by_ctl = good + 1
        coord.begin_update(by_ctl)
        p = subprocess.run([args.wsyncctl, "abort", str(by_ctl), "--reason", "bad data", "--endpoints", coord_addr],
                           capture_output=True, text=True, timeout=60)
        last = coord.history(1)[-1]
        check(p.returncode == 0 and last["version"] == by_ctl and last.get("aborted_by") == "operator (wsyncctl abort)"
              and "aborted by operator (wsyncctl abort): bad data" in last["error"],
              "wsyncctl abort recorded as the operator's (rc %d): %r, %r" % (p.returncode, last.get("aborted_by"),
                                                                           last.get("error")))
        coord.resume_engines()
        # An exception before any push, with clean engines: nothing of it was written, so they are resumed at once.
        clean_abort = by_ctl + 1
        try:
            with coord.update(clean_abort):
                trainer.begin_push(clean_abort)
                raise ValueError("bad batch")
        except ValueError:
            pass
        states = {e["engine_id"]: e["state"] for n in coord.status()["nodes"] for e in n.get("engine_details", [])}
        check(coord.last_abort.get("engines_resumable") is True and coord.last_abort.get("engines_resumed") is True
              and states and all(st == "serving" for st in states.values())
              and coord.history(1)[-1].get("aborted_by") == "client exception: ValueError: bad batch",
              "an abort that wrote nothing resumes the engines: %s, engines %s" % (coord.last_abort, states))
        good = clean_abort

        # Three more updates through push_update over a generator, through the ring (placement off): by now the 1 MiB
        # ring has wrapped.
        trainer.placement = False
        for extra in (good + 1, good + 2, good + 3):
            with coord.update(extra):
                trainer.push_update(extra, ((n, generate_bf16(n, extra, specs[n])) for n in specs), dtype="bfloat16")
            verify(extra)
        check(trainer._ring._write > trainer._ring.capacity, "the ring wrapped: position %d, capacity %d"
              % (trainer._ring._write, trainer._ring.capacity))

        trainer.placement = True
        run_torch(args, cluster, coord, trainer, specs, good + 4, verify, coord_addr)
    with Coordinator(coord_addr) as coord, Trainer(sock, local_rank=0, global_rank=0) as trainer:
        run_delta(coord, trainer, specs, verify)  # a new session: the README's block above replaced the last one


def run_delta(coord, trainer, specs, verify):
    """The delta option (docs/delta.md) from Python: consecutive sparse steps (~2 % of the elements change) go as
    deltas with the default (auto), dense with delta="off", as deltas with "always"; an unknown mode is refused.
    Every update is verified bit-exactly by the engine's own loader."""
    from wsync_client import WsyncError

    def one(version, delta):
        with coord.update(version, delta=delta):
            trainer.push_update(version, ((n, generate_step_bf16(n, version, specs[n])) for n in specs),
                                dtype="bfloat16")
        verify(version)
        verify(version - 1, expect_ok=False)
        rec = coord.last_record
        print("delta=%s: update %d sent %s of %s dense bytes; delta ranks %s; fallbacks %s"
              % (delta or "(default)", version, rec.get("sent_bytes"), rec.get("dense_bytes"), rec.get("delta_ranks"),
                 rec.get("fallbacks")))
        return rec

    v = SPARSE_BASE
    one(v, "")  # the engine ranks hold update 100 (a dense step): this one is the base of the next
    rec = one(v + 1, "")
    check(rec.get("delta_mode") == "auto" and len(rec.get("delta_ranks", [])) == 2 and not rec.get("fallbacks")
          and 0 < rec["sent_bytes"] < 0.1 * rec["dense_bytes"],
          "delta auto (default): both ranks took deltas, %s of %s bytes sent" % (rec.get("sent_bytes"),
                                                                               rec.get("dense_bytes")))
    rec = one(v + 2, "off")
    check(rec.get("delta_mode") == "off" and not rec.get("delta_ranks") and len(rec.get("fallbacks", [])) == 2
          and all("delta=off" in f.get("reason", "") for f in rec["fallbacks"])
          and rec["sent_bytes"] == rec["dense_bytes"],
          "delta=\"off\": every rank dense, reason delta=off: %s" % rec.get("fallbacks"))
    rec = one(v + 3, "always")
    check(rec.get("delta_mode") == "always" and len(rec.get("delta_ranks", [])) == 2
          and rec["sent_bytes"] < 0.1 * rec["dense_bytes"],
          "delta=\"always\": deltas again after a dense update, %s of %s bytes" % (rec.get("sent_bytes"),
                                                                                  rec.get("dense_bytes")))
    try:
        coord.begin_update(v + 4, delta="sometimes")
        check(False, "delta=\"sometimes\" is refused")
    except WsyncError as e:
        check(e.code == 3 and "sometimes" in e.message, "an unknown delta mode is refused, named: %s" % e)


def ctl(args, coord_addr, *cmd):
    """wsyncctl against the test's coordinator: (exit code, stdout, stderr)."""
    p = subprocess.run([args.wsyncctl, *cmd, "--endpoints", coord_addr], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def torch_module(tensors):
    """A real torch module holding `tensors` (HF name -> tensor) as its parameters, nested as the names say, so that
    `state_dict()` yields exactly those names."""
    import torch
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=t.is_floating_point()))
    return root


def step_tensor(name, step, shape):
    """Step `step`'s bf16 weights of `name` as a torch bfloat16 tensor (the bits the reference engine regenerates)."""
    import torch
    return torch.from_numpy(generate_bf16(name, step, shape).view(np.int16)).view(torch.bfloat16)


def engine_segments(cluster, rank):
    """The reference engine's weight memory of one rank, straight from its process: (path, bytes) of each memfd
    segment (/proc/PID/fd, as root)."""
    pid = dict(cluster.procs)["engine"].pid
    out = []
    for fd in sorted(os.listdir("/proc/%d/fd" % pid), key=int):
        path = "/proc/%d/fd/%s" % (pid, fd)
        try:
            link = os.readlink(path)
        except OSError:
            continue
        if re.search(r"memfd:wsync-engine-.*-r%d-s\d+" % rank, link):
            with open(path, "rb") as f:
                out.append((path, f.read()))
    if not out:
        raise AssertionError("no memfd segments of engine rank %d in /proc/%d/fd" % (rank, pid))
    return out


def wsyncctl_verify(args, coord_addr, *extra):
    r = subprocess.run([args.wsyncctl, "verify", "--endpoints", coord_addr] + list(extra), capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


def run_torch(args, cluster, coord, trainer, specs, version, verify, coord_addr):
    """Real torch tensors through the client: a module's state_dict (bf16), slices and non-contiguous views, the
    update() context manager aborting mid-push, tensors the client cannot read, and random weights checked by
    `wsyncctl verify` against the checksums the source recorded — then one engine byte corrupted in the engine's own
    memory, which verify must name."""
    import torch
    t_start = time.monotonic()
    check(torch.__version__.startswith("2.13.0"), "torch %s from PyPI in the venv (%s)"
          % (torch.__version__, os.path.dirname(torch.__file__)))

    # 1. push_many(model.state_dict().items()) of a real module holding step `version`'s weights.
    model = torch_module({n: step_tensor(n, version, s) for n, s in specs.items()})
    check(all(t.dtype == torch.bfloat16 for t in model.state_dict().values()), "the module's state_dict is bf16")
    with coord.update(version):
        names = trainer.begin_push(version)
        r = trainer.push_many(model.state_dict().items(), names=names)
        check(r["pushed"] == len(specs) and not r["skipped"], "push_many(model.state_dict().items()): %s" % r)
        trainer.end_push(version)
    check(coord.last_record.get("success") is True, "torch update %d committed" % version)
    verify(version)
    state_version = version

    # 2. Slices of torch tensors: q/k/v as row views of one fused qkv tensor (contiguous views at a storage offset),
    # gate_proj transposed twice (a non-contiguous view: copied contiguous by the client, as documented), up_proj as
    # two column halves (non-contiguous views) through push_slice, named_parameters() for the rest.
    version += 1
    w = {n: step_tensor(n, version, s) for n, s in specs.items()}
    with coord.update(version):
        names = set(trainer.begin_push(version))
        done = set()
        for layer in sorted({n.split(".")[2] for n in specs if n.startswith("model.layers.")}, key=int):
            p = "model.layers.%s." % layer
            q, k, v = (p + "self_attn.%s_proj.weight" % x for x in "qkv")
            qkv = torch.cat([w[q], w[k], w[v]])
            rows = [w[q].shape[0], w[k].shape[0], w[v].shape[0]]
            for name, part in zip((q, k, v), torch.split(qkv, rows)):
                assert part.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # a view, no copy
                trainer.push(name, part)
            gate = w[p + "mlp.gate_proj.weight"].t().contiguous().t()
            assert not gate.is_contiguous()
            trainer.push(p + "mlp.gate_proj.weight", gate)
            up = w[p + "mlp.up_proj.weight"].clone()
            half = up.shape[1] // 2
            trainer.push_slice(p + "mlp.up_proj.weight", up[:, half:], up.shape, [0, half])
            trainer.push_slice(p + "mlp.up_proj.weight", up[:, :half], up.shape, [0, 0])
            done |= {q, k, v, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}
        rest = torch_module({n: t for n, t in w.items() if n not in done})
        r = trainer.push_many(rest.named_parameters(), names=sorted(names - done))
        trainer.end_push(version)
    check(coord.last_record.get("success") is True and r["pushed"] == len(specs) - len(done),
          "update %d: fused-qkv row views, a non-contiguous gate_proj, column-half push_slice of up_proj, "
          "named_parameters() for the other %d" % (version, r["pushed"]))
    verify(version)

    # 3. Tensors the client cannot read are refused before anything enters the ring, naming the tensor.
    from wsync_client import WsyncError
    try:
        trainer.push("model.norm.weight", torch.empty(specs["model.norm.weight"], dtype=torch.bfloat16,
                                                      device="meta"))
        check(False, "a meta tensor is refused")
    except WsyncError as e:
        check(e.code == 3 and "model.norm.weight" in e.message and "meta" in e.message, "meta tensor: %s" % e)
    if torch.cuda.is_available():
        print("skip: a CUDA device is present; the refusal of CUDA tensors without one is checked on CPU-only hosts")
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():  # a tensor that says it is on cuda:0, as a GPU-less process cannot make a real one
            fake = torch.empty(specs["model.norm.weight"], dtype=torch.bfloat16, device="cuda")
        try:
            trainer.push("model.norm.weight", fake)
            check(False, "a CUDA tensor is refused without a CUDA device")
        except WsyncError as e:
            check(e.code == 3 and "model.norm.weight" in e.message and "cuda" in e.message
                  and "is_available" in e.message, "CUDA tensor on a GPU-less host: %s" % e)

    # 4. update() aborts on an exception raised while torch tensors are being pushed (after some went out).
    version += 1
    try:
        with coord.update(version):
            names = trainer.begin_push(version)
            for k, (n, t) in enumerate(model.state_dict().items()):
                if k == len(names) // 2:
                    trainer.flush()  # half the tensors handed over (and written): partial writes
                    raise FloatingPointError("loss is inf at step %d" % version)
                trainer.push(n, t)
    except FloatingPointError:
        pass
    last = coord.history(1)[-1]
    check(last["version"] == version and last.get("aborted") is True and "loss is inf" in last["error"],
          "torch update %d aborted by the exception: %s" % (version, last.get("error")))
    # Half of it was written: the engines stay paused (resuming would serve mixed weights).
    states = {e["engine_id"]: e["state"] for n in coord.status()["nodes"] for e in n.get("engine_details", [])}
    check(last.get("aborted_by", "").startswith("client exception: FloatingPointError: loss is inf")
          and coord.last_abort.get("engines_resumed") is False and states
          and all(st == "paused" for st in states.values()),
          "an abort after partial writes leaves the engines paused: %s, engines %s, by %r"
          % (coord.last_abort, states, last.get("aborted_by")))

    # 5. Random weights (no generator can regenerate them): verified against the checksums the source recorded.
    version += 1
    gen = torch.Generator().manual_seed(1234)
    rand = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in specs.items()}
    with coord.update(version):
        trainer.push_update(version, torch_module(rand).state_dict().items())
    check(coord.last_record.get("success") is True, "update %d of random torch weights committed" % version)
    rc, out, err = wsyncctl_verify(args, coord_addr)
    check(rc == 0 and out.strip().splitlines()[-1].startswith("verified: update %d" % version),
          "wsyncctl verify: random weights MATCH the source's checksums (rc %d): %s%s"
          % (rc, out.strip().splitlines()[-1] if out.strip() else "", err.strip()[-300:]))
    rc, out, _ = wsyncctl_verify(args, coord_addr, "-w", "json")
    doc = json.loads(out) if rc == 0 else {}
    n_params = len(doc.get("params", []))
    check(rc == 0 and doc["ok"] and doc["missing"] == 0 and doc["mismatched"] == 0 and n_params == doc["matched"]
          and {p["rank"] for p in doc["params"]} == {0, 1} and doc["version"] == version,
          "verify -w json: %d parameters on ranks 0 and 1 MATCH, none missing" % n_params)
    # Independently of any checksum: replicated parameters (norms) sit in each rank's memory byte for byte.
    norms = [n for n in specs if n.endswith("norm.weight")]
    for rank in (0, 1):
        mem = b"".join(data for _, data in engine_segments(cluster, rank))
        found = [n for n in norms if rand[n].view(torch.int16).numpy().tobytes() in mem]
        check(found == norms, "engine rank %d holds the %d norm tensors' exact bytes" % (rank, len(norms)))
    rc, out, _ = wsyncctl_verify(args, coord_addr, "--version", str(state_version))
    check(rc == 1 and "MISMATCH" in out, "verify --version %d (older weights, still recorded) fails: the engine "
          "holds update %d's (rc %d)" % (state_version, version, rc))

    # One byte of the engine's own memory changed (rank 1, inside model.norm.weight): verify names it and the rank.
    victim = "model.norm.weight"
    want = rand[victim].view(torch.int16).numpy().tobytes()
    hits = [(path, data.find(want)) for path, data in engine_segments(cluster, 1) if data.find(want) >= 0]
    check(len(hits) == 1, "%s found once in engine rank 1's memory" % victim)
    path, at = hits[0]
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, at + 5)
        os.pwrite(fd, bytes([old[0] ^ 0x40]), at + 5)
        rc, out, err = wsyncctl_verify(args, coord_addr)
        bad = [l for l in out.splitlines() if " MISMATCH " in l and not l.startswith("FAILED")]
        check(rc == 1 and len(bad) == 1 and victim in bad[0] and re.search(r"\s1\s+MISMATCH", bad[0]) is not None
              and out.strip().splitlines()[-1].startswith("FAILED"),
              "a corrupted byte: verify exits 1 naming the parameter and rank: %s" % (bad or out[-300:]))
        rc, out, _ = wsyncctl_verify(args, coord_addr, "-w", "json")
        doc = json.loads(out)
        check(rc == 1 and [(p["rank"], p["param"]) for p in doc["params"] if p["result"] == "MISMATCH"]
              == [(1, victim)] and doc["mismatched"] == 1, "verify -w json: exactly rank 1 %s MISMATCH" % victim)
        os.pwrite(fd, old, at + 5)
    finally:
        os.close(fd)
    rc, _, _ = wsyncctl_verify(args, coord_addr)
    check(rc == 0, "the byte restored: verify passes again")
    st = coord.status()
    engines = [e for n in st.get("nodes", []) for e in n.get("engine_details", [])]
    check(len(engines) == 1, "one engine registered")
    rc, out, _ = wsyncctl_verify(args, coord_addr, "--engine", engines[0]["engine_id"], "--all")
    rows = [l for l in out.splitlines() if " MATCH " in l]
    check(rc == 0 and len(rows) == n_params, "verify --engine %s --all lists all %d parameters as MATCH"
          % (engines[0]["engine_id"], len(rows)))
    rc, _, err = wsyncctl_verify(args, coord_addr, "--engine", "no-such-engine")
    check(rc == 2 and "no-such-engine" in err, "verify --engine no-such-engine: exit 2 naming it (%d)" % rc)
    rc, _, err = wsyncctl_verify(args, coord_addr, "--version", "999")
    check(rc == 1 and "999" in err and "keeps the last" in err, "verify --version 999: %s" % err.strip()[-200:])

    # client/python/README.md's block, as written: it is given a torch module as `model` (step 100's weights).
    readme_step = 100
    check(version < readme_step, "the client README's step %d is newer than update %d" % (readme_step, version))
    scope = {"model": torch_module({n: step_tensor(n, readme_step, s) for n, s in specs.items()})}
    exec(compile(readme_quick_use("client/python/README.md", "python-client-quick-use"),
                 "client/python/README.md:python-client-quick-use", "exec"), scope)
    check(scope["coord"].last_record.get("success") is True, "the client README's block committed update %d"
          % readme_step)
    verify(readme_step)
    print("ok: torch checks took %.1f s" % (time.monotonic() - t_start))


def prepare(args, work):
    """Wheel built, fresh venv with it installed (offline, from the pinned wheelhouse); returns the venv's python."""
    import pyclient_wheel as pw
    t0 = time.monotonic()
    venv = os.path.join(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    py = os.path.join(venv, "bin", "python")
    wheel = pw.build_wheel(work, python=py, cache=args.cache)
    # The wheel pulls grpcio and protobuf by its own requirements; numpy and ml_dtypes (bfloat16 arrays) are the test's.
    subprocess.run([py, "-m", "pip", "install", "-q", wheel] + pw.PINS[2:], check=True, timeout=300,
                   env=pw.offline_env(pw.wheelhouse(args.cache)))
    print("ok: built %s and installed it into a fresh venv in %.1f s" % (os.path.basename(wheel),
                                                                       time.monotonic() - t0))
    t0 = time.monotonic()
    pw.add_to_venv(py, pw.torch_site(py, cache=args.cache))
    print("ok: %s on the venv's path in %.1f s" % (pw.TORCH_PIN, time.monotonic() - t0))
    return py


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--coordinator", required=True, help="wsync-coordinator binary")
    ap.add_argument("--wsyncd", required=True, help="wsyncd binary")
    ap.add_argument("--engine-ref", required=True, help="wsync-engine-ref binary")
    ap.add_argument("--wsyncctl", required=True, help="wsyncctl binary")
    ap.add_argument("--trainer-demo", default="", help="wsync-trainer-demo binary (C++ client checks)")
    ap.add_argument("--model", required=True, help="HF config.json of a dense Qwen3 model")
    ap.add_argument("--cache", default="/var/cache/wsync", help="where the pinned wheelhouse is kept")
    ap.add_argument("--inner", default="", help="(internal) run the checks in this work directory")
    args = ap.parse_args()
    for path in (args.coordinator, args.wsyncd, args.engine_ref, args.wsyncctl, args.model):
        if not os.path.exists(path):
            print("FAIL: %s does not exist (build the targets first)" % path)
            return 1
    if os.geteuid() != 0:
        print("FAIL: the foreign-uid check runs a client as nobody (setpriv) and needs root; CI runs as root")
        return 1

    if not args.inner:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        work = tempfile.mkdtemp(prefix="wsync-pytest.", dir=base)
        os.chmod(work, 0o755)  # nobody must reach the trainer socket (and the venv) to be refused by the daemon
        try:
            py = prepare(args, work)
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            env.pop("WSYNC_CLIENT_LIB", None)
            r = subprocess.run([py, os.path.abspath(__file__)] + sys.argv[1:] + ["--inner", work], env=env)
            return r.returncode
        except Exception:
            traceback.print_exc()
            print("FAIL")
            return 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    global np
    import numpy
    np = numpy
    import wsync_client
    check(os.path.dirname(wsync_client.__file__).startswith(sys.prefix), "wsync_client comes from the venv (%s)"
          % wsync_client.__file__)
    deadline = time.monotonic() + DEADLINE_S
    cluster = Cluster(args, args.inner)
    rc = 0
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
    return rc


if __name__ == "__main__":
    sys.exit(main())
