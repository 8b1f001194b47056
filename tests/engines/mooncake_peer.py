#!/usr/bin/env python3
"""A test peer shaped like one SGLang TP rank that serves its weights through the real Mooncake Transfer Engine.

What SGLang 0.5.23 does per TP rank (../shared/reference/engine-apis.md §1.4), reproduced with the real engine:
  - TransferEngine().initialize(local_ip, "P2PHANDSHAKE", protocol, device); session id "ip:rpc_port";
  - the rank's parameters live in a few allocations; every allocation is registered once (register_memory);
  - the bootstrap server answers GET /get_transfer_engine_info?rank=N with
    {"rank": N, "remote_instance_transfer_engine_info": [session_id, {name: [data_ptr, numel, element_size]}]},
    404 for a rank it does not know (400 for rank < 0), GET /health -> "OK".
Test-only control endpoints on the same HTTP server:
  GET  /wsync_test/checksums  -> {"rank", "session_id", "checksums": {name: sha256 hex of the current bytes}}
  GET  /wsync_test/initial    -> the same for the bytes the peer started with (computed from initial_bytes())
  POST /wsync_test/exit       -> 200, then the process unregisters its memory and exits 0
  POST /wsync_test/region?length=N&fill=B  -> {"addr": A}: N more bytes, every one B, registered with the engine
       (the conformance suite's destination memory, tests/transport/mooncake_factory.cc)
  GET  /wsync_test/bytes?addr=A&length=N   -> those bytes of a region as they are now (application/octet-stream)
  POST /wsync_test/fill?addr=A&length=N&byte=B -> 200 once every one of those bytes is B
On start it prints one JSON line to stdout: {"ready": true, "bootstrap": "H:P", "rank", "session_id", "params": N}.

Layout (--layout FILE): JSON {"regions": [[{"name", "numel", "element_size"}, ...], ...]}; each region is one
allocation (one registered buffer), parameters packed in order at 512-byte aligned offsets, like torch's caching
allocator. Without --layout a small built-in table (2 regions, sizes from 6 bytes to ~330 KiB) is used.

Run it with the venv from tools/testing/engines/install_mooncake.sh:
  PY=$(tools/testing/engines/install_mooncake.sh | tail -n1); $PY tests/engines/mooncake_peer.py --rank 0
"""
import argparse
import ctypes
import hashlib
import http.server
import json
import mmap
import os
import sys
import threading
import urllib.parse

ALIGN = 512

# Built-in table: names and shapes of a tiny Qwen3-like TP rank (bf16 = 2 bytes, fp32 = 4).
BUILTIN_LAYOUT = {
    "regions": [
        [
            {"name": "model.embed_tokens.weight", "numel": 1024 * 160, "element_size": 2},
            {"name": "model.layers.0.input_layernorm.weight", "numel": 64, "element_size": 2},
            {"name": "model.layers.0.self_attn.qkv_proj.weight", "numel": 64 * 192, "element_size": 2},
            {"name": "model.layers.0.self_attn.q_norm.weight", "numel": 3, "element_size": 2},
        ],
        [
            {"name": "model.layers.0.self_attn.o_proj.weight", "numel": 64 * 64, "element_size": 2},
            {"name": "model.layers.0.mlp.gate_up_proj.weight", "numel": 2 * 256 * 64, "element_size": 2},
            {"name": "model.layers.0.mlp.down_proj.weight", "numel": 64 * 256, "element_size": 2},
            {"name": "model.norm.weight", "numel": 64, "element_size": 4},
        ],
    ]
}


