#!/usr/bin/env python3
"""Writes known bytes into a Mooncake peer (tests/engines/mooncake_peer.py, or any SGLang-shaped bootstrap) with a
second, real Mooncake TransferEngine and checks the peer's checksums. The reference that wsync's `mooncake`
transport is compared with: same bootstrap, same session, same bytes.

Steps (each prints one line; exit status 0 only if all pass):
  1. GET /get_transfer_engine_info?rank=R -> session id and {name: [ptr, numel, element_size]};
     an unknown rank (R + 1000) must answer 404.
  2. GET /wsync_test/checksums must equal the peer's initial bytes (computed here, independently, from the seed).
  3. TransferEngine.initialize(local_ip, "P2PHANDSHAKE", protocol, device); one source buffer with every
     parameter's new bytes, registered; transfer_sync_write per parameter (every parameter but the last),
     then one batch_transfer_sync_write for the last one.  --skip NAME leaves that parameter unwritten.
  4. Checksums: written parameters = sha256 of the new bytes, skipped ones = their initial bytes.
  5. transfer_sync_read of the first parameter back into a scratch buffer equals the new bytes.
  6. A write that ends 1 byte past a registered buffer must fail (the peer's TCP server rejects the address).
  --exit-peer: POST /wsync_test/exit at the end.

--writer raw replaces the second TransferEngine in steps 3, 5 and 6 by a plain-socket client written only from
docs/mooncake-protocol.md (Metadata handshake with a minimal "{}" request, then one v2 tcp request per transfer):
proof that the documented facts suffice to write into the real engine, and a Python sketch of wsync's transport.

  PY=$(tools/testing/engines/install_mooncake.sh | tail -n1)
  $PY tests/engines/mooncake_writer_check.py --bootstrap 127.0.0.1:PORT --rank 0 --exit-peer
"""
import argparse
import ctypes
import hashlib
import json
import mmap
import os
import socket
import struct
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mooncake_peer import initial_bytes, pattern_bytes  # noqa: E402  the seeds are the contract, not the peer


def http_json(url, method="GET", timeout=10):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


