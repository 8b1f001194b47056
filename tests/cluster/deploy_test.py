#!/usr/bin/env python3
"""The systemd deployment executed, not only validated (issue 42): deploy/systemd's units and example env files run
on an emulated cluster of separate hosts (bench/cluster/emucluster.py: network namespaces with non-loopback
addresses on a private bridge), a coordinator host, two trainer hosts and two inference hosts, with mutual TLS.

What runs is what the files say: each unit's ExecStart, expanded with the unit's Environment= defaults overridden
by its example env file (deploy/systemd/env/*.env, with the example addresses and node names replaced by each
host's, as an operator copying them would), its environment passed as is (the TLS files are found through it), as
its User=/Group= (an unprivileged uid/gid standing for `wsync`), with /usr/local/bin, /etc/wsync, /run/wsync
(RuntimeDirectory, its mode) and /var/lib/wsync (StateDirectory) of a host: per host directories bind-mounted at
those paths in the process's own mount namespace. The key files are root-owned, mode 0640, group the unit's group.
Beside them, as a deployment has them: reference engines at the addresses the target env file names (run as the
daemon's user, since their ranks attach to its engine socket), and trainer ranks on the trainer hosts connecting to
the env file's WSYNC_TRAINER_SOCKET as that user. The operator's sizing is the one change: 2 trainer ranks with
256 MiB rings per host instead of the example's 8 x 2 GiB.

Checks: every daemon registers (wsyncctl, admin certificate), one update verified bit-exactly by every engine rank,
and a Prometheus scrape of every daemon's WSYNC_METRICS_LISTEN that together export every metric the Grafana board
(deploy/grafana) queries.

    deploy_test.py --bin BUILD/bin [--keep]

Exit 0 pass, 1 fail, 77 (skip) only when this machine cannot create network namespaces (not root, no netns).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "cluster"))
import emucluster as emu  # noqa: E402

SYSTEMD = os.path.join(ROOT, "deploy", "systemd")
MODEL = os.path.join(ROOT, "tests", "data", "tiny", "qwen3-tiny.json")
UID = GID = 64321  # stands for the units' User=wsync / Group=wsync (no passwd entry needed)
HOST_PATHS = ("/etc/wsync", "/run/wsync", "/var/lib/wsync", "/usr/local/bin")
# The example env files' addresses and names, and what each host's operator would write instead.
EXAMPLE_COORDINATOR_IP, EXAMPLE_SOURCE_IP, EXAMPLE_TARGET_IP = "10.0.0.1", "10.0.1.10", "10.0.2.20"


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)
    print(f"ok: {what}", flush=True)


def parse_unit(path):
    """[Service] of a unit: Environment= defaults (in order), EnvironmentFile, ExecStart (joined), User, Group,
    RuntimeDirectoryMode, StateDirectory."""
    text = open(path).read().replace("\\\n", " ")
    unit = {"env": {}, "exec": None, "runtime_mode": "0755"}
    for line in text.splitlines():
        line = line.strip()
        if "=" not in line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        if key == "Environment":
            for word in shlex.split(value):
                k, v = word.split("=", 1)
                unit["env"][k] = v
        elif key == "EnvironmentFile":
            unit["env_file"] = value.lstrip("-")
        elif key == "ExecStart":
            unit["exec"] = value
        elif key in ("User", "Group", "StateDirectory", "RuntimeDirectory"):
            unit[key.lower()] = value
        elif key == "RuntimeDirectoryMode":
            unit["runtime_mode"] = value
    return unit


def parse_env_file(path, replace):
    """KEY=VALUE lines of an env file, each value with the `replace` pairs applied (the host's own addresses)."""
    env = {}
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        for old, new in replace:
            v = v.replace(old, new)
        env[k] = v.strip('"')
    return env


def specifiers(text, instance, hostname):
    return text.replace("%i", instance).replace("%H", hostname).replace("%%", "%")


def expand_exec(exec_start, env):
    """systemd's expansion: `${VAR}` is one word, `$VAR` splits on whitespace (an empty one is no word at all)."""
    argv = []
    for word in shlex.split(exec_start):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            argv += env.get(m.group(1), "").split()
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda x: env.get(x.group(1), ""), word))
    return argv


