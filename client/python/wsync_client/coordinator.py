"""Coordinator: the update driver's client of the coordinator API, over grpcio."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import time
from typing import Any, Dict, Iterator, List, Optional

import grpc
from google.protobuf import json_format

from ._proto.wsync.v1 import coordinator_pb2, coordinator_pb2_grpc
from .errors import DEADLINE_EXCEEDED, INVALID_ARGUMENT, UNAVAILABLE, WsyncError, from_rpc_error

# Worst cases of the coordinator's own waits (client/coordinator_client.h): a call's deadline covers them.
_COMMIT_OVERHEAD_S = 30 + 300 + 30 + 30 + 2 * 120 + 120 + 60  # staged: verify, pause, switch
_BEGIN_WORST_CASE_S = 120 + 30 + 600 + 30
_MARGIN_S = 30

# proto3 JSON writes 64-bit integers as strings; these fields come back as Python ints.
_INT64_FIELDS = {"version", "plan_epoch", "membership_epoch", "bytes", "params", "started_unix_ms", "bytes_written",
                 "current_version", "open_version", "failed_version", "dense_bytes", "sent_bytes"}


def _ints(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: (int(v) if k in _INT64_FIELDS and isinstance(v, str) and v.lstrip("-").isdigit() else _ints(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ints(v) for v in obj]
    return obj


def _to_dict(msg) -> Dict[str, Any]:
    try:  # protobuf >= 5.26
        d = json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    except TypeError:  # older protobuf
        d = json_format.MessageToDict(msg, preserving_proto_field_name=True, including_default_value_fields=True)
    return _ints(d)


_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
_FAILOVER_S = 20.0  # with several coordinators: how long a call looks for the leader


def _is_loopback(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    if host in ("localhost", "") or endpoint.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _credentials() -> Optional[grpc.ChannelCredentials]:
    """mTLS from WSYNC_TLS_CA/CERT/KEY (docs/security.md), as the C++ clients; None without any of them."""
    paths = [os.environ.get(k, "") for k in ("WSYNC_TLS_CA", "WSYNC_TLS_CERT", "WSYNC_TLS_KEY")]
    if not any(paths):
        return None
    if not all(paths):
        raise WsyncError(INVALID_ARGUMENT, "WSYNC_TLS_CA, WSYNC_TLS_CERT and WSYNC_TLS_KEY must be set together")
    blobs = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                blobs.append(f.read())
        except OSError as e:
            raise WsyncError(INVALID_ARGUMENT, "cannot read TLS file %s: %s" % (p, e)) from None
    return grpc.ssl_channel_credentials(root_certificates=blobs[0], private_key=blobs[2], certificate_chain=blobs[1])


class Coordinator:
    """Client of the coordinator API: drives updates and reads cluster status and history.

    `endpoint` is host:port, or several ("a:1,b:2" or a list) for coordinators in high availability: a call that
    meets a standby ("not the leader ...; current leader: X") or a dead one moves on to the leader, for up to 20 s.
    Left out (None), it is the WSYNC_COORDINATOR environment variable, as for wsyncctl and the deploy files.
    `dial_timeout` bounds connecting: every call fails after it when the coordinator is not reachable (a call that
    reaches it waits as long as the coordinator needs, e.g. for every source to finish). With WSYNC_TLS_CA/CERT/KEY
    set the channel is mTLS with that certificate; without them only loopback coordinators may be dialled.
    """

    def __init__(self, endpoint=None, dial_timeout: float = 5.0):
        if endpoint is None:
            endpoint = os.environ.get("WSYNC_COORDINATOR", "")
        eps = endpoint if isinstance(endpoint, (list, tuple)) else str(endpoint).split(",")
        self.endpoints = [e.strip() for e in eps if e.strip()]
        if not self.endpoints:
            raise WsyncError(INVALID_ARGUMENT, "no coordinator endpoint given: pass Coordinator(\"host:port\") or set "
                             "WSYNC_COORDINATOR")
        self.endpoint = ",".join(self.endpoints)
        self.dial_timeout = float(dial_timeout)
        self.last_record: Optional[Dict[str, Any]] = None
        self.last_abort: Optional[Dict[str, Any]] = None
        creds = _credentials()
        if creds is None:
            for e in self.endpoints:
                if not _is_loopback(e):
                    raise WsyncError(INVALID_ARGUMENT,
                                     "coordinator %s is not loopback: without TLS (WSYNC_TLS_CA/CERT/KEY) wsync dials "
                                     "loopback addresses only (docs/security.md)" % e)
        self._channels = [grpc.secure_channel(e, creds, options=_OPTIONS) if creds is not None
                          else grpc.insecure_channel(e, options=_OPTIONS) for e in self.endpoints]
        self._stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self._channels]
        self._connected = [False] * len(self.endpoints)
        self._current = 0
        self._channel = self._channels[0]  # closed marker

    def close(self) -> None:
        if self._channel is not None:
            for c in self._channels:
                c.close()
            self._channel = None

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _call_one(self, i: int, method: str, request, timeout: float, what: str):
        if not self._connected[i]:
            ready = grpc.channel_ready_future(self._channels[i])
            try:
                ready.result(timeout=self.dial_timeout)
            except grpc.FutureTimeoutError:
                raise WsyncError(UNAVAILABLE, "%s: coordinator %s not reachable within the dial timeout of %gs"
                                 % (what, self.endpoints[i], self.dial_timeout)) from None
            finally:
                ready.cancel()
            self._connected[i] = True  # later calls fail at once (UNAVAILABLE) if it goes away
        try:
            return getattr(self._stubs[i], method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, what) from None

    def _call(self, method: str, request, timeout: float, what: str):
        if self._channel is None:
            raise WsyncError(UNAVAILABLE, "coordinator client is closed")
        n = len(self.endpoints)
        give_up = time.monotonic() + _FAILOVER_S
        backoff = 0.1
        attempt = 0
        while True:
            i = self._current
            try:
                return self._call_one(i, method, request, timeout, what)
            except WsyncError as e:
                if n == 1 or e.code != UNAVAILABLE:
                    raise
                nxt = (i + 1) % n
                msg = str(e)
                tag = "current leader: "
                if tag in msg:
                    hint = msg.split(tag, 1)[1].split()[0].rstrip(";,)")
                    if hint in self.endpoints and self.endpoints.index(hint) != i:
                        nxt = self.endpoints.index(hint)
                self._current = nxt
                attempt += 1
                if attempt % n == 0:  # every coordinator asked once: wait for an election
                    if time.monotonic() + backoff > give_up:
                        raise WsyncError(UNAVAILABLE, "%s: no coordinator of %s answered as the leader within %gs; "
                                         "last: %s" % (what, self.endpoint, _FAILOVER_S, msg)) from None
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)

    def begin_update(self, version: int, pause_mode: str = "", mode: str = "", delta: str = "") -> Dict[str, Any]:
        """Pauses every engine and opens update `version`; returns the reply (plan_epoch, pause_seconds, ...).
        mode "staged": the engines serve on while the update is staged and switch together at the commit
        (docs/operations.md, "Staged updates"); "" or "classic": paused for the whole update.
        delta (docs/delta.md): "auto" (or "", the default) sends each engine rank only what changed since the version
        it holds, dense where it holds none; "off" writes every rank dense; "always" fails the update when a rank
        cannot take deltas. Another value raises WsyncError INVALID_ARGUMENT (the coordinator refuses it). The
        committed record says per update dense_bytes, sent_bytes, delta_ranks and the fallbacks with their reason."""
        rep = self._call("BeginUpdate", coordinator_pb2.BeginUpdateRequest(version=int(version),
                                                                           pause_mode=pause_mode or "",
                                                                           mode=mode or "", delta=delta or ""),
                         self.dial_timeout + _BEGIN_WORST_CASE_S + _MARGIN_S, "begin update %d" % int(version))
        return _to_dict(rep)

    def commit_update(self, version: int, timeout: float = 120.0) -> Dict[str, Any]:
        """Waits for every source, post-processes and resumes the engines; returns the update record as a dict.
        A failed update raises WsyncError with code ABORTED (10): the engines stay paused at their old version
        until an update succeeds; history() then shows its record with success False."""
        t = float(timeout) if timeout and timeout > 0 else 120.0
        rep = self._call("CommitUpdate", coordinator_pb2.CommitUpdateRequest(version=int(version), timeout_seconds=t),
                         self.dial_timeout + t + _COMMIT_OVERHEAD_S + _MARGIN_S, "commit update %d" % int(version))
        self.last_record = _to_dict(rep.record)
        return self.last_record

    @contextlib.contextmanager
    def update(self, version: int, pause_mode: str = "", timeout: float = 120.0,
               mode: str = "", delta: str = "") -> Iterator[Dict[str, Any]]:
        """Opens update `version`, runs the body (the trainer ranks push), then commits it; when the body raises, the
        update is aborted and the exception propagates. The history records who aborted it ("client exception:
        ValueError: ..."); when the abort reply says the engines are resumable (no byte of this update, nor of an
        earlier failed one, reached them) they are resumed at their old version, else they stay paused until an
        update succeeds. Yields the BeginUpdate reply; the committed record is in `last_record`
        afterwards, the abort's reply (with `engines_resumed`) in `last_abort`.

            with coordinator.update(7):
                ... every rank pushes version 7 ...
        """
        reply = self.begin_update(version, pause_mode, mode, delta)
        try:
            yield reply
        except BaseException as exc:
            try:
                self.last_abort = self.abort_update(version, aborted_by="client exception: %s: %s" %
                                                    (type(exc).__name__, exc))
                self.last_abort["engines_resumed"] = False
                if self.last_abort.get("engines_resumable"):
                    # Nothing of it was written: the engines' weights are the old version's, so they serve again.
                    self.resume_engines()
                    self.last_abort["engines_resumed"] = True
            except WsyncError as abort_err:  # keep the body's exception; say why the abort or resume failed too
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note("aborting update %d (or resuming its engines) failed as well: %s" %
                                 (int(version), abort_err))
            raise
        self.commit_update(version, timeout)

    def abort_update(self, version: int, reason: str = "", aborted_by: str = "") -> Dict[str, Any]:
        """Closes the open update `version` without committing it: sources stop taking its pushes and finish the
        writes in flight; it is recorded as aborted by `aborted_by` (empty: "the operator"). The engines stay paused
        at their old version. Returns a dict with the record, bytes_written (bytes of it that reached the engines)
        and engines_resumable."""
        req = coordinator_pb2.AbortUpdateRequest(version=int(version), reason=str(reason), aborted_by=str(aborted_by))
        rep = self._call("AbortUpdate", req,
                         self.dial_timeout + _COMMIT_OVERHEAD_S + _MARGIN_S, "abort update %d" % int(version))
        return _to_dict(rep)

    def resume_engines(self) -> Dict[str, Any]:
        """Resumes paused engines at their current version; raises WsyncError (FAILED_PRECONDITION) while they may
        hold partial writes of a failed or aborted update."""
        rep = self._call("ResumeEngines", coordinator_pb2.ResumeEnginesRequest(),
                         self.dial_timeout + _COMMIT_OVERHEAD_S + _MARGIN_S, "resume engines")
        return _to_dict(rep)

    def status(self) -> Dict[str, Any]:
        """Cluster status: nodes, epochs, current version, state, plan."""
        rep = self._call("GetClusterStatus", coordinator_pb2.ClusterStatusRequest(), self.dial_timeout + _MARGIN_S,
                         "cluster status")
        return _to_dict(rep)

    def history(self, limit: int = 0) -> List[Dict[str, Any]]:
        """The most recent `limit` update records (0: all the coordinator keeps), oldest first."""
        rep = self._call("GetHistory", coordinator_pb2.HistoryRequest(limit=int(limit)),
                         self.dial_timeout + _MARGIN_S, "history")
        return _to_dict(rep).get("records", [])
