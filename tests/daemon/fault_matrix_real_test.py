#!/usr/bin/env python3
"""The fault matrix against real processes (docs/operations.md, "Failure semantics"): the real coordinator (SQLite
state store, phase deadlines capped by --test-phase-deadline), a source daemon, two reference engines with staging
memory, each behind its own target daemon.

Modes: classic, staged and delta (classic's table; RL-like consecutive steps from tools/testdata/weight_gen.h
kSparseStepBase, so that the updates really send deltas, checked in their records).
Each row injects one fault at one phase of one update mode, through the engine's fault knob (WSYNC_REF_FAULTS_FILE,
tools/testing/engine_ref/ref_faults.h), the node daemon's (WSYNC_DAEMON_FAULTS_FILE, base/fault_knob.h: the phases
the daemons answer, configure / start / finish on the source daemon, open_windows / apply_delta on target daemon
infer1) or by killing a daemon once the update is open:
  error    the engine's (daemon's) call fails;
  hang     the engine's (daemon's) call blocks until the coordinator gives up (the phase deadline);
  kill     the engine (the target daemon, for its phases; its engine stays up) is SIGKILLed once it is inside the
           call (its log says so: no timing);
  restart  the coordinator is SIGKILLed while the engine is inside the call and started again on its store.
The push rows kill the source daemon (or the coordinator) once the update is open (Status says "updating"). A
configure row first restarts the source daemon (a source holding the plan is not configured again). A hung finish
is left out: its deadline is the commit's timeout plus 30 s, which --test-phase-deadline does not cap.
Every row then checks
  (a) every engine the coordinator reports serving holds, by its own loader's check (Verify: its memory against
      the generated checkpoint of the step its label names, computed independently of the transfer), its label;
  (b) every engine is serving the current version, or is reported paused / failed / stale, and the engine's own log
      agrees on whether it is paused;
  (c) neither the current version nor any engine's label goes backwards;
  (d) the failed update's record (or the stale / not-resumed entry of an update that committed) names the faulted
      peer and the phase;
  (e) a thread polls Status during the row: every answer within 1 s;
and the outcome the invariants ask of the row's phase (the `EXPECT` table below, written from the invariants, not
read from the coordinator; the declared table, `wsync-coordinator --failure-table`, is compared with it too).
A row ends with the fleet brought back to one verified version (restarting what the row killed, and one clean
update, verified), so the next row starts from a known state.

A restart row checks (a) and (b) as every row: the restarted coordinator asks each engine what it holds and
whether it is paused, so what it reports is the engines' own word, paused or serving (none reported failed at
engine_info: every engine answers); past the commit point (continue), the update is committed on the engine that
was continued and the faulted one is paused at the new version, not resumed.

Every row runs (83, ~95-110 s on the loaded 2-core machine: one cluster for all, only what a row killed is restarted);
--rows picks some.

  fault_matrix_real_test.py --bin build/bin --lib build/lib/libwsync_client_c.so --model tests/data/tiny/qwen3-tiny.json
"""
import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
import harness  # noqa: E402

check = harness.Checks()
STATUS_BOUND_S = 1.0
PHASE_DEADLINE_S = 2.0

