#!/usr/bin/env python3
"""SGLang 0.5.23's own code as the Mooncake peer of a wsync update (issue 9, item 3a).

Runs in the pinned SGLang venv (tests/replica/sglang_venv.sh) with the pinned Mooncake venv's site-packages added
(--mooncake-site). Per TP rank, in this one process:
  * the model is SGLang's own class built on the CPU and loaded by SGLang's own loader (tests/replica/sglang_oracle.py
    build_and_load, under a published ServerArgs that also carries
    --remote-instance-weight-loader-start-seed-via-transfer-engine and --engine-info-bootstrap-port);
  * its parameters are re-homed into a few "allocator segments" (host buffers; see Arena) so that SGLang's own
    merging of adjacent weight blocks has something to merge;
  * SGLang's own RemoteInstanceWeightTransporter creates the real Mooncake TransferEngine (P2PHANDSHAKE, protocol
    from MOONCAKE_PROTOCOL, as SGLang reads it), runs SGLang's register_memory_region (v2: merged blocks from the
    allocator's memory snapshot, which on the CPU is answered by the Arena) and PUTs
    [session_id, {name: [ptr, numel, element_size]}] to SGLang's own EngineInfoBootstrapServer;
  * the control plane is SGLang's own FastAPI app (sglang.srt.entrypoints.http_server.app): its routes, its request
    validation (the io_struct request classes, through FastAPI exactly as the real server does) and its response
    texts. Only the tokenizer manager behind the routes is a recorder (this file's Manager): it logs every call,
    keeps the pause / weight-update-session / version state with SGLang's messages, and snapshots sha256 checksums of
    every parameter at pause, at end_weight_update and when a version is set.

  PY sglang_native_peer.py --config DIR/config.json --tp 2 --mooncake-site SITE [--die-on PATH] [--missing-rank R]
Prints one JSON line when ready: {"ready": true, "http": "H:P", "bootstrap": "H:B", "sessions": [...],
"registered": {rank: [[addr, length], ...]}}.
Test-only routes on the HTTP port: GET /wsync_test/log -> {"calls": [...], "rejected": [...], "snapshots": {...}},
POST /wsync_test/exit. "rejected" lists the requests SGLang's own validation refused (SGLang answers 400).
"""
import argparse
import asyncio
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import threading
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "replica"))

