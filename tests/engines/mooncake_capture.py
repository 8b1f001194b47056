#!/usr/bin/env python3
"""Decodes Mooncake Transfer Engine traffic (P2P handshake and tcp transport) from a loopback pcap.

Used to confirm docs/mooncake-protocol.md against the real engine, and to compare wsync's `mooncake` transport
with it: capture both, decode both, diff. Plain Python 3, no dependencies (classic pcap, Linux loopback or
Ethernet link types, IPv4/IPv6, TCP). Streams are reassembled per direction in capture order (loopback: no loss).

  tcpdump -i lo -s 0 -U -w cap.pcap 'tcp portrange 15000-17000'   # Mooncake's default port range
  python3 tests/engines/mooncake_capture.py cap.pcap --handshake-port 15452 [--hex 64]

Each connection to --handshake-port is decoded as handshake frames: u64 little-endian length (includes the type
byte), u8 type (0 Connection, 1 Metadata, 2 Notify, 3 Probe), JSON. Every other connection is decoded as tcp
transport requests: 24-byte header {u64 LE size, u64 LE addr, u8 opcode (bit 7: v2 framing; 0 READ, 1 WRITE),
7 bytes padding}, then the payload (WRITE: initiator -> server; READ: server -> initiator), and in v2 an 8-byte LE
status frame (high 32 bits "MCTV" = 0x4D435456, low 32 bits 0 ok / 1 address rejected).
"""
import argparse
import json
import struct
import sys
from collections import OrderedDict

TYPES = {0: "Connection", 1: "Metadata", 2: "Notify", 3: "Probe"}
MAGIC = 0x4D435456


def packets(path):
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic in (0xA1B2C3D4, 0xA1B23C4D):
        e = "<"
    elif magic in (0xD4C3B2A1, 0x4D3CB2A1):
        e = ">"
    else:
        raise SystemExit(f"{path}: not a classic pcap file (pcapng is not supported; tcpdump -w writes pcap)")
    linktype = struct.unpack_from(e + "I", data, 20)[0]
    off = 24
    while off + 16 <= len(data):
        _, _, incl, _ = struct.unpack_from(e + "IIII", data, off)
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        if linktype == 1:  # Ethernet (Linux lo)
            ethertype = struct.unpack_from(">H", pkt, 12)[0]
            ip = pkt[14:]
        elif linktype == 113:  # Linux cooked
            ethertype = struct.unpack_from(">H", pkt, 14)[0]
            ip = pkt[16:]
        else:
            raise SystemExit(f"unsupported link type {linktype}")
        if ethertype == 0x0800 and ip[9] == 6:
            ihl = (ip[0] & 15) * 4
            total = struct.unpack_from(">H", ip, 2)[0]
            src, dst = ".".join(map(str, ip[12:16])), ".".join(map(str, ip[16:20]))
            tcp, ip_end = ip[ihl:total], total - ihl
        elif ethertype == 0x86DD and ip[6] == 6:
            plen = struct.unpack_from(">H", ip, 4)[0]
            src, dst = ip[8:24].hex(), ip[24:40].hex()
            tcp, ip_end = ip[40:40 + plen], plen
        else:
            continue
        sport, dport, seq = struct.unpack_from(">HHI", tcp, 0)
        doff = (tcp[12] >> 4) * 4
        flags = tcp[13]
        yield (src, sport), (dst, dport), seq, flags, tcp[doff:ip_end]


def streams(path):
    """OrderedDict: connection (client, server) -> {"c2s": bytes, "s2c": bytes}; client = the SYN sender."""
    conns = OrderedDict()
    for a, b, seq, flags, payload in packets(path):
        syn, ack = flags & 0x02, flags & 0x10
        if syn and not ack:
            conns[(a, b)] = {"c2s": bytearray(), "s2c": bytearray(), "next": {}}
            continue
        if (a, b) in conns:
            key, d = (a, b), "c2s"
        elif (b, a) in conns:
            key, d = (b, a), "s2c"
        else:
            continue  # connection opened before the capture
        c = conns[key]
        if syn:
            c["next"][d] = seq + 1
            continue
        if d == "c2s" and d not in c["next"]:
            c["next"][d] = seq
        if not payload:
            continue
        exp = c["next"].get(d, seq)
        if seq < exp:  # retransmission (not expected on loopback)
            payload = payload[exp - seq:]
        c[d] += payload
        c["next"][d] = max(exp, seq + len(payload))
    return conns


