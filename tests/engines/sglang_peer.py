#!/usr/bin/env python3
"""A stand-in for an SGLang 0.5.23 server at TP=N whose weight memory is registered with the real Mooncake Transfer
Engine, as SGLang does with --remote-instance-weight-loader-start-seed-via-transfer-engine (engine-apis.md §1.4):
one TransferEngine per TP rank (initialize(ip, "P2PHANDSHAKE", "tcp", "")), each rank's parameters in a few
allocations registered once, published by a bootstrap server keyed by TP rank.

It also serves the control endpoints a P2P weight update uses, with SGLang's contract (§1.2, §1.3): request bodies
are validated as SGLang would (a JSON object body for POSTs, `mode` and `selector` values, `new_version` required;
unknown keys ignored), the begin/end weight-update session is a state machine with SGLang's error texts, /flush_cache
answers plain text, /update_weight_version defaults abort_all_requests to true. Every call is logged, and the peer
snapshots sha256 checksums of every parameter at pause (what was served), at end_weight_update and when a version is
set, so a test can check the bytes against its own expectation.

  $PY tests/engines/sglang_peer.py --layout LAYOUT.json --tp 2 [--missing-rank R] [--http-port P --bootstrap-port B]
LAYOUT.json: {"ranks": [{"regions": [[{"name", "numel", "element_size"}, ...], ...]}, ...]} (one entry per TP rank).
Prints one JSON line when ready: {"ready": true, "http": "H:P", "bootstrap": "H:B", "sessions": [...]}.

Test-only endpoints (HTTP port): GET /wsync_test/log -> {"calls": [...], "snapshots": {"<tag>": {rank: {name:
sha256}}}}, POST /wsync_test/exit.
"""
import argparse
import json
import os
import sys
import threading
import time
import urllib.parse
import http.server

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mooncake_peer import JsonHandler, Rank  # noqa: E402  (reply helper; host memory laid out like a TP rank)

PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("target", "draft", "all")