# What the invariants ask of a failure at each (mode, engine call) (issue's failure semantics; docs/operations.md):
#   resume_old      nothing reached live weights: every engine resumed at the old version (classic, before writes)
#   keep_paused     live weights may be partly written: every engine paused at its old label, none resumed
#   resume_if_clean either of the two (the sources' answer decides)
#   serve_on        staged before any pause: every engine serving the old version, never paused
#   stale           staged before the faulted engine's switch: it serves the old version, marked stale; the other
#                   engine switched to the new one
#   hold            staged past the faulted engine's switch: it is paused, reported failed, labelled old; the other
#                   engine on the new version
#   not_resumed     past the commit point: the fleet is on the new version; the faulted engine paused at it
EXPECT = {
    ("classic", "pause"): "resume_old",
    ("classic", "configure"): "resume_old",
    ("classic", "open_windows"): "resume_old",
    ("classic", "start"): "resume_if_clean",
    ("classic", "push"): "resume_if_clean",
    ("classic", "finish"): "keep_paused",
    ("classic", "post_process"): "keep_paused",
    ("classic", "set_version"): "keep_paused",
    ("classic", "continue"): "not_resumed",
    ("staged", "configure"): "serve_on",
    ("staged", "open_windows"): "serve_on",
    ("staged", "start"): "serve_on",
    ("staged", "push"): "serve_on",
    ("staged", "finish"): "serve_on",
    ("staged", "verify"): "stale",
    ("staged", "prepare"): "stale",
    ("staged", "pause"): "stale",
    ("staged", "switch"): "stale",
    ("staged", "post_process"): "hold",
    ("staged", "set_version"): "hold",
    ("staged", "continue"): "not_resumed",
    # Delta updates run the classic table (apply_delta, a target daemons' phase, sits between finish and post_process).
    ("delta", "pause"): "resume_old",
    ("delta", "apply_delta"): "keep_paused",
    ("delta", "post_process"): "keep_paused",
    ("delta", "set_version"): "keep_paused",
    ("delta", "continue"): "not_resumed",
}
SPARSE_STEP_BASE = 1000000  # tools/testdata/weight_gen.h kSparseStepBase: from here on, steps change ~2 % of weights
# The declared table's wording of each outcome (wsync-coordinator --failure-table, "on failure" column).
DECLARED = {"resume_old": "resume old", "keep_paused": "keep paused",
            "resume_if_clean": "resume old if nothing was written, else keep paused", "serve_on": "serve on",
            "stale": "leave the engine out (stale)", "hold": "hold the engine paused (failed)",
            "not_resumed": "committed; engine not resumed"}
# The engine call a phase makes (the fault knob's names).
CALL = {"pause": "pause", "verify": "checksums", "prepare": "prepare", "switch": "switch",
        "post_process": "post_process", "set_version": "set_version", "continue": "continue"}
# The phases a node daemon answers (its fault knob, WSYNC_DAEMON_FAULTS_FILE, base/fault_knob.h): the node faulted
# and the process serving it.
DAEMON_PHASE = {"configure": ("train0", "source"), "start": ("train0", "source"), "finish": ("train0", "source"),
                "open_windows": ("infer1", "target1"), "apply_delta": ("infer1", "target1")}
CALL.update({p: p for p in DAEMON_PHASE})  # the knob's names are the phases'
# How the coordinator's error names a phase whose name it does not write.
PHASE_WORDS = {"open_windows": "opening the write window"}
SERVING = ("serving", "stale")  # the coordinator's states of an engine that serves (its label's version)
VICTIM = "engine1"
def all_rows():
    rows = []
    for (mode, phase) in EXPECT:
        faults = ("kill", "restart") if phase == "push" else ("error", "hang", "kill", "restart")
        if phase in DAEMON_PHASE:
            # A target daemon killed inside its call (its engine stays up); a hung finish is left out: its deadline
            # is the commit's timeout plus 30 s, which --test-phase-deadline does not cap.
            faults = ("error",) if phase == "finish" else \
                ("error", "hang", "kill") if DAEMON_PHASE[phase][1].startswith("target") else ("error", "hang")
        for f in faults:
            rows.append((mode, phase, f))
    return rows


class Coordinator:
    """The C API (client/c_api.h) through ctypes: this test's Python has no gRPC."""

    def __init__(self, lib, endpoint):
        self.lib = lib
        self.h = ctypes.c_void_p()
        if lib.wsync_coordinator_open(endpoint.encode(), 5.0, ctypes.byref(self.h)) != 0:
            raise RuntimeError(lib.wsync_last_error().decode())

    def _json(self, rc, out):
        text = ctypes.string_at(out).decode() if out.value else ""
        if out.value:
            self.lib.wsync_free(out)
        err = "" if rc == 0 else self.lib.wsync_coordinator_last_error(self.h).decode()
        return rc, (json.loads(text) if text.strip() else {}), err

    def begin(self, v, mode):
        out = ctypes.c_void_p()
        rc = self.lib.wsync_coordinator_begin_update_mode(self.h, v, b"", mode.encode(), ctypes.byref(out))
        return self._json(rc, out)

    def commit(self, v):
        out = ctypes.c_void_p()
        rc = self.lib.wsync_coordinator_commit_update(self.h, v, 30.0, ctypes.byref(out))
        return self._json(rc, out)

    def status(self):
        out = ctypes.c_void_p()
        return self._json(self.lib.wsync_coordinator_status(self.h, ctypes.byref(out)), out)

    def history(self):
        out = ctypes.c_void_p()
        return self._json(self.lib.wsync_coordinator_history(self.h, 0, ctypes.byref(out)), out)

    def close(self):
        self.lib.wsync_coordinator_close(self.h)


