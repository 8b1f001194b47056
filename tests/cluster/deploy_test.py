#!/usr/bin/env python3
"""The deployment files executed, not only validated (issue 42): deploy/systemd's units with their example env files
(--flavor systemd) or deploy/k8s's manifests (--flavor k8s) run on an emulated cluster of separate hosts
(bench/cluster/emucluster.py: network namespaces with non-loopback addresses on a private bridge): a coordinator
host, two trainer hosts and two inference hosts, with mutual TLS.

What runs is what the files say. systemd: each unit's ExecStart expanded with the unit's Environment= defaults
overridden by its example env file (the example addresses and node names replaced by each host's, as an operator
copying them would), that environment, as its User=/Group= (an unprivileged uid/gid standing for `wsync`), with
/usr/local/bin, /etc/wsync, /run/wsync (RuntimeDirectory, its mode) and /var/lib/wsync (StateDirectory) of the host
bind-mounted at those paths in the process's own mount namespace; key files root-owned, 0640, the unit's group.
Kubernetes: each container's command and args with $(VAR) expanded from the ConfigMap and its env (fieldRefs: the
host's address and name), that environment, runAsUser/runAsGroup/fsGroup, a root container's dropped capabilities,
/opt/wsync/bin (the image's layout), its Secret as files of the manifest's defaultMode owned by root with the
fsGroup's group, its hostPaths and emptyDirs; the Service name resolves to the coordinator's pod (each host's
/etc/hosts). Beside them, as a deployment has them: reference engines at the addresses the files name, and trainer
ranks connecting to the trainer socket the files name, as the daemon's user. The operator's sizing is the one change:
2 trainer ranks with 256 MiB rings per host instead of the examples' 8 x 2 GiB.

Checks: every daemon registers at its host's address (wsyncctl, admin certificate), one update verified bit-exactly
by every engine rank, and a Prometheus scrape, from another host, of every daemon's metrics listener that together
export every metric the Grafana board (deploy/grafana) queries.

    deploy_test.py --bin BUILD/bin [--flavor systemd|k8s] [--keep]

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
    """One emulated host: its namespace (from emucluster) and its own directories, bind-mounted at the paths the
    deployment names (HOST_PATHS) in each of its processes' mount namespace."""

    def __init__(self, cluster, node, name, paths=HOST_PATHS[:3], bin_at="/usr/local/bin"):
        self.c, self.node, self.name = cluster, node, name
        self.root = os.path.join(cluster.work, "hosts", name)
        self.dirs = {p: os.path.join(self.root, p.strip("/").replace("/", "-")) for p in paths}
        for d in [self.root] + list(self.dirs.values()):
            os.makedirs(d, exist_ok=True)
        self.bin_at = bin_at
        self.extra_mounts = []  # (path, source) bound on top of the directories (a Secret's mount, /etc/hosts)

    def run(self, name, argv, env, uid=UID, gid=GID, groups=(), caps=None):
        """Starts argv on this host: its network namespace, its directories at their paths, as uid:gid (with
        supplementary `groups`; `caps`: the capability bounding set, for a root container's `drop: [ALL]`)."""
        mounts = " && ".join(f"mount --bind {shlex.quote(src)} {dst}" for dst, src in
                             list(self.dirs.items()) + [(self.bin_at, self.c.bin)] + self.extra_mounts)
        user = []
        if uid:
            user = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                    f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--"]
        elif caps is not None:
            user = ["setpriv", "--inh-caps=-all", f"--bounding-set=-all{''.join(',+' + c for c in caps)}", "--"]
        return self.c.start(name, self.node, ["sh", "-c", mounts + ' && exec "$@"', "sh"] + user + argv, env=env)

    def install_tls(self, certs, files, gid=GID, key_mode=0o640, cert_mode=0o644, into=None):
        """Certificate files into this host's /etc/wsync/tls (or `into`): {dest name: source name}; root-owned,
        group `gid`, keys `key_mode`."""
        tls = into or os.path.join(self.dirs["/etc/wsync"], "tls")
        os.makedirs(tls, exist_ok=True)
        for dest, src in files.items():
            path = os.path.join(tls, dest)
            shutil.copy(os.path.join(certs, src), path)
            os.chown(path, 0, gid)
            os.chmod(path, key_mode if "key" in dest else cert_mode)


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
    if r.returncode != 0:
        return None, ""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", r.stdout, re.M)), r.stdout


