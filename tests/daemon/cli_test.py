#!/usr/bin/env python3
"""Command-line contract of every binary (docs/operations.md, "Command lines, versions and exit codes"): --version
(the version of CMakeLists.txt), exit codes 0/1/2/3, validated --log-level, wsyncctl's global flags anywhere (every
option of the main command, also around `plan`), JSON with default-valued fields and numbers as numbers, examples in
--help, the bash completion against --help, watch's output while idle, the engines/history columns, connection errors
explained (nothing listening: exit 3 with the --endpoints hint; an mTLS coordinator without a client certificate or
with a foreign CA: exit 2, one line), --engine by id, wsyncd refusing a wildcard listen address without --advertise,
and SIGTERM stopping a daemon that is still retrying its registration."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import harness  # noqa: E402

check = harness.Checks()


def run(argv, timeout=30):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def read_until(proc, pred, timeout):
    """Reads proc's (text) stdout line by line until pred(line) holds or `timeout` s pass; returns the lines read.
    Waits on the stream itself: a daemon's log line is the event, not a sleep."""
    lines = []
    timer = threading.Timer(timeout, proc.kill)  # past the timeout the stream ends (EOF), and so does the loop
    timer.start()
    try:
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            if pred(line):
                break
    finally:
        timer.cancel()
    return lines


def check_empty_cluster(b, ep):
    """A coordinator nobody registered with: every table says what to start next, JSON agrees with the table."""
    ctl = b("wsyncctl")
    for sub in ("nodes", "engines", "status"):
        rc, out, _ = run([ctl, sub, "--endpoints", ep])
        check(rc == 0 and ("no node registered" in out or "no engine registered" in out),
              f"wsyncctl {sub} on an empty cluster names the next step (rc {rc}): {out.strip()[-300:]!r}")
    rc, out, _ = run([ctl, "nodes", "-o", "json", "--endpoints", ep])
    doc = json.loads(out) if rc == 0 else {}
    check(doc == {"nodes": []}, f"nodes -o json holds the nodes only (no open_version 0 where status says -1): {doc}")
    rc, out, _ = run([ctl, "engines", "--watch", "--for", "1", "--endpoints", ep])
    check(rc == 0 and "no engine registered" in out, f"engines --watch on an empty cluster says so at once: {out!r}")
    rc, out, _ = run([ctl, "engines", "--watch", "--for", "1", "-o", "json", "--endpoints", ep])
    lines = out.strip().splitlines()
    check(rc == 0 and len(lines) >= 1 and json.loads(lines[0]).get("engines") == [],
          f"engines --watch -o json on an empty cluster: one state with no engines: {lines[:1]}")
    rc, out, err = run([ctl, "resume", "--endpoints", ep])
    check(rc == 0 and out.startswith("nothing to resume") and "-:" not in out,
          f"resume on an idle, empty cluster says there is nothing to resume (rc {rc}): {out.strip()!r} {err.strip()!r}")
    # --version is the global flag wherever it stands; the update to abort is a positional argument.
    for sub in ("abort", "history", "verify", "status"):
        rc, out, _ = run([ctl, sub, "--version"])
        check(rc == 0 and out.startswith("wsyncctl "), f"{sub} --version prints wsyncctl's version (rc {rc}): {out!r}")
    rc, out, _ = run([ctl, "history", "--version", "1", "-o", "json", "--endpoints", ep])
    check(rc == 1 and not out.startswith("wsyncctl "), f"history --version 1 still selects update 1 (none here: rc {rc})")
    rc, _, err = run([ctl, "abort", "--version", "3", "--endpoints", ep])
    check(rc == 2 and "wsyncctl abort 3" in err, f"abort --version 3 (the old form) is refused, naming the new one "
          f"(rc {rc}): {err.strip()!r}")
    rc, _, err = run([ctl, "abort", "3", "--endpoints", ep])
    check(rc == 1 and "3" in err, f"abort 3 with no update open: the coordinator's refusal (rc {rc}): {err.strip()!r}")
    # One environment variable names the coordinator: WSYNC_COORDINATOR (the old WSYNC_ENDPOINTS still works, warned).
    base = {k: v for k, v in os.environ.items() if k not in ("WSYNC_COORDINATOR", "WSYNC_ENDPOINTS")}
    p = subprocess.run([ctl, "status", "-o", "json"], env=dict(base, WSYNC_COORDINATOR=ep), capture_output=True,
                       text=True, timeout=30)
    check(p.returncode == 0 and not p.stderr.strip(), f"WSYNC_COORDINATOR sets wsyncctl's coordinator (rc "
          f"{p.returncode}): {p.stderr.strip()!r}")
    p = subprocess.run([ctl, "status", "-o", "json"], env=dict(base, WSYNC_ENDPOINTS=ep), capture_output=True,
                       text=True, timeout=30)
    check(p.returncode == 0 and "WSYNC_ENDPOINTS is deprecated" in p.stderr,
          f"WSYNC_ENDPOINTS still works, with a deprecation warning (rc {p.returncode}): {p.stderr.strip()!r}")


