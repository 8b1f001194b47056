#!/usr/bin/env python3
"""Emulated wsync cluster on one Linux host: every node is a network namespace with its own address on a private
bridge, reached through a veth pair whose both ends are shaped with tc (so each node has a NIC of known bandwidth in
both directions, plus optional one-way delay). The coordinator has its own namespace with an unshaped link. Each
source node runs a `wsyncd --role source` and its trainer ranks (`wsync-trainer-demo`); each target node runs a
`wsyncd --role target` and one reference engine (`wsync-engine-ref`, TP >= 2). Traffic never leaves the namespaces:
the bridge has no address and the root namespace no route to them.

Library use (bench/cluster/bench_cluster.py, tests/cluster/cluster_test.py):
    with Cluster(sources=2, targets=2, rate_mbit=400, bin_dir=..., model=...) as c:
        c.network_up(); c.measure_rate(); c.start_wsync(); c.run_updates(first=1, count=2)

Command line:
    emucluster.py [--sources S] [--targets T] [--rate-mbit R] [--delay-ms D] [--tp N] [--updates N] [--model CFG]
                  [--bin DIR] [--keep]
    emucluster.py --cleanup      remove namespaces, links and processes of harness runs whose process is gone

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`); exits 77 with the reason when namespaces cannot be
created. Every name starts with a per-run prefix `wc<pid hex><2 hex>`, so parallel runs and leftovers never collide.
Cleans up on success, failure, SIGINT and SIGTERM.
"""

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MODEL = os.path.join(HERE, "models", "qwen3-0.6b-4l", "config.json")
NAME_RE = re.compile(r"^wc([0-9a-f]{1,7})([0-9a-f]{2})")  # run prefix: pid of the harness + 2 random hex digits
SUBNET = "10.99.0"
SKIP = 77


def nic_spec(mbit):
    """The cost model's --nic for one shaped NIC per node at `mbit` Mbit/s (coordinator and `wsyncctl plan`)."""
    return f"1x{mbit / 1000:.6f}Gbps"


class HarnessError(Exception):
    pass


class Unsupported(HarnessError):
    """This machine cannot create namespaces/links (not a failure of wsync)."""


