"""A vLLM worker extension for tests/engines/vllm_draft_test.py (`--worker-extension-cls
vllm_draft_ext.DraftDigests`): vLLM's own /weight_checker covers the target model only, so this adds the same digests
(vLLM's compute_tensor_digests) for the speculative draft model, reachable through vLLM's /collective_rpc."""


class DraftDigests:
    def wsync_test_draft_digests(self) -> dict:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        draft = self.model_runner.get_draft_model()  # type: ignore[attr-defined]
        return {} if draft is None else compute_tensor_digests(draft)