def hexdump(b, limit, indent="      "):
    out = []
    for i in range(0, min(len(b), limit), 16):
        chunk = b[i:i + 16]
        out.append(f"{indent}{i:04x}  {chunk.hex(' '):<47}  {''.join(chr(c) if 32 <= c < 127 else '.' for c in chunk)}")
    if len(b) > limit:
        out.append(f"{indent}... ({len(b)} bytes)")
    return "\n".join(out)


def decode_handshake(buf, limit, who):
    off, out = 0, []
    while off + 8 <= len(buf):
        (length,) = struct.unpack_from("<Q", buf, off)
        body = bytes(buf[off + 8:off + 8 + length])
        out.append(f"  {who}: frame length {length} (u64 LE), type {body[0]} ({TYPES.get(body[0], 'old protocol?')})")
        out.append(hexdump(bytes(buf[off:off + 8 + length]), limit))
        try:
            out.append("      JSON: " + json.dumps(json.loads(body[1:]), sort_keys=False))
        except ValueError as e:
            out.append(f"      (not JSON: {e})")
        off += 8 + length
    if off != len(buf):
        out.append(f"  {who}: {len(buf) - off} trailing bytes")
    return out


def decode_data(c2s, s2c, limit):
    out, coff, soff = [], 0, 0
    while coff + 24 <= len(c2s):
        size, addr, op = struct.unpack_from("<QQB", c2s, coff)
        pad = bytes(c2s[coff + 17:coff + 24])
        v2, opcode = bool(op & 0x80), op & 0x7F
        kind = {0: "READ", 1: "WRITE"}.get(opcode, f"op{opcode}")
        out.append(f"  request: size {size}, addr 0x{addr:x}, opcode 0x{op:02x} = {kind}{' v2' if v2 else ''},"
                   f" padding {pad.hex()}")
        out.append(hexdump(bytes(c2s[coff:coff + 24]), limit))
        coff += 24

        def status():
            nonlocal soff
            if soff + 8 > len(s2c):
                out.append("  status: none (connection closed)")
                return None
            (frame,) = struct.unpack_from("<Q", s2c, soff)
            out.append(f"  status frame: 0x{frame:016x} (magic {'ok' if frame >> 32 == MAGIC else 'BAD'},"
                       f" code {frame & 0xFFFFFFFF})")
            out.append(hexdump(bytes(s2c[soff:soff + 8]), limit))
            soff += 8
            return frame & 0xFFFFFFFF

        if kind == "WRITE":
            body = bytes(c2s[coff:coff + size])
            out.append(f"  payload initiator->server: {len(body)} of {size} bytes")
            coff += len(body)
            if v2:
                status()
        else:
            code = status() if v2 else 0
            if code == 0:
                body = bytes(s2c[soff:soff + size])
                out.append(f"  payload server->initiator: {len(body)} of {size} bytes")
                soff += len(body)
    if coff != len(c2s) or soff != len(s2c):
        out.append(f"  left over: {len(c2s) - coff} bytes initiator->server, {len(s2c) - soff} server->initiator")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pcap")
    ap.add_argument("--handshake-port", type=int, action="append", default=[],
                    help="server port(s) that carry the P2P handshake (the rpc port in the session id)")
    ap.add_argument("--hex", type=int, default=64, help="bytes of hex shown per frame/header")
    args = ap.parse_args()
    for (cli, srv), c in streams(args.pcap).items():
        hs = srv[1] in args.handshake_port
        print(f"connection {cli[0]}:{cli[1]} -> {srv[0]}:{srv[1]} ({'handshake' if hs else 'tcp transport'}),"
              f" {len(c['c2s'])} bytes ->, {len(c['s2c'])} bytes <-")
        if hs:
            lines = decode_handshake(c["c2s"], args.hex, "request") + decode_handshake(c["s2c"], args.hex, "reply")
        else:
            lines = decode_data(c["c2s"], c["s2c"], args.hex)
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