def sh(*argv, check=True, capture=False, timeout=60):
    r = subprocess.run(list(argv), stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def check_privileges():
    """Raises Unsupported with the reason when this process cannot build the emulated network."""
    if os.geteuid() != 0:
        raise Unsupported("the emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for network namespaces, "
                          "veth pairs, a bridge and tc); run it as root or with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise Unsupported(f"'{tool}' (iproute2) is not installed")
    probe = f"wc{os.getpid():x}ffprobe"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        raise Unsupported(f"cannot create a network namespace here: {r.stderr.strip()}")
    sh("ip", "netns", "del", probe, check=False)


def _alive_harness(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return "emucluster" in cmd or "bench_cluster" in cmd or "cluster_test" in cmd


def _kill_netns_pids(ns):
    r = sh("ip", "netns", "pids", ns, check=False, capture=True)
    pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM and pids:
            deadline = time.time() + 3
            while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
                time.sleep(0.1)


def cleanup_leftovers(all_runs=False):
    """Removes namespaces and links of harness runs whose harness process is gone. Returns what it removed."""
    removed = []
    r = sh("ip", "netns", "list", check=False, capture=True)
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = NAME_RE.match(ns)
        if not m or (not all_runs and _alive_harness(int(m.group(1), 16))):
            continue
        _kill_netns_pids(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    r = sh("ip", "-o", "link", "show", check=False, capture=True)
    for line in r.stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        dev = parts[1].strip().split("@")[0]
        m = NAME_RE.match(dev)
        if not m or (not all_runs and _alive_harness(int(m.group(1), 16))):
            continue
        sh("ip", "link", "del", dev, check=False)
        removed.append(f"link {dev}")
    # The broadcast baseline's receivers (bcast_rank.py) keep what they got in /dev/shm/wsync-bcast-<pid>-<rank>:
    # a killed run leaves them (about one model copy each); the receiver's pid says whether it is gone.
    for path in glob.glob("/dev/shm/wsync-bcast-*-*"):
        try:
            pid = int(os.path.basename(path).split("-")[2])
        except (IndexError, ValueError):
            continue
        if all_runs or not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(f"file {path}")
    return removed


class Node:
    def __init__(self, run, code, index, shaped):
        self.code = code  # "c", "s0", "t3"
        self.ns = f"{run}-{code}"
        self.host_dev = f"{run}{code}"
        self.peer_tmp = f"{run}{code}x"
        self.ip = f"{SUBNET}.{index}"
        self.shaped = shaped


class Cluster:
    """S source nodes, T target nodes and a coordinator node on a shaped, private bridge."""

    def __init__(self, sources, targets, rate_mbit, bin_dir, model=DEFAULT_MODEL, tp=2, delay_ms=0.0,
                 trainer_ranks=1, ring_mib=256, keep_logs=False, log=print, strategy="balanced", ep=1,
                 trainer_parallelism=""):
        if not 1 <= sources <= 64 or not 1 <= targets <= 64:
            raise HarnessError(f"sources and targets must be 1..64, not {sources} and {targets}")
        if tp < 2:
            raise HarnessError(f"the engines run at TP >= 2, not {tp}")
        if strategy not in ("seed", "balanced", "local"):
            raise HarnessError(f"strategy must be seed, balanced or local, not {strategy}")
        if strategy == "local" and not trainer_parallelism:
            raise HarnessError("strategy local needs the trainer's parallelism (e.g. tp=2,ep=2)")
        if ep < 1 or tp % ep != 0:
            raise HarnessError(f"the engines' ep must divide their tp ({tp}), not {ep}")
        self.strategy, self.ep, self.trainer_parallelism = strategy, ep, trainer_parallelism
        if rate_mbit <= 0:
            raise HarnessError(f"--rate-mbit must be positive, not {rate_mbit}")
        for b in ("wsync-coordinator", "wsyncd", "wsync-engine-ref", "wsync-trainer-demo"):
            if not os.access(os.path.join(bin_dir, b), os.X_OK):
                raise HarnessError(f"{bin_dir}/{b} is missing; build first (cmake --build build)")
        if not os.path.isfile(model):
            raise HarnessError(f"model config {model} not found")
        self.S, self.T, self.tp = sources, targets, tp
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        self.bin, self.model = bin_dir, model
        self.trainer_ranks, self.ring_mib = trainer_ranks, ring_mib
        self.keep_logs, self.log = keep_logs, log
        self.run = f"wc{os.getpid():x}{random.randrange(256):02x}"
        self.bridge = f"{self.run}br"
        self.coord_node = Node(self.run, "c", 1, shaped=False)
        self.sources = [Node(self.run, f"s{i}", 10 + i, shaped=True) for i in range(sources)]
        self.targets = [Node(self.run, f"t{i}", 100 + i, shaped=True) for i in range(targets)]
        self.work = tempfile.mkdtemp(prefix=f"wsync-emu-{self.run}-")
        self.procs = []  # (name, Popen, log path)
        self.created_ns, self.created_links = [], []
        self.coordinator = None
        self.engines, self.source_addrs = [], []
        self.measured_mbit = None
        self._old_handlers = {}
        # Extra flags for every engine, target daemon, source daemon and trainer rank (bench_cluster_delta.py:
        # --steps-dir, --delta, --delta-staging-fraction; bench_cluster.py: --tcp-progress-timeout).
        self.engine_args, self.target_args, self.source_args, self.trainer_args = [], [], [], []
        self.coordinator_args = []  # extra coordinator flags (bench_relay.py: --relay)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        self.close(failed=exc[0] is not None)
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        return False

    def _on_signal(self, signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def nodes(self):
        return [self.coord_node] + self.sources + self.targets

    def close(self, failed=False):
        self.stop_processes()
        for ns in self.created_ns:
            _kill_netns_pids(ns)  # anything a process left behind in our namespaces
        for dev in self.created_links:
            sh("ip", "link", "del", dev, check=False)
        for ns in self.created_ns:
            sh("ip", "netns", "del", ns, check=False)
        self.created_ns, self.created_links = [], []
        if failed or self.keep_logs:
            self.log(f"emucluster: logs kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ network
    def _shape(self, dev, ns=None):
        pre = ["ip", "netns", "exec", ns] if ns else []
        rate = f"{self.rate_mbit}mbit"
        sh(*pre, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        sh(*pre, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
           "burst", "64k", "cburst", "64k")
        if self.delay_ms > 0:
            sh(*pre, "tc", "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem", "delay",
               f"{self.delay_ms}ms", "limit", "100000")

    def network_up(self):
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.created_links.append(self.bridge)
        # Bridged frames must not meet the host's iptables (a FORWARD policy of DROP would eat them).
        sh("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        sh("ip", "link", "set", self.bridge, "up")
        for n in self.nodes():
            sh("ip", "netns", "add", n.ns)
            self.created_ns.append(n.ns)
            sh("ip", "link", "add", n.host_dev, "type", "veth", "peer", "name", n.peer_tmp)
            self.created_links.append(n.host_dev)
            sh("ip", "link", "set", n.peer_tmp, "netns", n.ns)
            x = ["ip", "netns", "exec", n.ns]
            sh(*x, "ip", "link", "set", n.peer_tmp, "name", "eth0")
            sh(*x, "ip", "addr", "add", f"{n.ip}/24", "dev", "eth0")
            sh(*x, "ip", "link", "set", "eth0", "up")
            sh(*x, "ip", "link", "set", "lo", "up")
            sh("ip", "link", "set", n.host_dev, "master", self.bridge)
            sh("ip", "link", "set", n.host_dev, "up")
            if n.shaped:
                self._shape("eth0", n.ns)  # node → bridge: the NIC's transmit side
                self._shape(n.host_dev)  # bridge → node: the NIC's receive side
        self.log(f"emucluster {self.run}: {self.S} source + {self.T} target nodes on bridge {self.bridge}, "
                 f"{self.rate_mbit} Mbit/s per NIC each way" + (f", {self.delay_ms} ms delay" if self.delay_ms else ""))

    def measure_rate(self, seconds=3):
        """iperf3 from the first source node to the first target node; returns (and keeps) Mbit/s received."""
        if shutil.which("iperf3") is None:
            raise HarnessError("iperf3 is not installed (apt-get install iperf3)")
        src, dst = self.sources[0], self.targets[0]
        server = self.start("iperf3-server", dst, ["iperf3", "-s", "-1", "-B", dst.ip, "-p", "5201"])
        time.sleep(0.5)
        out = None
        for _ in range(20):
            r = sh("ip", "netns", "exec", src.ns, "iperf3", "-c", dst.ip, "-p", "5201", "-t", str(seconds), "-J",
                   check=False, capture=True, timeout=seconds + 30)
            if r.returncode == 0:
                out = json.loads(r.stdout)
                break
            time.sleep(0.3)
        self.stop(server)
        if out is None:
            raise HarnessError(f"iperf3 {src.code} -> {dst.code} failed: {r.stdout[-300:]} {r.stderr[-300:]}")
        self.measured_mbit = out["end"]["sum_received"]["bits_per_second"] / 1e6
        self.log(f"emucluster {self.run}: iperf3 {src.code} -> {dst.code}: {self.measured_mbit:.1f} Mbit/s "
                 f"(configured {self.rate_mbit})")
        return self.measured_mbit

    def set_link(self, node, up):
        """Takes a node's link down or up (both ends), as a cable pull would."""
        state = "up" if up else "down"
        sh("ip", "link", "set", node.host_dev, state)
        sh("ip", "netns", "exec", node.ns, "ip", "link", "set", "eth0", state)
        if up:
            sh("ip", "netns", "exec", node.ns, "ip", "addr", "replace", f"{node.ip}/24", "dev", "eth0")

    # ------------------------------------------------------------------------------------------------ processes
    def start(self, name, node, argv, env=None):
        path = os.path.join(self.work, f"{name}.log")
        logf = open(path, "wb")
        p = subprocess.Popen(["ip", "netns", "exec", node.ns] + argv, stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        logf.close()
        self.procs.append((name, p, path))
        return p

    def stop(self, p, grace=5.0):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs = [x for x in self.procs if x[1] is not p]

    def stop_processes(self):
        for _, p, _ in reversed(list(self.procs)):
            self.stop(p)

    def log_tail(self, name, lines=20):
        path = os.path.join(self.work, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _wait_port(self, name, p, port_file, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                with open(port_file) as f:
                    return int(f.read().strip())
            if p.poll() is not None:
                raise HarnessError(f"{name} exited ({p.returncode}) before serving; its log:\n{self.log_tail(name)}")
            time.sleep(0.1)
        raise HarnessError(f"{name} did not start within {timeout} s; its log:\n{self.log_tail(name)}")

    def _serve(self, name, node, argv):
        port_file = os.path.join(self.work, f"{name}.port")
        if os.path.exists(port_file):  # a previous process of that name (restarted with another strategy)
            os.unlink(port_file)
        p = self.start(name, node, argv + ["--port-file", port_file])
        return f"{node.ip}:{self._wait_port(name, p, port_file)}"

    def make_certs(self):
        """mTLS for every process (docs/security.md): a CA and one certificate per process, CN "<role>:<id>", whose
        subjectAltName holds the node's address (these addresses are not loopback, so TLS is required)."""
        self.certs = os.path.join(self.work, "certs")
        specs = [f"coordinator:emu={self.coord_node.ip}", f"admin:emu={self.coord_node.ip}"]
        for i, n in enumerate(self.targets):
            specs += [f"engine:engine{i}={n.ip}", f"target:infer-node{i}={n.ip}"]
        for i, n in enumerate(self.sources):
            specs += [f"source:train-node{i}={n.ip}", f"trainer:train-node{i}={n.ip}"]
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "cli", "wsync-certs.sh")
        sh(script, self.certs, *specs, capture=True)

    def tls(self, name):
        """--tls-* flags for the certificate `name` ("target-infer-node0")."""
        d = self.certs
        return ["--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/{name}.pem", "--tls-key", f"{d}/{name}-key.pem"]

    def start_wsync(self):
        """Coordinator (with this cluster's strategy), engines, target and source daemons."""
        b = lambda n: os.path.join(self.bin, n)
        c = self.coord_node
        if not getattr(self, "certs", None):
            self.make_certs()
        local = ["--trainer-parallelism", self.trainer_parallelism] if self.strategy == "local" else []
        # The planner's cost model (automatic source count) at the links' rate: iperf3's when measured, else the
        # configured shaping rate, instead of the coordinator's default 1x400Gbps.
        mbit = self.measured_mbit or self.rate_mbit
        self.coordinator = self._serve("coordinator", c, [b("wsync-coordinator"), "--listen", f"{c.ip}:0",
                                                            "--strategy", self.strategy, "--nic", nic_spec(mbit)]
                                       + local + self.coordinator_args + self.tls("coordinator-emu"))
        self.start_engines()
        self.start_daemons()

    def start_engines(self):
        """One reference engine per target node (fresh memory)."""
        b = lambda n: os.path.join(self.bin, n)
        if not getattr(self, "certs", None):
            self.make_certs()
        self.engines, self.load_sockets = [], []
        for i, n in enumerate(self.targets):
            # The load socket is the broadcast baseline's way in (bcast_rank.py): its receivers hand the engine the
            # full HF tensors they got, which it loads with its own loader.
            self.load_sockets.append(os.path.join(self.work, f"engine{i}.load.sock"))
            self.engines.append(self._serve(f"engine{i}", n, [b("wsync-engine-ref"), "--id", f"engine{i}", "--model",
                                                              self.model, "--tp", str(self.tp), "--ep", str(self.ep),
                                                              "--load-socket", self.load_sockets[-1], "--listen",
                                                              f"{n.ip}:0"] + self.engine_args
                                             + self.tls(f"engine-engine{i}")))

    def start_daemons(self):
        b = lambda n: os.path.join(self.bin, n)
        for i, n in enumerate(self.targets):
            self._serve(f"target{i}", n, [b("wsyncd"), "--role", "target", "--node-id", f"infer-node{i}", "--listen",
                                          f"{n.ip}:0", "--data-host", n.ip, "--coordinator", self.coordinator,
                                          "--engine", f"reference+grpc://{self.engines[i]}", "--engine-socket",
                                          os.path.join(self.work, f"target{i}.sock"), "--transport", "tcp"]
                        + self.target_args + self.tls(f"target-infer-node{i}"))
        self.source_addrs = []
        for i, n in enumerate(self.sources):
            # Trainer ranks reach their daemon through its Unix socket (shared across network namespaces by path).
            sock = os.path.join(self.work, f"source{i}.sock")
            self._serve(f"source{i}", n, [b("wsyncd"), "--role", "source", "--node-id", f"train-node{i}",
                                          "--listen", f"{n.ip}:0", "--data-host", n.ip, "--coordinator",
                                          self.coordinator, "--trainer-ranks", str(self.trainer_ranks),
                                          "--ring-mib", str(self.ring_mib), "--transport", "tcp",
                                          "--trainer-socket", sock] + self.source_args
                        + self.tls(f"source-train-node{i}"))
            self.source_addrs.append(sock)
        self.log(f"emucluster {self.run}: coordinator {self.coordinator}, engines {' '.join(self.engines)}")

    def stop_wsync(self):
        for name, p, _ in list(self.procs):
            if re.match(r"^(coordinator|engine\d+|target\d+|source\d+|trainer\d+)$", name):
                self.stop(p)

    def start_trainers(self, first, count, verify=True, tag=""):
        """Starts every trainer rank for `count` updates from version `first`; returns the driving rank's process."""
        procs = []
        for s, n in enumerate(self.sources):
            for r in range(self.trainer_ranks):
                g = s * self.trainer_ranks + r
                argv = [os.path.join(self.bin, "wsync-trainer-demo"), "--daemon", self.source_addrs[s], "--model",
                        self.model, "--local-rank", str(r), "--global-rank", str(g), "--updates", str(count),
                        "--first-version", str(first)] + self.trainer_args + self.tls(f"trainer-train-node{s}")
                if g == 0:
                    argv += ["--drive", "--coordinator", self.coordinator]
                    if verify:
                        for e in self.engines:
                            argv += ["--verify-engine", e]
                procs.append((f"trainer{g}{tag}", self.start(f"trainer{g}{tag}", n, argv)))
        return procs

    def run_updates(self, first, count, timeout=900, verify=True):
        """Runs `count` updates; returns a list of per-update dicts parsed from the driving rank's output:
        {version, mib, engine_ranks, seconds, phases: {name: s}, verified: bool}. Raises HarnessError on failure."""
        procs = self.start_trainers(first, count, verify)
        deadline = time.time() + timeout
        failed = None
        while time.time() < deadline:
            states = [(name, p.poll()) for name, p in procs]
            bad = [(name, rc) for name, rc in states if rc not in (None, 0)]
            if bad:
                failed = bad
                break
            if all(rc == 0 for _, rc in states):
                break
            time.sleep(0.2)
        else:
            failed = [("timeout", timeout)]
        out = self.log_tail(procs[0][0], 10000)
        for name, p in procs:
            self.stop(p)
        if failed:
            detail = "\n".join(f"--- {name}\n{self.log_tail(name, 15)}" for name, _ in procs[:3])
            raise HarnessError(f"updates {first}..{first + count - 1} failed ({failed}):\n{detail}")
        return parse_updates(out)


    def run_broadcast(self, python, manifest, raw, trainers=1, port=29500, timeout=900):
        """The broadcast baseline over the same nodes and links: rank 0 (the trainer's head rank, on the first
        source node) broadcasts every HF tensor in `raw`/`manifest` with torch.distributed (gloo) to tp engine ranks
        on every target node, each of which hands them to its engine's load socket (start_engines() first); with trainers > 1 the trainer ranks (`trainer_ranks` per source node) hold TP/EP shards
        and the head gathers them first (bcast_rank.py). Returns {seconds, gather_s, bcast_s, load_s, ranks,
        checked, engines_verified, mismatches}. Raises HarnessError when a rank fails."""
        if len(getattr(self, "load_sockets", [])) != self.T:
            raise HarnessError("the broadcast baseline loads into the engines: start_engines() first")
        if trainers > self.S * self.trainer_ranks:
            raise HarnessError(f"{trainers} trainer ranks do not fit {self.S} source nodes of {self.trainer_ranks}")
        world = trainers + self.T * self.tp
        head = self.sources[0]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        script = os.path.join(HERE, "bcast_rank.py")
        procs = []
        for rank in range(world):
            out = os.path.join(self.work, f"bcast{rank}.json")
            argv = [python, script, "--rank", str(rank), "--world", str(world), "--master", f"{head.ip}:{port}",
                    "--manifest", manifest, "--config", self.model, "--tp", str(self.tp), "--out", out,
                    "--trainers", str(trainers), "--timeout-s", str(timeout)]
            if rank < trainers:
                node = self.sources[rank // self.trainer_ranks]
                argv += ["--raw", raw]
            else:
                node = self.targets[(rank - trainers) // self.tp]
                argv += ["--load-socket", self.load_sockets[(rank - trainers) // self.tp]]
            procs.append((f"bcast{rank}", self.start(f"bcast{rank}", node, argv, env=env), out))
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None for _, p, _ in procs):
            if any(p.poll() not in (None, 0) for _, p, _ in procs):
                break
            time.sleep(0.2)
        results, failed = [], []
        for name, p, out in procs:
            if p.poll() is None:
                self.stop(p)
                failed.append(f"{name}: still running (stopped)")
            elif p.returncode != 0 and not os.path.exists(out):
                failed.append(f"{name}: exit {p.returncode}:\n{self.log_tail(name, 8)}")
            else:
                self.procs = [x for x in self.procs if x[1] is not p]
            if os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
        if failed:
            raise HarnessError("broadcast baseline failed:\n" + "\n".join(failed))
        if len(results) != world:
            raise HarnessError(f"broadcast baseline: {world - len(results)} of {world} ranks wrote no result")
        receivers = results[trainers:]
        verified = [r["engine_verify"] for r in receivers if r.get("engine_verify")]
        if len(verified) != self.T or not all(v["ok"] and v["params_checked"] > 0 for v in verified):
            raise HarnessError(f"broadcast baseline: not every engine verified its load bit-exactly: {verified}")
        return {"seconds": max(r["seconds"] for r in results), "head_seconds": results[0]["seconds"],
                "gather_s": max(r["gather_s"] for r in results[:trainers]),
                "bcast_s": max(r["gather_s"] + r["bcast_s"] for r in receivers) - max(r["gather_s"] for r in results[:trainers]),
                "load_s": max(r["load_s"] for r in receivers),
                "ranks": world - trainers, "checked": sum(r["checked"] for r in results),
                "engines_verified": len(verified), "engine_params_checked": sum(v["params_checked"] for v in verified),
                "mismatches": [m for r in results for m in r["mismatches"]]}


UPDATE_RE = re.compile(r"^update (\d+): ([\d.]+) MiB to (\d+) engine ranks in ([\d.]+)s \(([\d.]+) GB/s[^;]*;(.*)$")
# The demo trainer's line after each committed update: what went over the wire (docs/delta.md).
DELTA_RE = re.compile(r"^update (\d+): delta (\w+): (\d+) bytes sent for (\d+) dense \([\d.]+\), (\d+) ranks with "
                      r"deltas, (\d+) dense$")


def parse_updates(text):
    updates = []
    for line in text.splitlines():
        m = UPDATE_RE.match(line.strip())
        if m:
            phases = {k: float(v.rstrip("s")) for k, v in (p.split("=") for p in m.group(6).split())}
            updates.append({"version": int(m.group(1)), "mib": float(m.group(2)), "engine_ranks": int(m.group(3)),
                            "seconds": float(m.group(4)), "phases": phases, "verified": None})
        elif DELTA_RE.match(line.strip()) and updates:
            d = DELTA_RE.match(line.strip())
            if int(d.group(1)) == updates[-1]["version"]:
                updates[-1].update(delta_mode=d.group(2), sent_bytes=int(d.group(3)), dense_bytes=int(d.group(4)),
                                   delta_ranks=int(d.group(5)), dense_ranks=int(d.group(6)))
        elif line.strip().startswith("engine ") and updates:
            ok = "verified bit-exact" in line
            updates[-1]["verified"] = ok if updates[-1]["verified"] is None else (updates[-1]["verified"] and ok)
    return updates


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--targets", type=int, default=2)
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--delay-ms", type=float, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--keep", action="store_true", help="keep the logs")
    ap.add_argument("--cleanup", action="store_true", help="remove leftovers of harness runs that are gone")
    a = ap.parse_args()
    try:
        check_privileges()
        if a.cleanup:
            removed = cleanup_leftovers()
            print("\n".join(removed) if removed else "emucluster: nothing to clean up")
            return 0
        with Cluster(a.sources, a.targets, a.rate_mbit, a.bin, a.model, a.tp, a.delay_ms, keep_logs=a.keep) as c:
            c.network_up()
            c.measure_rate()
            c.start_wsync()
            ups = c.run_updates(1, a.updates)
            for u in ups:
                print(f"update {u['version']}: {u['mib']:.1f} MiB to {u['engine_ranks']} engine ranks in "
                      f"{u['seconds']:.3f} s; verified bit-exact: {u['verified']}")
            return 0 if ups and all(u["verified"] for u in ups) and len(ups) == a.updates else 1
    except Unsupported as e:
        print(f"emucluster: cannot run here: {e}", file=sys.stderr)
        return SKIP
    except HarnessError as e:
        print(f"emucluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("emucluster: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