def board_metrics():
    board = json.load(open(os.path.join(ROOT, "deploy", "grafana", "wsync-dashboard.json")))
    names = set()
    for p in board.get("panels", []):
        for t in p.get("targets", []):
            names |= set(re.findall(r"\bwsync_[a-z0-9_]+", t.get("expr", "")))
    return names


MOUNTPOINTS = {"systemd": HOST_PATHS, "k8s": ("/etc/wsync/tls", "/run/wsync", "/var/lib/wsync", "/opt/wsync/bin")}


def run(c, flavor):
    """The flavor's scenario; the paths it binds are made on this machine where missing (empty mount points, removed
    again afterwards)."""
    c.network_up()
    made = []
    for p in MOUNTPOINTS[flavor]:
        missing = []
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            os.mkdir(d)
            made.append(d)
    try:
        (scenario_systemd if flavor == "systemd" else scenario_k8s)(c)
    finally:
        for p in reversed(made):
            try:
                os.rmdir(p)
            except OSError:
                pass


def scenario_systemd(c):
    coord_host = Host(c, c.coord_node, "coordinator")
    for h in [coord_host]:
        os.makedirs(os.path.join(h.dirs["/etc/wsync"], "tls"), exist_ok=True)
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
    run_update(c, sources, sockets, coord, engines, uid=UID,
               tls=["--tls-ca", "/etc/wsync/tls/ca.pem", "--tls-cert", "/etc/wsync/tls/trainer.pem",
                    "--tls-key", "/etc/wsync/tls/trainer-key.pem"])
    check_metrics(c, metrics)


def run_update(c, sources, sockets, coord, engines, uid, tls):
    """One update by 2 trainer ranks per trainer host; the driving rank verifies every engine bit-exactly."""
    ranks = []
    for s, h in enumerate(sources):
        for r in range(2):
            g = s * 2 + r
            argv = [os.path.join(h.bin_at, "wsync-trainer-demo"), "--daemon", sockets[s], "--model", MODEL,
                    "--local-rank", str(r), "--global-rank", str(g), "--updates", "1"] + tls
            if g == 0:
                argv += ["--drive", "--coordinator", coord] + [x for e in engines for x in ("--verify-engine", e)]
            ranks.append((f"trainer{g}", h.run(f"trainer{g}", argv, env=None, uid=uid)))
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



def check_metrics(c, metrics):
    """Prometheus, on another host than the daemon's: every daemon's metrics listener, and together every metric
    the Grafana board reads."""
    exported = {}
    version = re.search(r"^project\(wsync VERSION (\S+)", open(os.path.join(ROOT, "CMakeLists.txt")).read(),
                        re.M).group(1)
    for node, addr, who in metrics:
        fam, text = scrape(c, c.sources[0] if node is c.coord_node else c.coord_node, addr)
        expect(fam is not None and any(k.startswith("wsync_") for k in fam),
               f"{who}: /metrics on {addr} scraped ({len(fam or {})} families)")
        info = re.search(r'^wsync_build_info\{([^}]*)\} 1$', text, re.M)
        expect(info is not None and f'version="{version}"' in info.group(1),
               f"{who}: wsync_build_info carries the version {version}: {info.group(0) if info else None}")
        exported.update(fam)
    missing = sorted(n for n in board_metrics()
                     if n not in exported and re.sub(r"_(bucket|sum|count)$", "", n) not in exported)
    expect(not missing, f"every metric the Grafana board queries is exported by the daemons (missing: {missing})")


K8S = os.path.join(ROOT, "deploy", "k8s")
SERVICE = "wsync-coordinator.wsync.svc.cluster.local"  # the coordinator Service's name, resolved by each host


def k8s_objects():
    import yaml
    objs = {}
    for f in sorted(os.listdir(K8S)):
        if f.endswith(".yaml"):
            for d in yaml.safe_load_all(open(os.path.join(K8S, f))):
                if d and "metadata" in d:
                    objs[(d["kind"], d["metadata"]["name"])] = d
    return objs