class Engine:
    def __init__(self, args, ranks, sessions):
        self.args = args
        self.ranks = ranks
        self.sessions = sessions
        self.lock = threading.Lock()
        self.calls = []
        self.snapshots = {}
        self.paused = False
        self.session_open = False
        self.weight_version = "default"

    def snapshot(self, tag):
        self.snapshots[tag] = {str(r.rank): r.checksums() for r in self.ranks}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--local-ip", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--bootstrap-port", type=int, default=0)
    ap.add_argument("--missing-rank", type=int, default=-1, help="the bootstrap answers 404 for this rank")
    ap.add_argument("--die-on", default="", help="exit(3) when this control path is called (a crash mid-update)")
    args = ap.parse_args()

    from mooncake.engine import TransferEngine  # the real engine, from the venv

    layout = json.load(open(args.layout))
    if len(layout["ranks"]) != args.tp:
        raise SystemExit(f"layout has {len(layout['ranks'])} ranks, --tp {args.tp}")
    ranks, engines, sessions = [], [], []
    for r in range(args.tp):
        rank = Rank(r, layout["ranks"][r])
        te = TransferEngine()
        rc = te.initialize(args.local_ip, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"TransferEngine.initialize = {rc}")
        for _, base, size in rank.regions:
            if te.register_memory(base, size) != 0:
                raise SystemExit(f"register_memory(0x{base:x}, {size}) failed")
        ranks.append(rank)
        engines.append(te)  # kept alive for the process lifetime
        sessions.append(f"{args.local_ip}:{te.get_rpc_port()}")
    eng = Engine(args, ranks, sessions)
    eng.snapshot("initial")
    stop = threading.Event()

    class Base(JsonHandler):
        protocol_version = "HTTP/1.1"

    class Bootstrap(Base):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            if url.path == "/health":
                return self.reply(200, b"OK", "text/plain")
            if url.path != "/get_transfer_engine_info":
                return self.reply(404, {"detail": "Not Found"})
            try:
                r = int(urllib.parse.parse_qs(url.query)["rank"][0])
            except (KeyError, ValueError):
                return self.reply(400, {"error": "Missing or invalid rank parameter"})
            if r < 0:
                return self.reply(400, {"error": "invalid rank"})
            if r >= args.tp or r == args.missing_rank:
                return self.reply(404, {"error": f"no transfer engine info for rank {r}"})
            return self.reply(200, {"rank": r, "remote_instance_transfer_engine_info":
                                    [sessions[r], ranks[r].weights_info()]})

    def bad(msg):
        return 400, {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}

    def control(method, path, query, body):
        """(status, body[, content type]) for one control request, SGLang's rules."""
        if method == "POST" and path != "/flush_cache" and not isinstance(body, dict):
            return bad("a JSON object body is required")
        if path == "/server_info" and method == "GET":
            return 200, {"tp_size": args.tp, "pp_size": 1, "dp_size": 1, "ep_size": 1, "enable_dp_attention": False,
                         "version": "0.5.23"}
        if path == "/model_info" and method == "GET":
            return 200, {"model_path": "tiny", "weight_version": eng.weight_version, "is_generation": True}
        if path == "/health":
            return 500, {"error": {"message": "the test forbids /health: it blocks while paused"}}
        if path == "/pause_generation" and method == "POST":
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                return bad(f"mode: expected one of {PAUSE_MODES}, got {mode!r}")
            eng.paused = True
            eng.snapshot(f"pause@{len(eng.calls)}")
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/begin_weight_update" and method == "POST":
            sel = body.get("selector", "all")
            if sel not in SELECTORS:
                return bad(f"selector: expected one of {SELECTORS}, got {sel!r}")
            if eng.session_open:
                return 400, {"success": False,
                             "message": "a weight-update session is already open; call end_weight_update() first"}
            eng.session_open = True
            return 200, {"success": True, "message": "ok"}
        if path == "/end_weight_update" and method == "POST":
            if not eng.session_open:
                return 400, {"success": False,
                             "message": "no weight-update session is open; call begin_weight_update() first"}
            eng.session_open = False
            eng.snapshot(f"end@{len(eng.calls)}")
            return 200, {"success": True, "message": "ok"}
        if path == "/update_weight_version" and method == "POST":
            v = body.get("new_version")
            if not isinstance(v, str):
                return bad("new_version: a string is required")
            if body.get("abort_all_requests", True):
                eng.calls[-1]["aborted_all_requests"] = True  # SGLang's default: every in-flight request aborted
            eng.weight_version = v
            eng.snapshot(f"version:{v}")
            return 200, {"success": True, "message": f"Weight version updated to {v}", "new_version": v}
        if path == "/flush_cache" and method in ("GET", "POST"):
            t = float(query.get("timeout", ["0"])[0])
            if t < 0:
                return bad("timeout must be >= 0")
            return 200, b"Cache flushed.\nPlease check backend logs for more details.", "text/plain"
        if path == "/continue_generation" and method == "POST":
            eng.paused = False
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/wsync_test/log" and method == "GET":
            return 200, {"calls": eng.calls, "snapshots": eng.snapshots}
        if path == "/wsync_test/exit" and method == "POST":
            stop.set()
            return 200, {"exiting": True}
        return 404, {"detail": "Not Found"}

    class Control(Base):
        def handle_one(self, method):
            url = urllib.parse.urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            body = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    return self.reply(*bad("body is not JSON"))
            if args.die_on and url.path == args.die_on:
                os._exit(3)
            with eng.lock:
                if not url.path.startswith("/wsync_test/"):
                    eng.calls.append({"method": method, "path": url.path, "query": url.query, "body": body,
                                      "t": time.time()})
                out = control(method, url.path, urllib.parse.parse_qs(url.query), body)
            self.reply(*out)

        def do_GET(self):
            self.handle_one("GET")

        def do_POST(self):
            self.handle_one("POST")

    boot = http.server.ThreadingHTTPServer((args.local_ip, args.bootstrap_port), Bootstrap)
    ctl = http.server.ThreadingHTTPServer((args.local_ip, args.http_port), Control)
    for s in (boot, ctl):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(json.dumps({"ready": True, "http": f"{args.local_ip}:{ctl.server_address[1]}",
                      "bootstrap": f"{args.local_ip}:{boot.server_address[1]}", "sessions": sessions}), flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    boot.shutdown()
    ctl.shutdown()


if __name__ == "__main__":
    main()
