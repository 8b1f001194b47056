"""A small Python stand-in for the target wsyncd's side of the engine attach protocol (docs/engines.md): listens on
a Unix socket, accepts attaches (checking the token), maps the handed-over segments and can send commits."""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Attachment:
    conn: socket.socket
    msg: dict[str, Any]
    maps: list[mmap.mmap] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return int(self.msg["rank"])


def _recv_exact(conn: socket.socket, n: int, buf: bytearray) -> None:
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk


def read_frame_with_fds(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 200)
    if not data:
        raise ConnectionError("peer closed")
    buf = bytearray(data)
    _recv_exact(conn, 4, buf)
    (length,) = struct.unpack("<I", bytes(buf[:4]))
    _recv_exact(conn, 4 + length, buf)
    return json.loads(bytes(buf[4:4 + length])), list(fds)


def send_frame(conn: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    conn.sendall(struct.pack("<I", len(body)) + body)


class FakeTarget:
    def __init__(self, path: str, token: str, expect_ranks: int = 1) -> None:
        self.path = path
        self.token = token
        self.expect_ranks = expect_ranks
        self.attachments: dict[int, Attachment] = {}
        self.errors: list[str] = []
        self._cv = threading.Condition()
        if os.path.exists(path):
            os.unlink(path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(16)
        self._stop = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            try:
                self._handle(conn)
            except Exception as e:  # noqa: BLE001 - recorded for the test
                with self._cv:
                    self.errors.append(f"attach failed: {e!r}")
                    self._cv.notify_all()
                conn.close()

    def _handle(self, conn: socket.socket) -> None:
        msg, fds = read_frame_with_fds(conn)
        problems = []
        if msg.get("type") != "attach":
            problems.append(f"type {msg.get('type')!r}")
        if msg.get("token") != self.token:
            problems.append("bad token")
        if msg.get("protocol") != 1:
            problems.append(f"protocol {msg.get('protocol')!r}")
        if len(fds) != len(msg.get("segments", [])):
            problems.append(f"{len(fds)} fds for {len(msg.get('segments', []))} segments")
        if problems:
            send_frame(conn, {"type": "attached", "ok": False, "error": "; ".join(problems)})
            for fd in fds:
                os.close(fd)
            conn.close()
            raise RuntimeError("; ".join(problems))
        att = Attachment(conn, msg)
        for seg, fd in zip(msg["segments"], fds):
            att.maps.append(mmap.mmap(fd, seg["bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            os.close(fd)
        for p in msg["params"]:
            seg = msg["segments"][p["segment"]]
            if p["offset"] < 0 or p["offset"] + p["bytes"] > seg["bytes"]:
                raise RuntimeError(f"param {p['name']} outside its segment")
        send_frame(conn, {"type": "attached", "ok": True})
        with self._cv:
            self.attachments[att.rank] = att
            self._cv.notify_all()

    def wait_attached(self, timeout: float) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: len(self.attachments) >= self.expect_ranks or self.errors, timeout)
        if self.errors:
            raise RuntimeError("; ".join(self.errors))
        if not ok:
            raise TimeoutError(f"only {len(self.attachments)} of {self.expect_ranks} ranks attached")

    def commit(self, version: str) -> None:
        for att in self.attachments.values():
            send_frame(att.conn, {"type": "commit", "version": version})

    def close(self) -> None:
        self._stop = True
        self._srv.close()
        for att in self.attachments.values():
            att.conn.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