def check_metrics_port(b, wd):
    """wsyncctl pointed at an insecure coordinator's metrics port: told it is HTTP, not that it requires TLS."""
    mport = free_port()
    pf = os.path.join(wd, "metrics-coord.port")
    coord = subprocess.Popen([b("wsync-coordinator"), "--listen", "127.0.0.1:0", "--port-file", pf,
                              "--metrics-listen", f"127.0.0.1:{mport}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        harness.wait_for("coordinator port", lambda: harness.read_port_file(pf), 20, None, None, 0.05)
        rc, _, err = run([b("wsyncctl"), "status", "--endpoints", f"127.0.0.1:{mport}"])
        check(rc == 2 and "answers HTTP/1.1, not gRPC" in err and "requires TLS" not in err,
              f"the metrics port given as --endpoints: exit 2, named as HTTP (rc {rc}): {err.strip()!r}")
    finally:
        coord.terminate()
        coord.wait(10)


def check_data_host(b):
    """wsyncd's tcp data listener follows the node's address; a loopback --data-host on a non-loopback node is
    refused at start naming the flag."""
    rc, out, err = run([b("wsyncd"), "--role", "target", "--insecure", "--coordinator", "127.0.0.1:1", "--listen",
                        "0.0.0.0:0", "--advertise", "192.0.2.1", "--data-host", "127.0.0.1", "--engine",
                        "127.0.0.1:1"], timeout=30)
    check(rc == 2 and "--data-host 127.0.0.1 is a loopback address" in out + err,
          f"--data-host 127.0.0.1 with --advertise 192.0.2.1: exit 2 naming --data-host (rc {rc}): {(out + err)[-300:]!r}")
    d = subprocess.Popen([b("wsyncd"), "--role", "source", "--coordinator", "127.0.0.1:1", "--listen",
                          "127.0.0.2:0", "--ring-mib", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        lines = read_until(d, lambda l: "tcp transport listening on" in l, 30)
    finally:
        d.terminate()
        d.wait(10)
    said = [l.strip() for l in lines if "tcp transport listening on" in l]
    check(len(said) == 1 and "listening on 127.0.0.2:" in said[0],
          f"without --data-host the data listener binds --listen's host 127.0.0.2: {said or lines[-3:]}")


def check_wsyncd_coordinator_env(b, dead):
    """wsyncd takes the coordinator's address from WSYNC_COORDINATOR, the name the deploy files and docs use (and so
    do wsync-trainer-demo and wsyncctl, their --help says)."""
    for prog in ("wsyncd", "wsync-trainer-demo", "wsyncctl"):
        _, out, _ = run([b(prog), "--help"])
        check("WSYNC_COORDINATOR" in out, f"{prog} --help names WSYNC_COORDINATOR")
    env = {k: v for k, v in os.environ.items() if k != "WSYNC_COORDINATOR"}
    d = subprocess.Popen([b("wsyncd"), "--role", "source", "--listen", "127.0.0.1:0", "--ring-mib", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(env, WSYNC_COORDINATOR=dead))
    try:
        lines = read_until(d, lambda l: "attempt 1/" in l, 30)
    finally:
        d.terminate()
        d.wait(10)
    check(any("attempt 1/" in l and dead in l for l in lines),
          f"wsyncd without --coordinator registers with WSYNC_COORDINATOR={dead}: {[l.strip() for l in lines[-2:]]}")


def check_node_id_default(b, ep):
    """wsyncd without --node-id and without TLS registers as hostname-role-pid, the default its --help names."""
    _, out, _ = run([b("wsyncd"), "--help"])
    check("without TLS hostname-role-pid" in " ".join(out.split()), "wsyncd --help names the node-id default")
    d = subprocess.Popen([b("wsyncd"), "--role", "source", "--coordinator", ep, "--listen", "127.0.0.1:0",
                          "--ring-mib", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    want = f"{socket.gethostname()}-source-{d.pid}"
    try:
        def registered():
            rc, out, _ = run([b("wsyncctl"), "nodes", "--endpoints", ep, "-w", "json"])
            ids = [n.get("node_id", n.get("nodeId")) for n in json.loads(out).get("nodes", [])] if rc == 0 else []
            return ids if want in ids else None
        try:
            ok = harness.wait_for("the default node id", registered, 20, None, None, 0.2) is not None
        except TimeoutError:
            ok = False
        check(ok, f"wsyncd without --node-id registers as {want}")
    finally:
        d.terminate()
        d.wait(10)
    rc, _, err = run([b("wsyncctl"), "remove", want, "--endpoints", ep])
    check(rc == 0, f"and is removed again (rc {rc}: {err.strip()[:160]})")


def check_status_targets(b, ep, model, wd):
    """wsyncctl status shows each target node's NodeStatus.gpu_direct and cuda_segments (table and JSON); on this
    machine's host-memory engine: no segments, not GPUDirect; a target that stops answering is listed unreachable."""
    procs = harness.Procs(wd)
    try:
        ef = os.path.join(wd, "engine.port")
        procs.start("engine", [b("wsync-engine-ref"), "--id", "engine0", "--model", model, "--tp", "2",
                               "--listen", "127.0.0.1:0", "--port-file", ef])
        eng = f"127.0.0.1:{harness.wait_for('engine port', lambda: harness.read_port_file(ef), 30, procs, ['engine'])}"
        tf = os.path.join(wd, "target.port")
        procs.start("target", [b("wsyncd"), "--listen", "127.0.0.1:0", "--role", "target", "--node-id", "infer0",
                               "--coordinator", ep, "--engine", f"reference+grpc://{eng}",
                               "--engine-socket", os.path.join(wd, "target.sock"), "--port-file", tf])
        harness.wait_for("target port", lambda: harness.read_port_file(tf), 30, procs, ["target"])

        def target_entry():
            rc, out, _ = run([b("wsyncctl"), "status", "-w", "json", "--endpoints", ep])
            try:
                for t in json.loads(out).get("target_nodes", []) if rc == 0 else []:
                    if t.get("node_id") == "infer0":
                        return t
            except ValueError:
                pass
            return None

        t = harness.wait_for("infer0 in status", target_entry, 30, procs, ["target"])
        check(t.get("reachable") is True and t.get("gpu_direct") is False and t.get("cuda_segments") == [],
              f"status -w json: target node's gpu_direct false and no cuda segments on host memory: {t}")
        rc, out, err = run([b("wsyncctl"), "status", "--endpoints", ep])
        lines = [l for l in out.splitlines() if l.startswith("infer0 ")]
        check(rc == 0 and "GPUDIRECT" in out and "CUDA SEGMENTS" in out
              and any(l.split()[1:4] == ["no", "none", "(host"] for l in lines),
              f"status table: target node infer0 with GPUDirect 'no' and no segments (rc {rc}): {out[-600:]!r}")
        rc, out, err = run([b("wsyncctl"), "checksums", "--engine", "engine0", "--rank", "1", "--endpoints", ep])
        check(rc == 0 and len(out.strip().splitlines()) > 0,
              f"checksums --engine engine0 (an engine id) reaches the engine (rc {rc}): {err.strip()[:200]!r}")
        rc, out, err = run([b("wsyncctl"), "checksums", "--engine", "eng0", "--endpoints", ep])
        check(rc == 2 and "no engine of that id" in err and "TLS" not in err,
              f"checksums --engine eng0 (no such engine) names the cause (rc {rc}): {err.strip()!r}")
        target = procs.procs["target"]
        os.killpg(target.pid, signal.SIGSTOP)  # registered but not answering
        rc, out, _ = run([b("wsyncctl"), "status", "--endpoints", ep, "--dial-timeout", "1"])
        check(rc == 0 and any(l.startswith("infer0 ") and "unreachable" in l for l in out.splitlines()),
              f"status lists a target that does not answer as unreachable, still exit 0 (rc {rc}): {out[-400:]!r}")
        os.killpg(target.pid, signal.SIGCONT)
    finally:
        procs.close()


ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def subcommands(help_text):
    """The subcommand names `wsyncctl --help` lists."""
    out, on = [], False
    for line in help_text.splitlines():
        if line.strip().lower().startswith("subcommands:"):
            on = True
            continue
        if on:
            if not line.startswith("  ") or not line.strip():
                if out:
                    break
                continue
            out.append(line.split()[0])
    return out


def complete(words):
    """What tools/cli/wsyncctl.bash offers for the command line `words` (the last one being completed)."""
    script = os.path.join(ROOT, "tools", "cli", "wsyncctl.bash")
    arr = " ".join("'%s'" % w for w in words)
    p = subprocess.run(["/bin/bash", "-c", 'source "$0"; COMP_WORDS=(%s); COMP_CWORD=%d; _wsyncctl; '
                        'printf "%%s\\n" "${COMPREPLY[@]}"' % (arr, len(words) - 1), script],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, PATH=""))
    return set(p.stdout.split())


def check_ctl_usability(b, ep, model):
    """Global flags anywhere, JSON numbers, --help examples, completion, watch while idle, table columns."""
    ctl = b("wsyncctl")
    for argv in (["--log-format", "json", "status"], ["--tls-refresh-seconds", "30", "status"],
                 ["-o", "json", "status"], ["status", "-o", "json"], ["--output=json", "status"],
                 ["--log-level", "error", "status", "--dial-timeout", "3"]):
        rc, out, err = run([ctl, *argv, "--endpoints", ep])
        check(rc == 0, f"wsyncctl {' '.join(argv)}: global flags anywhere (rc {rc}: {err.strip()[:160]})")
    rc, out, _ = run([ctl, "-o", "json", "status", "--endpoints", ep])
    doc = json.loads(out) if rc == 0 else {}
    check(isinstance(doc.get("membership_epoch"), int) and isinstance(doc.get("plan_epoch"), int)
          and doc.get("open_version") == -1 and doc.get("failed_version") == -1,
          f"status -o json: 64-bit integers are numbers, no update open or failed: "
          f"{ {k: doc.get(k) for k in ('membership_epoch', 'open_version', 'failed_version')} }")
    rc, out, _ = run([ctl, "history", "-o", "json", "--endpoints", ep])
    check(rc == 0 and json.loads(out) == {"records": []}, f"history -o json on a fresh coordinator: {out.strip()!r}")
    for argv in (["plan", "--model", model, "--endpoints", ep], ["--endpoints", ep, "-o", "json", "plan", "--model", model],
                 ["plan", "--model", model, "-o", "json", "--tls-refresh-seconds", "9"]):
        rc, out, err = run([ctl, *argv])
        ok = rc == 0 and (not ("json" in argv) or out.strip().startswith("{"))
        check(ok, f"wsyncctl {' '.join(argv[:4])}...: plan with global flags around it (rc {rc}: {err.strip()[:200]})")
    rc, out, _ = run([ctl, "--help"])
    cmds = subcommands(out)
    check(rc == 0 and "examples:" in out and "wsyncctl watch" in out and len(cmds) >= 14,
          f"--help lists {len(cmds)} commands and examples")
    offered = complete(["wsyncctl", ""])
    check(set(cmds) <= offered, f"completion offers every command of --help (missing {sorted(set(cmds) - offered)})")
    # The README's command table names every command (watch and remove were once missing from it).
    row = re.search(r"^\| `wsyncctl ([a-z|\\]+) ", open(os.path.join(ROOT, "README.md")).read(), re.M)
    listed = set(row.group(1).split("\\|")) if row else set()
    check(set(cmds) <= listed, f"the README's wsyncctl row lists every command of --help "
          f"(missing {sorted(set(cmds) - listed)})")
    for sub in cmds:
        if sub == "plan":
            continue
        rc, out, _ = run([ctl, sub, "--help"])
        flags = {n.split("=")[0] for line in out.splitlines() if line.startswith("  -")
                 for n in line.split()[0].split(",") if n.startswith("--")}
        offered = complete(["wsyncctl", sub, "--"])
        check(flags <= offered, f"completion of `wsyncctl {sub} --` offers its flags (missing {sorted(flags - offered)})")
    # watch: the current state at once, and a line while idle.
    rc, out, _ = run([ctl, "watch", "--once", "--endpoints", ep])
    lines = out.strip().splitlines()
    check(rc == 0 and len(lines) == 1 and "idle" in lines[0], f"watch --once prints one line: {lines}")
    rc, out, _ = run([ctl, "watch", "--idle-every", "0.3", "--interval", "0.1", "--for", "1.2", "--endpoints", ep])
    lines = out.strip().splitlines()
    check(rc == 0 and len(lines) >= 3 and "waiting for an update" in lines[0],
          f"watch prints while idle ({len(lines)} lines in 1.2 s): {lines[:2]}")
    rc, out, _ = run([ctl, "history", "--endpoints", ep])
    check(rc == 0 and "STARTED (UTC)" in out.splitlines()[0], f"history has a time column: {out.splitlines()[:1]}")
    rc, out, _ = run([ctl, "engines", "--endpoints", ep])
    check(rc == 0 and "VERSION" in out.splitlines()[0].split(), f"engines has a version column: {out.splitlines()[:1]}")


def check_connection_errors(b, wd):
    """Unreachable, no client certificate against mTLS, a foreign CA: one line each, exit 3 / 2 / 2."""
    ctl = b("wsyncctl")
    dead = f"127.0.0.1:{free_port()}"
    rc, _, err = run([ctl, "status", "--endpoints", dead, "--dial-timeout", "1"])
    check(rc == 3 and "--endpoints or WSYNC_COORDINATOR" in err and dead in err,
          f"unreachable coordinator: exit 3 with the --endpoints hint (rc {rc}): {err.strip()!r}")
    certs, foreign = os.path.join(wd, "certs"), os.path.join(wd, "foreign")
    mk = os.path.join(ROOT, "tools", "cli", "wsync-certs.sh")
    subprocess.run([mk, certs, "coordinator:main", "admin:ops"], check=True, capture_output=True)
    subprocess.run([mk, foreign, "admin:ops"], check=True, capture_output=True)
    tls = lambda d, who: ["--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/{who}.pem", "--tls-key", f"{d}/{who}-key.pem"]
    pf = os.path.join(wd, "tls-coord.port")
    coord = subprocess.Popen([b("wsync-coordinator"), "--listen", "127.0.0.1:0", "--port-file", pf,
                              *tls(certs, "coordinator-main")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not os.path.exists(pf) and time.time() < deadline:
            time.sleep(0.05)
        ep = "127.0.0.1:" + open(pf).read().strip()
        rc, _, err = run([ctl, "status", "--endpoints", ep])
        check(rc == 2 and "a client certificate is required" in err and "Socket closed" not in err
              and len(err.strip().splitlines()) == 1,
              f"mTLS coordinator without a client certificate: exit 2, says a certificate is required (rc {rc}): "
              f"{err.strip()!r}")
        rc, _, err = run([ctl, "status", "--endpoints", ep, *tls(foreign, "admin-ops")])
        check(rc == 2 and "not signed by the CA" in err and len(err.strip().splitlines()) == 1,
              f"a foreign CA: exit 2, one line (rc {rc}): {err.strip()!r}")
        rc, out, err = run([ctl, "status", "--endpoints", ep, *tls(certs, "admin-ops")])
        check(rc == 0 and out.startswith("state: idle"), f"the right certificate: status works (rc {rc}: {err.strip()})")
        # The HA readiness probe of docs/operations.md: the coordinator's own certificate from its environment.
        env = dict(os.environ, WSYNC_TLS_CA=f"{certs}/ca.pem", WSYNC_TLS_CERT=f"{certs}/coordinator-main.pem",
                   WSYNC_TLS_KEY=f"{certs}/coordinator-main-key.pem")
        p = subprocess.run(["sh", "-c", f'exec {ctl} --endpoints "$POD_IP:{ep.split(":")[1]}" --dial-timeout 2 '
                            'status -o json >/dev/null'], env=dict(env, POD_IP="127.0.0.1"), capture_output=True,
                           text=True, timeout=30)
        check(p.returncode == 0, f"the readiness-probe command under mTLS passes (rc {p.returncode}: {p.stderr.strip()})")
    finally:
        coord.terminate()
        coord.wait(10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True, help="model config for the reference engine behind a target node")
    args = ap.parse_args()
    b = lambda n: os.path.join(args.bin, n)
    progs = ["wsyncctl", "wsyncd", "wsync-coordinator", "wsync-engine-ref", "wsync-trainer-demo"]
    version = re.search(r"^project\(wsync VERSION (\S+)", open(os.path.join(ROOT, "CMakeLists.txt")).read(),
                        re.M).group(1)
    rc, out, _ = run([b("wsyncd"), "--help"])
    check(all(k in out for k in ("reference+grpc://", "vllm+http://", "sglang+http://")),
          "wsyncd --help names every engine kind (reference, vllm, sglang)")
    for prog in progs:
        rc, out, _ = run([b(prog), "--version"])
        check(rc == 0 and out.startswith(prog + " ") and "commit" in out, f"{prog} --version: rc {rc}, {out.strip()!r}")
        check(out.split()[1] == version, f"{prog} --version is the version of CMakeLists.txt ({version})")
        rc, out, _ = run([b(prog), "--help"])
        check(rc == 0 and "exit codes" in out, f"{prog} --help lists exit codes (rc {rc})")
        rc, _, err = run([b(prog), "--log-level", "verbose"])
        check(rc == 2 and "verbose" in err, f"{prog} rejects --log-level verbose with 2 (rc {rc})")
        rc, _, err = run([b(prog), "--no-such-flag"])
        check(rc == 2, f"{prog} unknown flag exits 2 (rc {rc})")
    rc, _, err = run([b("wsync-coordinator"), "--log-format", "xml"])
    check(rc == 2 and "xml" in err, f"--log-format xml is rejected with 2 (rc {rc})")
    for flag, bad in (("--min-source-mib", "lots"), ("--nic", "fast")):
        rc, out, err = run([b("wsync-coordinator"), flag, bad, "--listen", "127.0.0.1:0"], timeout=10)
        check(rc == 2 and flag in out + err, f"wsync-coordinator {flag} {bad} exits 2 naming the flag (rc {rc})")
    rc, _, err = run([b("wsyncctl"), "frobnicate"])
    check(rc == 2 and "frobnicate" in err, f"unknown subcommand named, exit 2 (rc {rc}: {err.strip()[:120]})")
    dead = f"127.0.0.1:{free_port()}"
    rc, _, err = run([b("wsyncctl"), "status", "-w", "json", "--endpoints", dead, "--dial-timeout", "1"])
    check(rc == 3, f"unreachable coordinator exits 3 (rc {rc})")
    rc, _, err = run([b("wsyncctl"), "checksums", "--engine", "eng0", "--endpoints", dead, "--dial-timeout", "1"])
    check(rc == 3 and "TLS" not in err and "WSYNC_COORDINATOR" in err,
          f"checksums --engine ID asks the coordinator for the engine; unreachable: exit 3, no TLS blame: {err.strip()!r}")
    # libibverbs is loaded at run time, never linked: wsyncd must start on hosts without rdma-core.
    rc, out, _ = run(["readelf", "-d", b("wsyncd")])
    check(rc == 0 and "libibverbs" not in out and "librdmacm" not in out,
          f"wsyncd does not link libibverbs or librdmacm (readelf rc {rc})")
    rc, _, err = run([b("wsyncd"), "--role", "source", "--coordinator", dead, "--listen", "0.0.0.0:0"])
    check(rc == 2 and "--advertise" in err + _, f"wsyncd --listen 0.0.0.0 without --advertise exits 2 (rc {rc})")

    with tempfile.TemporaryDirectory() as wd:
        pf = os.path.join(wd, "coord.port")
        coord = subprocess.Popen([b("wsync-coordinator"), "--listen", "127.0.0.1:0", "--port-file", pf],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 20
            while not os.path.exists(pf) and time.time() < deadline:
                time.sleep(0.05)
            ep = "127.0.0.1:" + open(pf).read().strip()
            # Global flags after the subcommand; default-valued fields present in JSON.
            rc, out, err = run([b("wsyncctl"), "status", "-w", "json", "--endpoints", ep])
            check(rc == 0, f"status -w json after the subcommand (rc {rc}: {err.strip()[:160]})")
            try:
                doc = json.loads(out)
            except ValueError:
                doc = {}
            check("currentVersion" in doc or "current_version" in doc,
                  f"JSON carries default-valued fields: {sorted(doc)[:12]}")
            check(bool(doc.get("serverVersion") or doc.get("server_version")), "status carries the server version")
            rc, out, _ = run([b("wsyncctl"), "version", "--endpoints", ep])
            check(rc == 0 and out.count("0.") >= 2, f"wsyncctl version shows client and server (rc {rc}): {out!r}")
            for sub in ("nodes", "engines"):
                rc, out, _ = run([b("wsyncctl"), sub, "--endpoints", ep, "-w", "json"])
                check(rc == 0, f"wsyncctl {sub} on an empty cluster (rc {rc})")
            check_empty_cluster(b, ep)
            # Transport selection (docs/operations.md, "Transports"): libibverbs is loaded at run time, so wsyncd
            # starts where it is missing; a single transport that is not viable is an error, a listed fallback is
            # used and shows in the node list.
            env = dict(os.environ, WSYNC_IBVERBS_LIB="/nonexistent/libibverbs.so.1")
            p = subprocess.run([b("wsyncd"), "--role", "source", "--coordinator", ep, "--listen", "127.0.0.1:0",
                                "--ring-mib", "4", "--transport", "verbs"], capture_output=True, text=True,
                               timeout=30, env=env)
            check(p.returncode == 1 and "cannot load /nonexistent/libibverbs.so.1" in p.stdout + p.stderr
                  and "verbs,tcp" in p.stdout + p.stderr,
                  f"--transport verbs without libibverbs exits 1 naming the library and the fallback syntax "
                  f"(rc {p.returncode})")
            rc, out, err = run([b("wsyncd"), "--role", "source", "--coordinator", ep, "--transport", "udp"])
            check(rc == 2 and "udp" in out + err, f"--transport udp is a usage error (rc {rc})")
            d = subprocess.Popen([b("wsyncd"), "--role", "source", "--coordinator", ep, "--listen", "127.0.0.1:0",
                                  "--ring-mib", "4", "--node-id", "fallback-node", "--transport", "verbs,tcp"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            try:
                transport = None
                deadline = time.time() + 20
                while transport is None and time.time() < deadline:
                    rc, out, _ = run([b("wsyncctl"), "nodes", "--endpoints", ep, "-w", "json"])
                    try:
                        for n in json.loads(out).get("nodes", []):
                            if n.get("nodeId", n.get("node_id")) == "fallback-node":
                                transport = n.get("transport")
                    except ValueError:
                        pass
                    if transport is None:
                        time.sleep(0.2)
                check(transport == "tcp", f"--transport verbs,tcp falls back to tcp, shown in wsyncctl nodes "
                      f"({transport!r})")
            finally:
                d.terminate()
                d.wait(10)
            check_node_id_default(b, ep)
            check_ctl_usability(b, ep, args.model)
            check_status_targets(b, ep, args.model, wd)
        finally:
            coord.terminate()
            coord.wait(10)

        check_connection_errors(b, wd)
        check_metrics_port(b, wd)
        check_data_host(b)
        check_wsyncd_coordinator_env(b, dead)

        # SIGTERM while the daemon retries its registration: it must stop promptly with status 0.
        d = subprocess.Popen([b("wsyncd"), "--role", "source", "--coordinator", dead, "--listen", "127.0.0.1:0",
                              "--ring-mib", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = "".join(read_until(d, lambda l: "attempt 1/" in l, 30))  # retrying its registration now
        t0 = time.time()
        d.send_signal(signal.SIGTERM)
        try:
            rc = d.wait(5)
        except subprocess.TimeoutExpired:
            d.kill()
            rc = d.wait()
        log += d.stdout.read()
        check(rc == 0 and time.time() - t0 < 3, f"SIGTERM during registration: rc {rc} after {time.time() - t0:.1f}s")
        check("attempt 1/" in log, "each failed registration attempt is logged")

        # Structured logs: every line one JSON object with time, level, component and message.
        d = subprocess.Popen([b("wsyncd"), "--role", "source", "--coordinator", dead, "--listen", "127.0.0.1:0",
                              "--ring-mib", "4", "--log-format", "json"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        first = []
        read_until(d, lambda l: bool(l.strip() and first.append(l) is None and len(first) >= 2), 30)
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(5)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        lines = first + [l for l in d.stdout.read().splitlines() if l.strip()]
        parsed = []
        for l in lines:
            try:
                parsed.append(json.loads(l))
            except ValueError:
                pass
        check(len(lines) >= 2 and len(parsed) == len(lines)
              and all({"ts", "level", "component", "msg"} <= set(p) for p in parsed),
              f"--log-format json: {len(parsed)} of {len(lines)} lines are JSON objects with ts/level/component/msg")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