class Host:
    """One emulated host: its namespace (from emucluster) and its own /etc/wsync, /run/wsync, /var/lib/wsync."""

    def __init__(self, cluster, node, name):
        self.c, self.node, self.name = cluster, node, name
        self.root = os.path.join(cluster.work, "hosts", name)
        self.dirs = {p: os.path.join(self.root, p.strip("/").replace("/", "-")) for p in HOST_PATHS[:3]}
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        os.makedirs(os.path.join(self.dirs["/etc/wsync"], "tls"), exist_ok=True)

    def run(self, name, argv, env, uid=UID, gid=GID):
        """Starts argv on this host: its network namespace, its directories at their paths, as uid:gid."""
        mounts = " && ".join(f"mount --bind {shlex.quote(src)} {dst}" for dst, src in
                             list(self.dirs.items()) + [("/usr/local/bin", self.c.bin)])
        user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"] if uid else []
        return self.c.start(name, self.node, ["sh", "-c", mounts + ' && exec "$@"', "sh"] + user + argv, env=env)

    def install_tls(self, certs, files):
        """Certificate files into this host's /etc/wsync/tls: {dest name: source name}; keys root:GID 0640."""
        tls = os.path.join(self.dirs["/etc/wsync"], "tls")
        for dest, src in files.items():
            path = os.path.join(tls, dest)
            shutil.copy(os.path.join(certs, src), path)
            os.chown(path, 0, GID)
            os.chmod(path, 0o640 if "key" in dest else 0o644)


def start_unit(host, unit_file, env_file, replace, instance="", override=None):
    unit = parse_unit(os.path.join(SYSTEMD, unit_file))
    env = {k: specifiers(v, instance, socket.gethostname()) for k, v in unit["env"].items()}
    env.update(parse_env_file(os.path.join(SYSTEMD, "env", env_file), replace))
    env.update(override or {})
    argv = expand_exec(specifiers(unit["exec"], instance, socket.gethostname()), env)
    expect(argv[0].startswith("/usr/local/bin/"), f"{unit_file}: ExecStart runs {argv[0]}")
    uid = UID if unit.get("user") == "wsync" else 0
    if unit.get("runtimedirectory"):
        run = host.dirs["/run/wsync"]
        os.chown(run, uid, GID if uid else 0)
        os.chmod(run, int(unit["runtime_mode"], 8))
    if unit.get("statedirectory"):
        os.chown(host.dirs["/var/lib/wsync"], uid, GID if uid else 0)
    full_env = dict(env, PATH="/usr/local/bin:/usr/bin:/bin")
    print(f"{host.name}: {' '.join(argv)}", flush=True)
    return host.run(f"{host.name}-{unit_file.split('.')[0].rstrip('@')}", argv, full_env, uid=uid), env


def need(env, key, what):
    """A variable the deployment must set (a unit or env file without it fails here, naming it)."""
    if not env.get(key):
        raise Failed(f"{what}: {key} is not set by the unit or its env file")
    return env[key]


def ctl(c, coord, admin, *args):
    r = subprocess.run(["ip", "netns", "exec", c.coord_node.ns, os.path.join(c.bin, "wsyncctl"), *args, "--endpoints",
                        coord, "-o", "json", "--tls-ca", f"{admin}/ca.pem", "--tls-cert", f"{admin}/admin-ops.pem",
                        "--tls-key", f"{admin}/admin-ops-key.pem"], capture_output=True, text=True, timeout=60)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}), r.stderr


