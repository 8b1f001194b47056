"""The wsync attach protocol, version 1 (docs/engines.md): length-prefixed JSON frames on a Unix stream socket,
file descriptors riding (SCM_RIGHTS) on the sendmsg that carries a frame's first byte."""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

PROTOCOL_VERSION = 1
MAX_FDS_PER_FRAME = 200
MAX_FRAME_BYTES = 1 << 30


class ProtocolError(RuntimeError):
    pass


def send_frame(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    data = struct.pack("<I", len(body)) + body
    if len(fds) > MAX_FDS_PER_FRAME:
        raise ProtocolError(f"{len(fds)} file descriptors in one frame (at most {MAX_FDS_PER_FRAME})")
    sent = 0
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        if sent <= 0:
            raise ProtocolError("sendmsg with file descriptors sent nothing")
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out waiting for a frame from the wsync target")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout as e:
            raise TimeoutError("timed out waiting for a frame from the wsync target") from e
        if not chunk:
            raise ProtocolError("the wsync target closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, timeout_s: float | None) -> dict[str, Any]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    (length,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes is too large")
    msg = json.loads(_recv_exact(sock, length, deadline).decode("utf-8"))
    if not isinstance(msg, dict) or "type" not in msg:
        raise ProtocolError(f"malformed frame from the wsync target: {msg!r:.200}")
    return msg