# SGLang's HTTP server module imports its audio endpoints' decoder (soundfile, a native library binding) at import
# time; the control routes never use it. When it is absent it is replaced by an inert module.
_INERT = {"soundfile"}


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _INERT:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        from unittest.mock import MagicMock
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda attr: MagicMock(name=f"{spec.name}.{attr}")
        return m

    def exec_module(self, module):
        pass


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Arena:
    """Stand-in for the CUDA caching allocator on the CPU: a few large host buffers ("segments"), each parameter a
    512-byte-rounded block inside one of them, optionally a free ("inactive") block between two parameters.
    snapshot() answers torch.cuda.memory.memory_snapshot() in the allocator's format (segments with blocks of
    address, size and state), which is what SGLang's register_memory_region_v2 reads to merge adjacent blocks."""

    ALIGN = 512

    def __init__(self, model, segments=2, gap_after=()):
        import torch
        params = list(model.named_parameters())
        per = -(-len(params) // segments)
        self.buffers, self.segments = [], []
        for s in range(segments):
            group = params[s * per:(s + 1) * per]
            sizes = [-(-p.numel() * p.element_size() // self.ALIGN) * self.ALIGN for _, p in group]
            total = sum(sizes) + self.ALIGN * sum(1 for n, _ in group if n in gap_after)
            buf = torch.zeros(total + self.ALIGN, dtype=torch.uint8)
            base = buf.data_ptr()
            skew = (-base) % self.ALIGN
            off, blocks = skew, []
            for (name, p), size in zip(group, sizes):
                nbytes = p.numel() * p.element_size()
                view = buf[off:off + nbytes].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
                blocks.append({"address": base + off, "size": size, "state": "active_allocated"})
                off += size
                if name in gap_after:
                    blocks.append({"address": base + off, "size": self.ALIGN, "state": "inactive"})
                    off += self.ALIGN
            self.buffers.append(buf)
            self.segments.append({"address": base + skew, "total_size": off - skew, "blocks": blocks})

    def snapshot(self):
        return [dict(s) for s in self.segments]


class Rank:
    def __init__(self, rank, model, arena, transporter):
        self.rank, self.model, self.arena, self.transporter = rank, model, arena, transporter
        self.draft = None  # (model, arena, transporter) of the rank's NextN draft runner

    def checksums(self):
        out = {}
        for name, p in self.model.named_parameters():
            t = p.detach().contiguous().reshape(-1).view(__import__("torch").uint8)
            out[name] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
        return out


def register(model, transporter, segments):
    """SGLang's own registration of one model runner's weights: its transporter's TransferEngine, then
    register_memory_region (v2) against the allocator snapshot `segments` (the whole process's, as
    torch.cuda.memory.memory_snapshot() is) and the PUT to the bootstrap."""
    import torch
    transporter.init_engine()
    if transporter.engine is None:
        raise SystemExit("SGLang's transporter created no TransferEngine (mooncake.engine not importable)")
    saved = torch.cuda.memory.memory_snapshot
    torch.cuda.memory.memory_snapshot = lambda: [dict(s) for s in segments]
    try:
        transporter.maybe_register_and_publish_weight_info()
    finally:
        torch.cuda.memory.memory_snapshot = saved
    if transporter.weight_info is None:
        raise SystemExit("SGLang did not register the weights (remote_instance_transfer_engine_enabled()?)")


def build_rank(cfg_path, tp, r, bootstrap_port, make, draft=False):
    import torch
    import sglang_oracle
    from sglang.srt.model_executor.model_runner_components.remote_instance_weight_transporter import (
        RemoteInstanceWeightTransporter)

    c = sglang_oracle.golden_oracle.Cfg(json.load(open(cfg_path)))
    specs = sglang_oracle.golden_oracle.hf_tensors(c)
    extra = {"remote_instance_weight_loader_start_seed_via_transfer_engine": True,
             "engine_info_bootstrap_port": bootstrap_port}
    L = {"tp_size": tp, "tp_rank": r}
    model = sglang_oracle.build_and_load(cfg_path, L, {}, specs, extra, make)
    names = [n for n, _ in model.named_parameters()]
    # One free block inside the first segment: SGLang's merge must then register three buffers, not two.
    arena = Arena(model, segments=2, gap_after={names[len(names) // 4]})
    tr = RemoteInstanceWeightTransporter(get_model=lambda: model, gpu_id=0)
    register(model, tr, arena.segments)
    rank = Rank(r, model, arena, tr)
    if draft:
        # SGLang's scheduler (init_model_worker) builds the target's worker, whose ModelRunner registers and publishes
        # in initialize(), and then the draft worker, whose ModelRunner does the same with a TransferEngine of its own
        # (maybe_init_remote_instance_transfer_engine: the seed flag enables it for every runner). The draft is the
        # architecture's NextN class fed the checkpoint with its MTP layer, as the oracle's [draft] cases load it;
        # then the speculative worker hands it the target's embedding and head (EAGLEWorkerV2.init_lm_head).
        dmodel = sglang_oracle.build_and_load(cfg_path, L, {}, specs + sglang_oracle.mtp_tensors(c), extra, make,
                                              draft=True)
        darena = Arena(dmodel, segments=1)
        dtr = RemoteInstanceWeightTransporter(get_model=lambda: dmodel, gpu_id=0)
        register(dmodel, dtr, arena.segments + darena.segments)
        sync = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: None  # no device here; set_embed_and_head syncs the GPU
        try:
            dmodel.set_embed_and_head(model.model.embed_tokens.weight, model.lm_head.weight)
        finally:
            torch.cuda.synchronize = sync
        rank.draft = (dmodel, darena, dtr)
    return rank


def merged_blocks(arena):
    """What register_memory_region_v2 registers: runs of adjacent active blocks, per segment (for the ready line)."""
    out = []
    for seg in arena.segments:
        cur = None
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                if cur:
                    out.append(cur)
                cur = None
                continue
            if cur and cur[0] + cur[1] == b["address"]:
                cur = [cur[0], cur[1] + b["size"]]
            else:
                if cur:
                    out.append(cur)
                cur = [b["address"], b["size"]]
        if cur:
            out.append(cur)
    return out


def expectation(cfg_path, tp, steps, generate_bf16):
    """The test's independent expectation: for each step, SGLang's own model class loaded by SGLang's own loader from
    that step's HF tensors (the trainer demo's rule), then sha256 of every parameter as SGLang holds it."""
    import torch
    import sglang_oracle
    c = sglang_oracle.golden_oracle.Cfg(json.load(open(cfg_path)))
    specs = sglang_oracle.golden_oracle.hf_tensors(c)
    out = {}
    for step in steps:
        out[str(step)] = {}
        for r in range(tp):
            model = sglang_oracle.build_and_load(cfg_path, {"tp_size": tp, "tp_rank": r}, {}, specs, None,
                                                 lambda n, dt, sh: generate_bf16(n, step, tuple(sh)))
            out[str(step)][str(r)] = {
                n: hashlib.sha256(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, p in model.named_parameters()}
            del model
    return out


class Manager:
    """The tokenizer manager behind SGLang's routes: records calls, keeps SGLang's session state and messages."""

    def __init__(self, server_args, ranks, die_on, hf_config):
        self.server_args = server_args
        self.ranks = ranks
        self.die_on = die_on
        self.lock = threading.Lock()
        self.calls = []
        self.snapshots = {}
        self.paused = False
        self.session_open = False
        self.weight_version = "default"
        self.aborted_all = 0
        self.startup_time = time.time()
        self.model_path = server_args.model_path
        self.served_model_name = server_args.model_path
        self.is_generation = True
        self.initial_weights_loaded = True
        self.model_config = types.SimpleNamespace(is_image_understandable_model=False,
                                                  is_audio_understandable_model=False,
                                                  hf_config=types.SimpleNamespace(
                                                      model_type=hf_config["model_type"],
                                                      architectures=hf_config["architectures"]))

    def snapshot(self, tag):
        self.snapshots[tag] = {str(r.rank): r.checksums() for r in self.ranks}

    def record(self, what, obj=None, **extra):
        # The request as SGLang's validation built it: its io_struct class and every field (defaults filled in).
        # (BaseReq's own bookkeeping fields, rid and http_worker_ipc, left out.)
        from sglang.srt.managers.io_struct import BaseReq
        skip = set(BaseReq.__struct_fields__)
        body = None if obj is None else {"__class__": type(obj).__name__,
                                         **{f: getattr(obj, f) for f in obj.__struct_fields__ if f not in skip}}
        with self.lock:
            self.calls.append({"call": what, "body": body, "t": time.time(), **extra})
        if self.die_on and what == self.die_on:
            os._exit(3)

    def config_value(self, key):
        return self.weight_version if key == "weight_version" else getattr(self.server_args, key, None)

    async def get_internal_state(self):
        return [{}]

    async def pause_generation(self, obj):
        self.record("pause_generation", obj)
        self.paused = True
        self.snapshot(f"pause@{len(self.calls)}")

    async def continue_generation(self, obj):
        self.record("continue_generation", obj)
        self.paused = False

    async def begin_weight_update(self, obj, request=None):
        self.record("begin_weight_update", obj)
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "ok"

    async def end_weight_update(self, obj, request=None):
        self.record("end_weight_update", obj)
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        self.snapshot(f"end@{len(self.calls)}")
        return True, "ok"

    def abort_request(self, rid="", abort_all=False):
        self.record("abort_request", None, abort_all=abort_all)
        if abort_all:
            self.aborted_all += 1

    async def update_weight_version(self, obj):
        self.record("update_weight_version", obj)
        self.weight_version = obj.new_version
        self.snapshot(f"version:{obj.new_version}")

    async def flush_cache(self, timeout_s=0.0):
        self.record("flush_cache", None, timeout_s=timeout_s)
        return types.SimpleNamespace(success=True, message="")

    async def check_weights(self, obj, request=None):
        self.record("check_weights", obj)
        return types.SimpleNamespace(success=False, message="not served by this peer", ranks=[])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="an HF config.json (its directory is the model path)")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--mooncake-site", required=True, help="site-packages of the pinned Mooncake venv")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--initial-step", type=int, default=0, help="the trainer step whose tensors are loaded first")
    ap.add_argument("--die-on", default="", help="exit(3) when the manager gets this call (a crash mid-update)")
    ap.add_argument("--missing-rank", type=int, default=-1, help="this rank never registers with the bootstrap")
    ap.add_argument("--draft", action="store_true",
                    help="serve with a NextN draft (--speculative-algorithm NEXTN): each rank's draft runner registers "
                         "after its target, as SGLang's scheduler orders them (the config must have a next-n layer; "
                         "the checkpoint is golden_oracle's, not the trainer's)")
    ap.add_argument("--expect", default="",
                    help="comma-separated trainer steps: print {step: {rank: {name: sha256}}} of SGLang's own loaders "
                         "fed those steps' tensors (no engine, no server) and exit")
    args = ap.parse_args()

    # SGLang's own knobs: the local IP its transporter announces, the Mooncake protocol it initializes.
    os.environ["SGLANG_HOST_IP"] = args.host
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    sys.path.append(args.mooncake_site)
    try:
        import soundfile  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _InertFinder())
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(HERE, "..", "client"))
    from python_client_test import generate_bf16  # numpy port of the trainer demo's generator

    def make(name, dtype, shape):
        if dtype != "bfloat16":
            raise SystemExit(f"{name}: the trainer demo writes bf16 only, not {dtype}")
        return generate_bf16(name, args.initial_step, tuple(shape))

    cfg_path = os.path.abspath(args.config)
    if args.expect:
        print(json.dumps(expectation(cfg_path, args.tp, [int(x) for x in args.expect.split(",")], generate_bf16)))
        return

    from sglang.srt.entrypoints.engine_info_bootstrap_server import EngineInfoBootstrapServer
    boot_port = free_port(args.host)
    boot = EngineInfoBootstrapServer(args.host, boot_port)
    for _ in range(100):
        try:
            socket.create_connection((args.host, boot_port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    ranks = []
    for r in range(args.tp):
        # A rank that never registers (its PUT is what a dead worker never sends): built, not published.
        rk = build_rank(cfg_path, args.tp, r, boot_port if r != args.missing_rank else free_port(args.host),
                        None if args.draft else make, draft=args.draft)
        ranks.append(rk)
    from sglang.srt.runtime_context import get_parallel  # noqa: F401  (publish() happened per rank)
    from sglang.srt.server_args import ServerArgs
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=1, speculative_eagle_topk=1,
                speculative_num_draft_tokens=2) if args.draft else {}
    server_args = ServerArgs(model_path=os.path.dirname(cfg_path), tp_size=args.tp, device="cpu",
                             skip_tokenizer_init=True, **spec)

    import sglang.srt.entrypoints.http_server as http_server
    import uvicorn
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError

    mgr = Manager(server_args, ranks, args.die_on, json.load(open(cfg_path)))
    mgr.snapshot("initial")
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=mgr, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app
    rejected = []
    stop = threading.Event()

    sglang_handler = app.exception_handlers[RequestValidationError]  # SGLang's own: 400 with its error shape

    async def on_invalid(request: Request, exc: RequestValidationError):
        rejected.append({"path": request.url.path, "errors": json.loads(json.dumps(exc.errors(), default=str))})
        return await sglang_handler(request, exc)

    app.add_exception_handler(RequestValidationError, on_invalid)

    @app.middleware("http")
    async def log_paths(request: Request, call_next):
        if not request.url.path.startswith("/wsync_test/"):
            with mgr.lock:
                mgr.calls.append({"http": request.method, "path": request.url.path, "query": request.url.query,
                                  "t": time.time()})
        return await call_next(request)

    async def log():
        return {"calls": mgr.calls, "rejected": rejected, "snapshots": mgr.snapshots,
                "aborted_all": mgr.aborted_all}

    async def leave():
        stop.set()
        return {"exiting": True}

    app.add_api_route("/wsync_test/log", log, methods=["GET"])
    app.add_api_route("/wsync_test/exit", leave, methods=["POST"])
    http_port = free_port(args.host)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=http_port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    print(json.dumps({"ready": True, "http": f"{args.host}:{http_port}", "bootstrap": f"{args.host}:{boot_port}",
                      "sessions": [rk.transporter.session_id for rk in ranks],
                      "registered": {str(rk.rank): merged_blocks(rk.arena) for rk in ranks},
                      # what each runner's transporter PUT to the bootstrap: [session_id, weights_info_dict]
                      "published": {str(rk.rank): {"target": [rk.transporter.session_id, rk.transporter.weight_info],
                                                   **({"draft": [rk.draft[2].session_id, rk.draft[2].weight_info]}
                                                      if rk.draft else {})} for rk in ranks}}), flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.should_exit = True
    boot.close()


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