class RawWriter:
    """The documented protocol, nothing else: P2P Metadata handshake + Mooncake tcp transport v2 requests."""

    MAGIC = 0x4D435456

    def __init__(self, session_id):
        host, port = session_id.rsplit(":", 1)
        self.host = host.strip("[]")
        with socket.create_connection((self.host, int(port)), timeout=10) as s:
            body = b"\x01" + b"{}"  # type 1 = Metadata; the server ignores the requester's descriptor
            s.sendall(struct.pack("<Q", len(body)) + body)
            length = struct.unpack("<Q", self._read(s, 8))[0]
            frame = self._read(s, length)
        if frame[0] != 1:
            raise RuntimeError(f"handshake reply type {frame[0]}, want 1 (Metadata)")
        self.desc = json.loads(frame[1:])
        if self.desc.get("protocol") != "tcp" or int(self.desc.get("tcp_proto_version", 1)) < 2:
            raise RuntimeError(f"peer segment is not tcp v2: {self.desc}")
        self.data_port = int(self.desc["tcp_data_port"])

    @staticmethod
    def _read(s, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def _request(self, opcode, addr, payload=b"", size=None):
        size = len(payload) if size is None else size
        with socket.create_connection((self.host, self.data_port), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(struct.pack("<QQB7x", size, addr, 0x80 | opcode) + payload)  # 24-byte header, v2 flag
            try:
                frame = struct.unpack("<Q", self._read(s, 8))[0]
            except ConnectionError:
                return -1, b""
            if frame >> 32 != self.MAGIC or frame & 0xFFFFFFFF:
                return -(frame & 0xFFFFFFFF or 1), b""
            return 0, (self._read(s, size) if opcode == 0 else b"")

    def write(self, addr, data):
        return self._request(1, addr, data)[0]

    def read(self, addr, size):
        return self._request(0, addr, size=size)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True, help="HOST:PORT of the peer's bootstrap server")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--local-ip", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device", default="")
    ap.add_argument("--step", default="1", help="seed of the new bytes (new/<step>/<name>)")
    ap.add_argument("--skip", action="append", default=[], help="parameter to leave unwritten (repeatable)")
    ap.add_argument("--exit-peer", action="store_true")
    ap.add_argument("--writer", choices=["mooncake", "raw"], default="mooncake",
                    help="mooncake: a second real TransferEngine; raw: plain sockets, from the documented protocol")
    args = ap.parse_args()
    base = f"http://{args.bootstrap}"
    failures = []

    def check(ok, what):
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    # 1. Bootstrap.
    code, body = http_json(f"{base}/get_transfer_engine_info?rank={args.rank}")
    if code != 200:
        raise SystemExit(f"GET /get_transfer_engine_info?rank={args.rank}: HTTP {code} {body}")
    check(body.get("rank") == args.rank and len(body["remote_instance_transfer_engine_info"]) == 2,
          f"bootstrap rank {args.rank}: shape {{rank, remote_instance_transfer_engine_info: [session, table]}}")
    session_id, table = body["remote_instance_transfer_engine_info"]
    params = [(name, int(v[0]), int(v[1]) * int(v[2])) for name, v in table.items()]  # (name, ptr, bytes)
    code404, _ = http_json(f"{base}/get_transfer_engine_info?rank={args.rank + 1000}")
    check(code404 == 404, f"bootstrap unknown rank {args.rank + 1000} -> {code404} (want 404)")
    print(f"     session {session_id}, {len(params)} params, {sum(p[2] for p in params)} bytes", flush=True)

    # 2. The peer starts with its initial bytes.
    _, cs = http_json(f"{base}/wsync_test/checksums")
    want0 = {n: hashlib.sha256(initial_bytes(args.rank, n, nb)).hexdigest() for n, _, nb in params}
    check(cs["checksums"] == want0, "peer holds its initial bytes before any write")

    new = {n: pattern_bytes(f"new/{args.step}/{n}", nb) for n, _, nb in params}
    if args.writer == "raw":
        return raw_steps(args, base, session_id, params, new, check, failures)

    # 3. Write.
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    rc = engine.initialize(args.local_ip, "P2PHANDSHAKE", args.protocol, args.device)
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize = {rc}")
    total = sum(nb for _, _, nb in params)
    src = mmap.mmap(-1, total + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    src_base = ctypes.addressof(ctypes.c_char.from_buffer(src))
    src_off = {}
    off = 0
    for n, _, nb in params:
        src[off:off + nb] = new[n]
        src_off[n] = off
        off += nb
    scratch = total  # 4 KiB scratch after the payload, for the read-back
    check(engine.register_memory(src_base, total + 4096) == 0, "writer register_memory(source buffer)")

    t0 = time.monotonic()
    written = [p for p in params if p[0] not in args.skip]
    for n, ptr, nb in written[:-1]:
        rc = engine.transfer_sync_write(session_id, src_base + src_off[n], ptr, nb)
        check(rc == 0, f"transfer_sync_write {n} ({nb} B -> 0x{ptr:x}) = {rc}")
    if written:
        n, ptr, nb = written[-1]
        rc = engine.batch_transfer_sync_write(session_id, [src_base + src_off[n]], [ptr], [nb])
        check(rc == 0, f"batch_transfer_sync_write {n} ({nb} B -> 0x{ptr:x}) = {rc}")
    dt = time.monotonic() - t0
    print(f"     wrote {sum(p[2] for p in written)} bytes in {len(written)} transfers, {dt * 1e3:.1f} ms", flush=True)

    # 4. Checksums.
    verify_checksums(args, base, params, new, check)

    # 5. Read back the first parameter (at most 4 KiB of it).
    n, ptr, nb = params[0]
    k = min(nb, 4096)
    rc = engine.transfer_sync_read(session_id, src_base + scratch, ptr, k)
    want = (new[n] if n not in args.skip else initial_bytes(args.rank, n, nb))[:k]
    check(rc == 0 and src[scratch:scratch + k] == want, f"transfer_sync_read {n} ({k} B) = {rc}, bytes match")

    # 6. Out of bounds: the last byte lies past the end of every registered buffer of the peer.
    #    The peer's regions end at a 512-byte boundary after their last parameter; write up to that end + 1.
    n, ptr, nb = max(params, key=lambda p: p[1])
    end = (ptr + nb + 511) // 512 * 512
    rc = engine.transfer_sync_write(session_id, src_base, end - 16, 17)
    check(rc != 0, f"write of 17 B at 0x{end - 16:x} (1 B past a registered buffer) fails: rc = {rc}")

    engine.unregister_memory(src_base)
    if args.exit_peer:
        http_json(f"{base}/wsync_test/exit", method="POST")
    print(f"mooncake writer check: {'PASS' if not failures else 'FAIL (' + str(len(failures)) + ')'}", flush=True)
    sys.stdout.flush()
    os._exit(0 if not failures else 1)


def verify_checksums(args, base, params, new, check):
    _, cs = http_json(f"{base}/wsync_test/checksums")
    got = cs["checksums"]
    for n, _, nb in params:
        want = hashlib.sha256(new[n] if n not in args.skip else initial_bytes(args.rank, n, nb)).hexdigest()
        check(got.get(n) == want, f"checksum {n} = {'new' if n not in args.skip else 'initial'} bytes")


def raw_steps(args, base, session_id, params, new, check, failures):
    w = RawWriter(session_id)
    check(True, f"raw handshake: tcp_data_port {w.data_port}, {len(w.desc['buffers'])} buffers")
    for n, ptr, nb in params:
        inside = any(b["addr"] <= ptr and ptr + nb <= b["addr"] + b["length"] for b in w.desc["buffers"])
        check(inside, f"{n} lies inside one advertised buffer")
    t0 = time.monotonic()
    written = [p for p in params if p[0] not in args.skip]
    for n, ptr, nb in written:
        rc = w.write(ptr, new[n])
        check(rc == 0, f"raw write {n} ({nb} B -> 0x{ptr:x}) = {rc}")
    print(f"     wrote {sum(p[2] for p in written)} bytes in {len(written)} requests,"
          f" {(time.monotonic() - t0) * 1e3:.1f} ms", flush=True)
    verify_checksums(args, base, params, new, check)
    n, ptr, nb = params[0]
    k = min(nb, 4096)
    rc, data = w.read(ptr, k)
    want = (new[n] if n not in args.skip else initial_bytes(args.rank, n, nb))[:k]
    check(rc == 0 and data == want, f"raw read {n} ({k} B) = {rc}, bytes match")
    b = max(w.desc["buffers"], key=lambda b: b["addr"])
    end = b["addr"] + b["length"]
    rc = w.write(end - 16, b"x" * 17)
    check(rc == -1, f"raw write of 17 B at 0x{end - 16:x} (1 B past the last buffer) rejected with code 1: rc = {rc}")
    if args.exit_peer:
        http_json(f"{base}/wsync_test/exit", method="POST")
    print(f"mooncake writer check (raw): {'PASS' if not failures else 'FAIL (' + str(len(failures)) + ')'}",
          flush=True)
    os._exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