def unlink(path):
    if os.path.exists(path):
        os.unlink(path)


def load_lib(path):
    lib = ctypes.CDLL(path)
    vp, cp, pp = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)
    lib.wsync_coordinator_open.argtypes = [cp, ctypes.c_double, pp]
    lib.wsync_coordinator_begin_update_mode.argtypes = [vp, ctypes.c_int64, cp, cp, pp]
    lib.wsync_coordinator_commit_update.argtypes = [vp, ctypes.c_int64, ctypes.c_double, pp]
    lib.wsync_coordinator_status.argtypes = [vp, pp]
    lib.wsync_coordinator_history.argtypes = [vp, ctypes.c_int, pp]
    lib.wsync_coordinator_last_error.argtypes = [vp]
    lib.wsync_coordinator_last_error.restype = cp
    lib.wsync_coordinator_close.argtypes = [vp]
    lib.wsync_last_error.restype = cp
    lib.wsync_free.argtypes = [vp]
    return lib


class StatusPoller:
    """Polls Status from its own thread and client; records every answer slower than the bound (or none), except
    while the coordinator is down on purpose (a restart row)."""

    def __init__(self, lib, endpoint):
        self.lib, self.endpoint = lib, endpoint
        self.lock = threading.Lock()
        self.down = False  # set from a coordinator's kill until the restarted one answered this poller
        self.slow: list[str] = []
        self.calls = 0
        self.worst = 0.0
        self.back = False  # the restarted coordinator serves (its port file is written)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        c = Coordinator(self.lib, self.endpoint)
        while not self.stop.is_set():
            with self.lock:
                down_before = self.down
            t0 = time.time()
            rc, _, err = c.status()
            dt = time.time() - t0
            with self.lock:
                if self.down and rc == 0 and self.back:
                    self.down = False
                    continue
                if not down_before and not self.down:
                    self.calls += 1
                    self.worst = max(self.worst, dt)
                    if rc != 0 or dt > STATUS_BOUND_S:
                        self.slow.append(f"Status {'failed: ' + err[:120] if rc else 'answered'} after {dt:.2f} s")
            self.stop.wait(0.02)
        c.close()

    def take(self):
        with self.lock:
            out, self.slow = self.slow, []
            worst, self.worst = self.worst, 0.0
            calls, self.calls = self.calls, 0
        return out, worst, calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--all", action="store_true", help="run every row (the default; kept for symmetry with --rows)")
    ap.add_argument("--rows", default="", help="only these rows, 'mode:phase:fault,...' (debugging)")
    args = ap.parse_args()
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)
    lib = load_lib(os.path.abspath(args.lib))
    t_start = time.time()

    rows = all_rows()
    if args.rows:
        want = {tuple(r.split(":")) for r in args.rows.split(",")}
        rows = [r for r in rows if r in want]
    print(f"fault_matrix_real_test: {len(rows)} of {len(all_rows())} rows")

    # The declared table agrees with the invariants' expectation for every row the test knows.
    table = subprocess.run([f"{b}/wsync-coordinator", "--failure-table"], capture_output=True, text=True,
                           timeout=30).stdout
    declared = {}
    mode = None
    col = None  # the "on failure" column, found by its header (the table gains columns)
    for line in table.splitlines():
        if line.startswith("Classic"):
            mode = "classic"
        elif line.startswith("Staged"):
            mode = "staged"
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == "phase":
            col = cells.index("on failure") if "on failure" in cells else None
        elif mode and col is not None and len(cells) > col and re.fullmatch(r"\w+", cells[0]):
            declared[(mode, cells[0])] = cells[col]
    for key, want in EXPECT.items():
        if key[0] == "delta":
            continue  # the classic table's rows (the same expectations)
        check(declared.get(key) == DECLARED[want],
              f"declared table: {key[0]} {key[1]} is '{declared.get(key)}', the invariants ask '{DECLARED[want]}'")

    with harness.workdir("wsync-fault-matrix-", keep=bool(os.environ.get("WSYNC_KEEP"))) as wd:
        procs = harness.Procs(wd)
        faults_file = os.path.join(wd, "faults")
        open(faults_file, "w").close()
        os.environ["WSYNC_REF_FAULTS_FILE"] = faults_file  # inherited by the engines (the daemons ignore it)
        daemon_faults_file = os.path.join(wd, "daemon_faults")
        open(daemon_faults_file, "w").close()
        os.environ["WSYNC_DAEMON_FAULTS_FILE"] = daemon_faults_file  # inherited by the node daemons
        coord = f"127.0.0.1:{harness.free_port()}"
        src_listen = f"127.0.0.1:{harness.free_port()}"
        src_sock = os.path.join(wd, "source.sock")
        engines = {e: f"127.0.0.1:{harness.free_port()}" for e in ("engine0", "engine1")}
        restarts = [0]
        poller = None
        try:
            def port_of(name):
                path = os.path.join(wd, f"{name}.port")
                return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name],
                                        0.02)

            def start_coordinator():
                restarts[0] += 1
                name = f"coordinator{restarts[0]}"
                unlink(os.path.join(wd, f"{name}.port"))
                procs.start(name, [f"{b}/wsync-coordinator", "--listen", coord, "--state",
                                   f"sqlite:{wd}/state.db", "--test-phase-deadline", str(PHASE_DEADLINE_S),
                                   "--port-file", os.path.join(wd, f"{name}.port")])
                port_of(name)
                return name

            def start_engine(e):
                unlink(os.path.join(wd, f"{e}.port"))
                procs.start(e, [f"{b}/wsync-engine-ref", "--id", e, "--model", model, "--tp", "1", "--staging",
                                "--listen", engines[e], "--port-file", os.path.join(wd, f"{e}.port")])
                port_of(e)

            def start_target(e):
                n = e[-1]
                unlink(os.path.join(wd, f"target{n}.port"))
                procs.start(f"target{n}", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target",
                                           "--node-id", f"infer{n}", "--coordinator", coord, "--engine",
                                           f"reference+grpc://{engines[e]}", "--engine-socket",
                                           os.path.join(wd, f"target{n}.sock"),
                                           "--port-file", os.path.join(wd, f"target{n}.port")])
                port_of(f"target{n}")

            def start_source():
                unlink(os.path.join(wd, "source.port"))
                procs.start("source", [f"{b}/wsyncd", "--listen", src_listen, "--role", "source", "--node-id",
                                       "train0", "--trainer-socket", src_sock, "--coordinator", coord,
                                       "--trainer-ranks", "1", "--ring-mib", "16",
                                       "--port-file", os.path.join(wd, "source.port")])
                port_of("source")

            cname = [start_coordinator()]
            for e in engines:
                start_engine(e)
                start_target(e)
            start_source()
            ctl = Coordinator(lib, coord)

            def status():
                rc, st, err = ctl.status()
                if rc != 0:
                    raise RuntimeError(err)
                return st

            def details(st):
                return {d["engine_id"]: d for n in st.get("nodes", []) for d in n.get("engine_details", [])}

            def all_registered():
                st = status()
                up = sorted(n["node_id"] for n in st.get("nodes", []) if n.get("reachable"))
                return (up == ["infer0", "infer1", "train0"] and len(details(st)) == 2) or None

            harness.wait_for("every node registered", all_registered, 30, procs, list(procs.procs), 0.05)
            poller = StatusPoller(lib, coord)

            def log_of(name):
                return procs.tail(name, 100000) if name in procs.procs else ""

            def engine_paused(e):
                """The engine's own word (its log, since its last start): paused since its last continue? None if it
                never said."""
                text = log_of(e)
                last = None
                for line in text.splitlines():
                    if f"engine {e}: paused" in line:
                        last = True
                    elif f"engine {e}: generation continued" in line:
                        last = False
                return last

            def verify(e, step):
                r = subprocess.run([f"{b}/wsyncctl", "verify", "--synthetic", "--engine", engines[e], "--step",
                                    str(step), "--endpoints", coord], capture_output=True, text=True, timeout=60)
                return r.returncode == 0, (r.stdout + r.stderr).strip()[-300:]

            def push(v):
                """The trainer rank pushes step v's generated weights (the engines' Verify derives the same)."""
                return subprocess.Popen([f"{b}/wsync-trainer-demo", "--daemon", src_sock, "--model", model,
                                         "--updates", "1", "--first-version", str(v), "--bucket-mib", "1"],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def update(v, mode, on_open=None):
                """Begin, push, commit; returns (ok, error text). `on_open` runs once the update is open."""
                if mode == "delta":  # the C API has no delta option: the trainer rank drives the update
                    r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src_sock, "--model", model,
                                        "--updates", "1", "--first-version", str(v), "--bucket-mib", "1", "--drive",
                                        "--coordinator", coord, "--delta", "always"],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
                    return r.returncode == 0, r.stdout.strip()[-300:]
                rc, _, err = ctl.begin(v, mode)
                if rc != 0:
                    return False, f"begin: {err}"
                if on_open:
                    on_open()
                if procs.alive("source"):  # (a push row may have killed it)
                    t = push(v)
                    try:
                        t.communicate(timeout=60)
                    except subprocess.TimeoutExpired:
                        t.kill()
                        t.communicate()
                rc, rec, err = ctl.commit(v)
                if rc != 0:
                    return False, f"commit: {err}"
                return True, ""

            seen = {"current": 0, "labels": {e: 0 for e in engines}}

            def good_update(v, why):
                ok, err = update(v, "classic")
                st = status()
                ds = details(st)
                fine = ok and st.get("current_version") == str(v)
                for e in engines:
                    vok, vout = verify(e, v)
                    fine = fine and vok and ds.get(e, {}).get("weight_version") == str(v) and \
                        ds[e].get("state") == "serving" and engine_paused(e) is False
                    if not vok:
                        print(vout)
                check(fine, f"{why}: update {v} lands on both engines, verified by each engine's loader, serving "
                      f"({err[:1200]})")
                if fine:
                    seen["current"] = v
                    for e in engines:
                        seen["labels"][e] = v
                return fine

            version = 1
            check(good_update(version, "setup"), "setup: the fleet is on version 1")

            def fault_count(e, call):
                if call in DAEMON_PHASE:  # a node daemon's phase: it names the node (e is not asked)
                    node, proc = DAEMON_PHASE[call]
                    return log_of(proc).count(f"daemon_fault: node {node} reached {call} ")
                return log_of(e).count(f"ref_fault: engine {e} reached {call} ")

            def wait_fault(e, call, before):
                harness.wait_for(f"{e} reaching {call}", lambda: fault_count(e, call) > before or None, 60, None,
                                 None, 0.02)

            def restart_coordinator():
                with poller.lock:
                    poller.down, poller.back = True, False
                procs.kill(cname[0])
                cname[0] = start_coordinator()
                with poller.lock:
                    poller.back = True

            for (mode, phase, fault) in rows:
                tag = f"[{mode} {phase} {fault}]"
                if mode == "delta" and version < SPARSE_STEP_BASE:
                    # RL-like consecutive steps from here on (a dense base first), so that updates send deltas.
                    version = SPARSE_STEP_BASE
                    good_update(version, "delta base")
                    if any(r[0] == "staged" for r in rows):
                        # The first delta update after staged switches (a two-copy engine's live copy may be its
                        # second) takes deltas and lands; it once failed every rank with 'delta base mismatch'.
                        version += 1
                        ok, err = update(version, "delta")
                        last = ctl.history()[1].get("records", [{}])[-1]
                        check(ok and last.get("delta_ranks"),
                              f"[delta after staged] update {version} lands with deltas on {last.get('delta_ranks')} "
                              f"({err[-300:]})")
                        version += 1
                        good_update(version, "[delta after staged] recovery")
                t_row = time.time()
                poller.take()
                old = version
                version += 1
                v = version
                want = EXPECT[(mode, phase)]
                victim = "source" if phase == "push" and fault == "kill" else VICTIM
                if phase in DAEMON_PHASE:
                    node, victim = DAEMON_PHASE[phase]
                if phase == "configure":
                    # A source that holds the plan is not configured again: a new source process holds none.
                    procs.kill("source")
                    start_source()
                    harness.wait_for("every node registered", all_registered, 30, procs, list(procs.procs), 0.05)
                killed = []
                result = {}

                def act():
                    if fault == "kill":
                        procs.kill(victim)
                        killed.append(victim)
                    elif fault == "restart":
                        restart_coordinator()

                if phase == "push":
                    def on_open():
                        harness.wait_for("update open", lambda: status().get("state") == "updating" or None, 30,
                                         None, None, 0.02)
                        act()
                    ok, err = update(v, mode, on_open)
                else:
                    action = "error" if fault == "error" else "hang"
                    fired_before = fault_count(VICTIM, CALL[phase])
                    if phase in DAEMON_PHASE:
                        with open(daemon_faults_file, "w") as f:
                            f.write(f"{node} {phase} {action} row{v}\n")
                    else:
                        with open(faults_file, "w") as f:
                            f.write(f"{VICTIM} {CALL[phase]} {action} row{v}\n")
                    th = threading.Thread(target=lambda: result.update(zip(("ok", "err"), update(v, mode))))
                    th.start()
                    if fault in ("kill", "restart"):
                        wait_fault(VICTIM, CALL[phase], fired_before)
                        act()
                    th.join(timeout=120)
                    check(not th.is_alive(), f"{tag} the update's calls returned")
                    ok, err = result.get("ok", False), result.get("err", "")
                    open(faults_file, "w").close()
                    open(daemon_faults_file, "w").close()
                if phase != "push" and fault != "kill":
                    check(fault_count(VICTIM, CALL[phase]) > fired_before,
                          f"{tag} the fault fired at {node if phase in DAEMON_PHASE else VICTIM}'s {CALL[phase]}")

                # Let an update that commits past the fault finish its last phase before reading the outcome.
                harness.wait_for("the update closed",
                                 lambda: status().get("state") in ("idle", "failed") or None, 60, None, None, 0.02)
                st = status()
                ds = details(st)
                _, hist, _ = ctl.history()
                rec = next((r for r in hist.get("records", []) if str(r.get("version")) == str(v)), {})
                cur = int(st.get("current_version") or 0)
                print(f"{tag} update {v}: ok={ok} current={cur} record success={rec.get('success')} "
                      f"error={rec.get('error', '')[:300]!r} stale={rec.get('stale')} "
                      f"not_resumed={rec.get('not_resumed')} delta_ranks={rec.get('delta_ranks')} states="
                      f"{ {e: (d.get('state'), d.get('weight_version'), d.get('stale')) for e, d in ds.items()} }")

                if mode == "delta" and phase != "pause" and fault != "restart":
                    check(rec.get("delta_ranks"), f"{tag} update {v} sent deltas: {rec.get('delta_ranks')}")

                # (c) versions never go backwards.
                check(cur >= seen["current"], f"{tag} (c) current version {cur} >= {seen['current']}")
                for e, d in ds.items():
                    lab = int(d.get("weight_version") or 0)
                    check(lab >= seen["labels"][e], f"{tag} (c) {e}'s label {lab} >= {seen['labels'][e]}")
                    seen["labels"][e] = max(seen["labels"][e], lab)
                seen["current"] = max(seen["current"], cur)

                # (a) + (b): what each engine is reported as is true.
                for e in engines:
                    if e in killed:
                        continue
                    d = ds.get(e, {})
                    state, lab = d.get("state", ""), d.get("weight_version", "")
                    real = engine_paused(e)
                    if state in SERVING:  # "stale": serving an older version than the current one
                        vok, vout = verify(e, int(lab or 0))
                        check(vok, f"{tag} (a) {e} reported serving version {lab}: its loader agrees ({vout[-160:]})")
                        check(real is False, f"{tag} (b) {e} reported serving is not paused (its log: paused={real})")
                        check(lab == str(cur) or d.get("stale"),
                              f"{tag} (b) {e} serving {lab}: the current version {cur}, or reported stale")
                    else:
                        check(real is True or state.startswith("failed"),
                              f"{tag} (b) {e} reported {state!r}: the engine is paused (its log: paused={real})")
                    if fault == "restart":
                        # The restarted coordinator asked every engine (each is up): none is left unknown.
                        check(state != "failed: engine_info",
                              f"{tag} (b) the restarted coordinator reports {e} as it answered: {state!r}")

                # (d) the outcome names the faulted peer and the phase.
                peer = node if phase in DAEMON_PHASE else {"source": "train0"}.get(victim, victim)
                if fault == "restart":
                    named = rec.get("success") is False and "restart" in rec.get("error", "")
                    check(named or rec.get("success") is True,
                          f"{tag} (d) update {v} committed before the restart, or its record says the coordinator "
                          f"restarted: {rec.get('error', '')[:200]!r}")
                elif want in ("stale", "hold", "not_resumed") and rec.get("success"):
                    names = " ".join(rec.get("stale", []) + rec.get("not_resumed", []))
                    check(peer in names and (want == "not_resumed" or phase in names or CALL[phase] in names
                                             or (phase == "verify" and "not verified" in names)),
                          f"{tag} (d) the committed record names {peer} and {phase}: stale={rec.get('stale')} "
                          f"not_resumed={rec.get('not_resumed')}")
                else:
                    er = rec.get("error", "")
                    # The coordinator's own words, not the knob's ("injected fault at open_windows").
                    own = re.sub(r"injected (fault|hang) at \w+", "", er)
                    check(rec.get("success") is False and peer in own
                          and (phase in own or PHASE_WORDS.get(phase, phase) in own or phase == "push"),
                          f"{tag} (d) update {v} failed naming {peer} and {phase}: {er[:240]!r}")

                # After a restart past the commit point: committed, every engine labelled with the new version; the
                # faulted one's Continue never landed: paused, not resumed ((b) checked each state against the
                # engine's own word: the other one serves, unless the kill came before its Continue landed).
                if fault == "restart" and want == "not_resumed":
                    others = [e for e in engines if e != VICTIM]
                    check(rec.get("success") is True and cur == v,
                          f"{tag} restart past the commit point: update {v} committed, current {cur}")
                    for e in others:
                        check(ds[e].get("weight_version") == str(v)
                              and (ds[e].get("state") == "serving" or e in st.get("not_resumed", [])),
                              f"{tag} restart: {e} on the new version {v}, serving or not resumed: "
                              f"{ds[e].get('state')} {ds[e].get('weight_version')} {st.get('not_resumed')}")
                    d = ds[VICTIM]
                    check(d.get("weight_version") == str(v) and d.get("state") not in SERVING
                          and VICTIM in st.get("not_resumed", []),
                          f"{tag} restart: {VICTIM} labelled {v}, paused, reported not resumed: {d} "
                          f"{st.get('not_resumed')}")

                # The row's outcome, as the invariants ask (survivors only where the victim died).
                if fault != "restart":
                    others = [e for e in engines if e != VICTIM]
                    if want in ("resume_old", "serve_on"):
                        for e in engines:
                            if e in killed:
                                continue
                            # The engine whose pause failed may be reported failed at it (not ready): it was never
                            # paused, and (a) checked its memory holds its label when it is reported serving.
                            failed_here = e == VICTIM and ds[e].get("state") == f"failed: {phase}"
                            if failed_here:
                                vok, vout = verify(e, old)
                                check(vok and engine_paused(e) is not True,
                                      f"{tag} {want}: {e}, reported failed at {phase}, is not paused and holds the old "
                                      f"version {old} ({vout[-120:]})")
                            check((ds[e].get("state") == "serving" or failed_here)
                                  and ds[e].get("weight_version") == str(old),
                                  f"{tag} {want}: {e} serves the old version {old}: {ds[e].get('state')} "
                                  f"{ds[e].get('weight_version')}")
                        if want == "serve_on":
                            check(engine_paused("engine0") is False, f"{tag} serve_on: engine0 never paused")
                    elif want == "keep_paused":
                        for e in engines:
                            if e in killed:
                                continue
                            # A set_version that succeeded on one engine before another's failed leaves that
                            # engine labelled with the version it holds in full, still paused.
                            labels = (str(old), str(v)) if phase == "set_version" else (str(old),)
                            check(ds[e].get("state") not in SERVING and ds[e].get("weight_version") in labels
                                  and engine_paused(e) is True and st.get("engines_hold_partial_writes") is True,
                                  f"{tag} keep_paused: {e} paused at its old label {old}, flagged partial: "
                                  f"{ds[e].get('state')} {ds[e].get('weight_version')}")
                    elif want == "resume_if_clean":
                        check(cur == old, f"{tag} resume_if_clean: the version stays {old}")
                    elif want in ("stale", "hold", "not_resumed"):
                        for e in others:
                            check(ds[e].get("state") == "serving" and ds[e].get("weight_version") == str(v),
                                  f"{tag} {want}: {e} serves the new version {v}: {ds[e].get('state')} "
                                  f"{ds[e].get('weight_version')}")
                        if VICTIM not in killed:
                            d = ds[VICTIM]
                            if want == "stale":
                                # An engine whose pause failed is reported failed at it (not ready): never paused,
                                # and its memory holds the old version.
                                vok, vout = verify(VICTIM, old)
                                check((d.get("state") in SERVING or d.get("state") == f"failed: {phase}")
                                      and d.get("weight_version") == str(old) and d.get("stale") and vok
                                      and engine_paused(VICTIM) is False,
                                      f"{tag} stale: {VICTIM} serves the old version {old}, marked stale: {d}")
                            elif want == "hold":
                                check(d.get("state") not in SERVING and d.get("weight_version") == str(old)
                                      and engine_paused(VICTIM) is True,
                                      f"{tag} hold: {VICTIM} paused at its old label {old}, never resumed: {d}")
                            else:
                                check(d.get("weight_version") == str(v) and d.get("state") not in SERVING
                                      and VICTIM in st.get("not_resumed", []),
                                      f"{tag} not_resumed: {VICTIM} labelled {v}, paused, reported not resumed: "
                                      f"{d} {st.get('not_resumed')}")

                # (e) Status answered within the bound throughout (and the poller got at least one answer in the row,
                # after a restart from the new coordinator).
                harness.wait_for("a Status poll in this row", lambda: poller.calls > 0 or None, 10, None, None, 0.02)
                slow, worst, calls = poller.take()
                check(not slow and calls > 0, f"{tag} (e) Status answered {calls} polls, slowest {worst:.3f} s "
                      f"(bound {STATUS_BOUND_S} s): {slow[:3]}")

                # Back to one verified version: restart what died, then one clean update.
                if killed:
                    if victim == "source":
                        start_source()
                    elif victim.startswith("target"):
                        start_target(f"engine{victim[-1]}")  # its engine stayed up: it attaches again
                    else:
                        procs.kill(f"target{VICTIM[-1]}")  # a restarted engine attaches through a restarted target
                        start_engine(VICTIM)
                        start_target(VICTIM)
                harness.wait_for("every node registered", all_registered, 30, procs, list(procs.procs), 0.05)
                version += 1
                good_update(version, f"{tag} recovery")
                print(f"fault_matrix_real_test: {tag} {time.time() - t_row:.2f} s")

        finally:
            if poller:
                poller.stop.set()
            procs.close()
    print(f"fault_matrix_real_test: {len(rows)} rows in {time.time() - t_start:.1f} s")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