def k8s_expand(text, env):
    """Kubernetes' $(VAR) expansion of command, args and env values; an unknown variable stays as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(text))


def start_pod(host, obj, config, fields, files):
    """Runs a Deployment's or DaemonSet's container on `host` as its manifest says: command and args with $(VAR)
    expanded from the ConfigMap (envFrom) and env (values, fieldRefs: `fields`), that environment, runAsUser /
    runAsGroup / fsGroup, a root container's capabilities, and its volumes: a Secret as files of defaultMode owned
    by root with the fsGroup's group (`files[volume]`: {key: certificate file}), hostPaths as the host's
    directories, an emptyDir as a fresh directory."""
    spec = obj["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = dict(config) if any("configMapRef" in e for e in c.get("envFrom", [])) else {}
    for e in c.get("env", []):
        env[e["name"]] = k8s_expand(e["value"], env) if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    argv = [k8s_expand(a, env) for a in c.get("command", []) + c.get("args", [])]
    unknown = [a for a in argv if re.search(r"\$\([A-Za-z_]", a)]
    expect(not unknown, f"{obj['metadata']['name']}: every $(VAR) of its command line is set ({unknown})")
    pod_sc, sc = spec.get("securityContext") or {}, c.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", 0))
    fs_group = pod_sc.get("fsGroup")
    caps = [x.lower() for x in (sc.get("capabilities") or {}).get("add", [])] \
        if "ALL" in (sc.get("capabilities") or {}).get("drop", []) else None
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    host.extra_mounts = []
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "secret" in v:
            d = os.path.join(host.root, "secret-" + v["name"])
            host.install_tls(files[v["name"]][0], files[v["name"]][1], gid=fs_group or 0,
                             key_mode=v["secret"].get("defaultMode", 0o644),
                             cert_mode=v["secret"].get("defaultMode", 0o644), into=d)
            host.extra_mounts.append((m["mountPath"], d))
        elif "hostPath" in v:
            host.extra_mounts.append((m["mountPath"], host.dirs[v["hostPath"]["path"]]))
        elif "emptyDir" in v:
            d = os.path.join(host.root, "emptydir-" + v["name"])
            os.makedirs(d, exist_ok=True)
            os.chown(d, 0, fs_group or 0)
            os.chmod(d, 0o777)
            host.extra_mounts.append((m["mountPath"], d))
    host.extra_mounts.append(("/etc/hosts", host.hosts_file))
    print(f"{host.name}: uid {uid} gid {gid} fsGroup {fs_group} caps {caps}: {' '.join(argv)}", flush=True)
    host.run(f"{host.name}-{obj['metadata']['name']}", argv, dict(env, PATH="/opt/wsync/bin:/usr/bin:/bin"),
             uid=uid, gid=gid, groups=[fs_group] if fs_group is not None else (), caps=caps)
    return argv


def flag(argv, name):
    for a in argv:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise Failed(f"no {name}= in {argv}")


def scenario_k8s(c):
    objs = k8s_objects()
    config = dict(objs[("ConfigMap", "wsync-config")]["data"])
    config.update({"WSYNC_TRAINER_RANKS": "2", "WSYNC_RING_MIB": "256"})  # the operator's sizing for this machine
    paths = ("/etc/wsync/tls", "/run/wsync")
    coord_host = Host(c, c.coord_node, "coordinator", paths=(), bin_at="/opt/wsync/bin")
    sources = [Host(c, n, f"train-node-{i:02d}", paths=paths, bin_at="/opt/wsync/bin") for i, n in enumerate(c.sources)]
    targets = [Host(c, n, f"infer-node-{i:02d}", paths=paths, bin_at="/opt/wsync/bin") for i, n in enumerate(c.targets)]
    coord_ip = c.coord_node.ip
    for h in [coord_host] + sources + targets:  # the cluster's DNS: the Service name resolves to the coordinator pod
        h.hosts_file = os.path.join(h.root, "hosts")
        with open(h.hosts_file, "w") as f:
            f.write(f"127.0.0.1 localhost\n{coord_ip} {SERVICE}\n")
        os.chmod(h.hosts_file, 0o644)
    certs = os.path.join(c.work, "certs")
    specs = [f"coordinator:main={coord_ip},{SERVICE}", f"admin:ops={coord_ip}"]
    specs += [f"source:{h.name}={h.node.ip}" for h in sources] + [f"trainer:{h.name}={h.node.ip}" for h in sources]
    specs += [f"target:{h.name}={h.node.ip}" for h in targets] + [f"engine:{h.name}-e0={h.node.ip}" for h in targets]
    emu.sh(os.path.join(ROOT, "tools", "cli", "wsync-certs.sh"), certs, *specs, capture=True)

    secret = {"tls": (certs, {"ca.crt": "ca.pem", "tls.crt": "coordinator-main.pem",
                              "tls.key": "coordinator-main-key.pem"})}
    cargv = start_pod(coord_host, objs[("Deployment", "wsync-coordinator")], config,
                      {"status.podIP": coord_ip, "status.hostIP": coord_ip, "spec.nodeName": "coordinator"}, secret)
    coord = flag(cargv, "--listen")

    def serving():
        rc, st, _ = ctl(c, coord, certs, "status")
        return rc == 0 and st.get("state") == "idle"
    wait("the coordinator pod serves (uid 65532 reading its 0440 Secret through fsGroup)", serving, 60, c)

    metrics = [(c.coord_node, flag(cargv, "--metrics-listen"), "coordinator")]
    engines = []
    for h in targets:  # the node's engine where the ConfigMap says, a reference engine here
        h.install_tls(certs, {"ca.pem": "ca.pem", "wsyncd-target.pem": f"target-{h.name}.pem",
                              "wsyncd-target-key.pem": f"target-{h.name}-key.pem", "engine.pem": f"engine-{h.name}-e0.pem",
                              "engine-key.pem": f"engine-{h.name}-e0-key.pem"}, gid=0, key_mode=0o600,
                      into=h.dirs["/etc/wsync/tls"])
        h.extra_mounts = [("/etc/hosts", h.hosts_file)]
        addr = f"{h.node.ip}:{config['WSYNC_ENGINE_PORT']}"
        pf = os.path.join(h.dirs["/run/wsync"], "engine.port")
        p = h.run(f"{h.name}-engine", ["/opt/wsync/bin/wsync-engine-ref", "--id", f"{h.name}-e0", "--model", MODEL,
                                       "--tp", "2", "--listen", addr, "--port-file", "/run/wsync/engine.port",
                                       "--tls-ca", "/etc/wsync/tls/ca.pem", "--tls-cert", "/etc/wsync/tls/engine.pem",
                                       "--tls-key", "/etc/wsync/tls/engine-key.pem"], env=None, uid=0)
        c._wait_port(f"{h.name}-engine", p, pf)
        engines.append(addr)
        fields = {"status.podIP": h.node.ip, "status.hostIP": h.node.ip, "spec.nodeName": h.name}
        argv = start_pod(h, objs[("DaemonSet", "wsyncd-target")], config, fields, {})
        metrics.append((h.node, flag(argv, "--metrics-listen"), h.name))
    sockets = []
    for h in sources:
        h.install_tls(certs, {"ca.pem": "ca.pem", "wsyncd-source.pem": f"source-{h.name}.pem",
                              "wsyncd-source-key.pem": f"source-{h.name}-key.pem", "trainer.pem": f"trainer-{h.name}.pem",
                              "trainer-key.pem": f"trainer-{h.name}-key.pem"}, gid=0, key_mode=0o600,
                      into=h.dirs["/etc/wsync/tls"])
        fields = {"status.podIP": h.node.ip, "status.hostIP": h.node.ip, "spec.nodeName": h.name}
        argv = start_pod(h, objs[("DaemonSet", "wsyncd-source")], config, fields, {})
        metrics.append((h.node, flag(argv, "--metrics-listen"), h.name))
        sockets.append(flag(argv, "--trainer-socket"))

    def registered():
        rc, st, _ = ctl(c, coord, certs, "nodes")
        nodes = st.get("nodes", [])
        return nodes if len(nodes) == 4 and all(n.get("reachable") for n in nodes) else None
    nodes = wait("every daemon pod registered (through the Service name) and reachable", registered, 120, c)
    expect(sorted(n["address"].split(":")[0] for n in nodes) == sorted(h.node.ip for h in sources + targets),
           f"each registered at its node's address: {[n['address'] for n in nodes]}")
    run_update(c, sources, sockets, config["WSYNC_COORDINATOR"], engines, uid=0,
               tls=["--tls-ca", "/etc/wsync/tls/ca.pem", "--tls-cert", "/etc/wsync/tls/trainer.pem",
                    "--tls-key", "/etc/wsync/tls/trainer-key.pem"])
    check_metrics(c, metrics)


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
    ap.add_argument("--flavor", choices=("systemd", "k8s"), default="systemd",
                    help="deploy/systemd's units and env files, or deploy/k8s's manifests")
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
            run(c, args.flavor)
    except (Failed, emu.HarnessError) as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