def scrape(c, node, addr):
    r = subprocess.run(["ip", "netns", "exec", node.ns, sys.executable, "-c",
                        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                        f"'http://{addr}/metrics', timeout=5).read().decode())"],
                       capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", r.stdout, re.M)) if r.returncode == 0 else None


def board_metrics():
    board = json.load(open(os.path.join(ROOT, "deploy", "grafana", "wsync-dashboard.json")))
    names = set()
    for p in board.get("panels", []):
        for t in p.get("targets", []):
            names |= set(re.findall(r"\bwsync_[a-z0-9_]+", t.get("expr", "")))
    return names


def run(c, keep):
    c.network_up()
    made = []
    for p in HOST_PATHS:
        if not os.path.isdir(p):
            os.makedirs(p)
            made.append(p)
    try:
        scenario(c)
    finally:
        for p in reversed(made):
            try:
                os.rmdir(p)
            except OSError:
                pass


def scenario(c):
    coord_host = Host(c, c.coord_node, "coordinator")
    sources = [Host(c, n, f"train-node-{i:02d}") for i, n in enumerate(c.sources)]
    targets = [Host(c, n, f"infer-node-{i:02d}") for i, n in enumerate(c.targets)]
    certs = os.path.join(c.work, "certs")
    specs = [f"coordinator:main={c.coord_node.ip}", f"admin:ops={c.coord_node.ip}"]
    specs += [f"source:{h.name}={h.node.ip}" for h in sources] + [f"trainer:{h.name}={h.node.ip}" for h in sources]
    specs += [f"target:{h.name}={h.node.ip}" for h in targets]
    specs += [f"engine:{h.name}-e{k}={h.node.ip}" for h in targets for k in (0, 1)]
    emu.sh(os.path.join(ROOT, "tools", "cli", "wsync-certs.sh"), certs, *specs, capture=True)
    coord_host.install_tls(certs, {"ca.pem": "ca.pem", "coordinator.pem": "coordinator-main.pem",
                                   "coordinator-key.pem": "coordinator-main-key.pem"})
    coord_ip = c.coord_node.ip
    _, cenv = start_unit(coord_host, "wsync-coordinator.service", "coordinator.env", [(EXAMPLE_COORDINATOR_IP, coord_ip)])
    coord = need(cenv, "WSYNC_COORDINATOR_LISTEN", "wsync-coordinator.service")
    expect(coord.startswith(coord_ip + ":"), f"the coordinator listens on its host's address {coord}")

    def serving():
        rc, st, _ = ctl(c, coord, certs, "status")
        return rc == 0 and st.get("state") == "idle"
    wait("the coordinator serves (mTLS, admin certificate)", serving, 60, c)

    # Reference engines where the target env file says they are (WSYNC_ENGINE_ARGS), run as the daemon's user.
    engines = []
    for h in targets:
        h.install_tls(certs, {"ca.pem": "ca.pem", "wsyncd.pem": f"target-{h.name}.pem",
                              "wsyncd-key.pem": f"target-{h.name}-key.pem"})
        tenv = parse_env_file(os.path.join(SYSTEMD, "env", "wsyncd-target.env"), [(EXAMPLE_TARGET_IP, h.node.ip)])
        addrs = re.findall(r"reference\+grpc://(\S+)", need(tenv, "WSYNC_ENGINE_ARGS", "wsyncd-target.env"))
        expect(len(addrs) == 2, f"{h.name}: the target env file names its engines: {addrs}")
        for k, addr in enumerate(addrs):
            h.install_tls(certs, {f"engine{k}.pem": f"engine-{h.name}-e{k}.pem",
                                  f"engine{k}-key.pem": f"engine-{h.name}-e{k}-key.pem"})
            # Its port file in the host's /run/wsync (the test's work directory is not the engine user's).
            os.chown(h.dirs["/run/wsync"], UID, GID)
            pf = os.path.join(h.dirs["/run/wsync"], f"engine{k}.port")
            p = h.run(f"{h.name}-engine{k}", ["/usr/local/bin/wsync-engine-ref", "--id", f"{h.name}-e{k}", "--model",
                                              MODEL, "--tp", "2", "--listen", addr, "--port-file",
                                              f"/run/wsync/engine{k}.port", "--tls-ca",
                                              "/etc/wsync/tls/ca.pem", "--tls-cert", f"/etc/wsync/tls/engine{k}.pem",
                                              "--tls-key", f"/etc/wsync/tls/engine{k}-key.pem"], env=None)
            c._wait_port(f"{h.name}-engine{k}", p, pf)
            engines.append(addr)
    metrics = [(c.coord_node, need(cenv, "WSYNC_METRICS_LISTEN", "wsync-coordinator.service"), "coordinator")]
    for i, h in enumerate(targets):
        _, env = start_unit(h, "wsyncd-target.service", "wsyncd-target.env",
                            [(EXAMPLE_TARGET_IP, h.node.ip), (EXAMPLE_COORDINATOR_IP, coord_ip),
                             ("infer-node-00", h.name)])
        metrics.append((h.node, need(env, "WSYNC_METRICS_LISTEN", h.name), h.name))
    sockets = []
    for i, h in enumerate(sources):
        h.install_tls(certs, {"ca.pem": "ca.pem", "wsyncd.pem": f"source-{h.name}.pem",
                              "wsyncd-key.pem": f"source-{h.name}-key.pem", "trainer.pem": f"trainer-{h.name}.pem",
                              "trainer-key.pem": f"trainer-{h.name}-key.pem"})
        _, env = start_unit(h, "wsyncd-source@.service", "wsyncd-source-main.env",
                            [(EXAMPLE_SOURCE_IP, h.node.ip), (EXAMPLE_COORDINATOR_IP, coord_ip),
                             ("train-node-00", h.name)], instance="main",
                            override={"WSYNC_TRAINER_RANKS": "2", "WSYNC_RING_MIB": "256"})
        metrics.append((h.node, need(env, "WSYNC_METRICS_LISTEN", h.name), h.name))
        sockets.append(need(env, "WSYNC_TRAINER_SOCKET", h.name))

    def registered():
        rc, st, _ = ctl(c, coord, certs, "nodes")
        nodes = st.get("nodes", [])
        return nodes if len(nodes) == 4 and all(n.get("reachable") for n in nodes) else None
    nodes = wait("every daemon registered and reachable", registered, 120, c)
    expect(sorted(n["address"].split(":")[0] for n in nodes) == sorted(h.node.ip for h in sources + targets),
           f"each registered at its host's address: {[n['address'] for n in nodes]}")

    # One update: 2 ranks per trainer host, on the socket the env file names, as the units' user.
    ranks = []
    for s, h in enumerate(sources):
        for r in range(2):
            g = s * 2 + r
            argv = ["/usr/local/bin/wsync-trainer-demo", "--daemon", sockets[s], "--model", MODEL, "--local-rank",
                    str(r), "--global-rank", str(g), "--updates", "1", "--tls-ca", "/etc/wsync/tls/ca.pem",
                    "--tls-cert", "/etc/wsync/tls/trainer.pem", "--tls-key", "/etc/wsync/tls/trainer-key.pem"]
            if g == 0:
                argv += ["--drive", "--coordinator", coord] + [x for e in engines for x in ("--verify-engine", e)]
            ranks.append((f"trainer{g}", h.run(f"trainer{g}", argv, env=None)))
    deadline = time.time() + 300
    for name, p in ranks:
        try:
            rc = p.wait(max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            rc = None
        expect(rc == 0, f"{name} finished its update (exit {rc}):\n{c.log_tail(name, 15)}" if rc != 0 else
               f"{name} finished its update")
    out = c.log_tail("trainer0", 200)
    verified = len(re.findall(r"^\s+engine \S+: verified bit-exact", out, re.M))
    expect(verified == len(engines), f"update 1 verified bit-exactly on all {len(engines)} engines ({verified})")

    # Prometheus, on another host than the daemon's: every daemon's metrics listener, and together every metric
    # the Grafana board reads.
    exported = {}
    for node, addr, who in metrics:
        fam = scrape(c, c.sources[0] if node is c.coord_node else c.coord_node, addr)
        expect(fam is not None and any(k.startswith("wsync_") for k in fam),
               f"{who}: /metrics on {addr} scraped ({len(fam or {})} families)")
        exported.update(fam)
    missing = sorted(n for n in board_metrics()
                     if n not in exported and re.sub(r"_(bucket|sum|count)$", "", n) not in exported)
    expect(not missing, f"every metric the Grafana board queries is exported by the daemons (missing: {missing})")


def wait(what, fn, timeout, c):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, p, _ in c.procs:
            if p.poll() is not None:
                raise Failed(f"{what}: {name} exited ({p.returncode}):\n{c.log_tail(name, 20)}")
        v = fn()
        if v:
            expect(True, what)
            return v
        time.sleep(0.5)
    raise Failed(f"{what}: not within {timeout} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    try:
        emu.check_privileges()
    except emu.Unsupported as e:
        print(f"SKIP: {e}")
        return emu.SKIP
    c = emu.Cluster(sources=2, targets=2, rate_mbit=1000, bin_dir=os.path.abspath(args.bin), model=MODEL,
                    keep_logs=args.keep)
    try:
        with c:
            run(c, args.keep)
    except (Failed, emu.HarnessError) as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
