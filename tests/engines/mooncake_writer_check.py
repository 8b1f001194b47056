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

  PY=$(tools/engines/install_mooncake.sh | tail -n1)
  $PY tests/engines/mooncake_writer_check.py --bootstrap 127.0.0.1:PORT --rank 0 --exit-peer
"""
import argparse
import ctypes
import hashlib
import json
import mmap
import os
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

    # 3. Write.
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    rc = engine.initialize(args.local_ip, "P2PHANDSHAKE", args.protocol, args.device)
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize = {rc}")
    new = {n: pattern_bytes(f"new/{args.step}/{n}", nb) for n, _, nb in params}
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
    _, cs = http_json(f"{base}/wsync_test/checksums")
    got = cs["checksums"]
    for n, _, nb in params:
        want = hashlib.sha256(new[n] if n not in args.skip else initial_bytes(args.rank, n, nb)).hexdigest()
        check(got.get(n) == want, f"checksum {n} = {'new' if n not in args.skip else 'initial'} bytes")

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


if __name__ == "__main__":
    main()