def pattern_bytes(seed: str, n: int) -> bytes:
    """n deterministic bytes from a seed (sha256 in counter mode); shared by the peer and the writer check."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def initial_bytes(rank: int, name: str, n: int) -> bytes:
    return pattern_bytes(f"initial/rank{rank}/{name}", n)


def load_layout(path):
    if path is None:
        return BUILTIN_LAYOUT
    with open(path) as f:
        layout = json.load(f)
    if not isinstance(layout.get("regions"), list) or not layout["regions"]:
        raise SystemExit(f"{path}: expected {{\"regions\": [[{{name, numel, element_size}}, ...], ...]}}")
    return layout


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """Quiet request handler with one reply helper (JSON by default); shared by the test peers."""

    def log_message(self, fmt, *a):  # quiet; errors still reach stderr through send_error
        pass

    def reply(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Rank:
    """Host memory laid out like one TP rank: regions (mmaps) holding parameters at aligned offsets."""

    def __init__(self, rank, layout):
        self.rank = rank
        self.regions = []  # (mmap, base address, size)
        self.params = {}  # name -> (region index, offset, numel, element_size)
        seen = set()
        for ri, plist in enumerate(layout["regions"]):
            off = 0
            placed = []
            for p in plist:
                name, numel, esz = p["name"], int(p["numel"]), int(p["element_size"])
                if name in seen or numel <= 0 or esz not in (1, 2, 4, 8):
                    raise SystemExit(f"bad layout entry {p!r} (duplicate name, numel <= 0 or element_size)")
                seen.add(name)
                placed.append((name, off, numel, esz))
                off += (numel * esz + ALIGN - 1) // ALIGN * ALIGN
            size = max(off, ALIGN)
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            self.regions.append((mm, base, size))
            for name, off, numel, esz in placed:
                self.params[name] = (ri, off, numel, esz)
                nbytes = numel * esz
                mm[off:off + nbytes] = initial_bytes(rank, name, nbytes)

    def weights_info(self):
        return {name: [self.regions[ri][1] + off, numel, esz] for name, (ri, off, numel, esz) in self.params.items()}

    def checksums(self):
        out = {}
        for name, (ri, off, numel, esz) in self.params.items():
            mv = memoryview(self.regions[ri][0])[off:off + numel * esz]
            out[name] = hashlib.sha256(mv).hexdigest()
            mv.release()
        return out

    def add_region(self, length, fill):
        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if fill:
            mm.write(bytes([fill]) * length)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.regions.append((mm, base, length))
        return base

    def view(self, addr, length):
        """The bytes [addr, addr + length) of one region, or None where they are not inside one."""
        for mm, base, size in self.regions:
            if base <= addr and addr + length <= base + size:
                return memoryview(mm)[addr - base:addr - base + length]
        return None

    def initial_checksums(self):
        return {name: hashlib.sha256(initial_bytes(self.rank, name, numel * esz)).hexdigest()
                for name, (ri, off, numel, esz) in self.params.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=0, help="TP rank this peer plays (the bootstrap knows only it)")
    ap.add_argument("--layout", help="JSON layout file (default: built-in table)")
    ap.add_argument("--local-ip", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp", help="Mooncake protocol: tcp (default) or rdma")
    ap.add_argument("--device", default="", help="Mooncake device filter (rdma: e.g. rxe0)")
    ap.add_argument("--bootstrap-host", default="127.0.0.1")
    ap.add_argument("--bootstrap-port", type=int, default=0, help="0: the kernel picks one (printed on start)")
    args = ap.parse_args()

    from mooncake.engine import TransferEngine  # the real engine, from the venv

    rank = Rank(args.rank, load_layout(args.layout))
    engine = TransferEngine()
    rc = engine.initialize(args.local_ip, "P2PHANDSHAKE", args.protocol, args.device)
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize({args.local_ip!r}, 'P2PHANDSHAKE', {args.protocol!r}) = {rc}")
    host = f"[{args.local_ip}]" if ":" in args.local_ip else args.local_ip
    session_id = f"{host}:{engine.get_rpc_port()}"  # what SGLang publishes (NetworkAddress.to_host_port_str)
    for _, base, size in rank.regions:
        rc = engine.register_memory(base, size)
        if rc != 0:
            raise SystemExit(f"register_memory(0x{base:x}, {size}) = {rc}")

    info = [session_id, rank.weights_info()]
    stop = threading.Event()
    lock = threading.Lock()  # regions added by concurrent requests

    class Handler(JsonHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            q = urllib.parse.parse_qs(url.query)
            if url.path == "/health":
                return self.reply(200, b"OK", "text/plain")
            if url.path == "/get_transfer_engine_info":
                try:
                    r = int(q["rank"][0])
                except (KeyError, ValueError):
                    return self.reply(400, {"error": "rank must be an integer query parameter"})
                if r < 0:
                    return self.reply(400, {"error": f"invalid rank {r}"})
                if r != args.rank:
                    return self.reply(404, {"error": f"no transfer engine info for rank {r}"})
                return self.reply(200, {"rank": r, "remote_instance_transfer_engine_info": info})
            if url.path == "/wsync_test/checksums":
                return self.reply(200, {"rank": args.rank, "session_id": session_id, "checksums": rank.checksums()})
            if url.path == "/wsync_test/bytes":
                mv = rank.view(int(q["addr"][0]), int(q["length"][0]))
                if mv is None:
                    return self.reply(400, {"error": "not inside one region"})
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(mv)))
                self.end_headers()
                self.wfile.write(mv)
                mv.release()
                return
            if url.path == "/wsync_test/initial":
                return self.reply(200, {"rank": args.rank, "session_id": session_id,
                                        "checksums": rank.initial_checksums()})
            self.reply(404, {"error": f"unknown path {url.path}"})

        def do_POST(self):
            url = urllib.parse.urlparse(self.path)
            q = urllib.parse.parse_qs(url.query)
            if url.path == "/wsync_test/region":
                length, fill = int(q["length"][0]), int(q.get("fill", ["0"])[0])
                if length <= 0 or not 0 <= fill <= 255:
                    return self.reply(400, {"error": "length must be > 0 and fill a byte"})
                with lock:
                    base = rank.add_region(length, fill)
                    rc = engine.register_memory(base, length)
                if rc != 0:
                    return self.reply(500, {"error": f"register_memory(0x{base:x}, {length}) = {rc}"})
                return self.reply(200, {"addr": base})
            if url.path == "/wsync_test/fill":
                mv = rank.view(int(q["addr"][0]), int(q["length"][0]))
                if mv is None:
                    return self.reply(400, {"error": "not inside one region"})
                mv[:] = bytes([int(q["byte"][0])]) * len(mv)
                mv.release()
                return self.reply(200, {"filled": True})
            if url.path == "/wsync_test/exit":
                self.reply(200, {"exiting": True})
                stop.set()
                return
            self.reply(404, {"error": "unknown path"})

    server = http.server.ThreadingHTTPServer((args.bootstrap_host, args.bootstrap_port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"ready": True, "bootstrap": f"{args.bootstrap_host}:{server.server_address[1]}",
                      "rank": args.rank, "session_id": session_id, "params": len(rank.params),
                      "regions": [[f"0x{b:x}", s] for _, b, s in rank.regions]}), flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    for _, base, _ in rank.regions:
        engine.unregister_memory(base)
    sys.stdout.flush()
    # The engine's threads and the mmaps' exported buffers make an orderly interpreter teardown slow or noisy.
    os._exit(0)


if __name__ == "__main__":
    main()
