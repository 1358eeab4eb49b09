"""The worker extension a ``vllm serve`` process loads so contrail can push weights to it.

Start the server with
``--worker-extension-cls contrail.agent.vllm_worker.WeightSyncExtension``
(and ``VLLM_SERVER_DEV_MODE=1``, which opens ``/collective_rpc``). vLLM mixes
this class into each of its workers; `contrail.agent.vllm_server.VLLMServerBackend`
then writes the trainer's weights to a safetensors file on a filesystem both
processes see and asks every worker, through ``/collective_rpc``, to load it
with vLLM's in-place ``reload_weights``. Safetensors holds tensors only:
loading it runs no code (no pickle).

This module imports nothing heavy at import time: it runs inside vLLM's worker.
"""

from __future__ import annotations

__all__ = ["WeightSyncExtension"]


class WeightSyncExtension:
    """Methods vLLM adds to its workers (``self`` is a vLLM ``Worker``)."""

    def contrail_server_settings(self) -> dict:
        """The settings a contrail backend checks before it samples (JSON-able)."""
        config = self.vllm_config
        return {
            "logprobs_mode": str(config.model_config.logprobs_mode),
            "max_model_len": int(config.model_config.max_model_len),
            "enable_chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
            "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "device": str(config.device_config.device_type),
        }

    def contrail_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file ``path`` into the model in place; return how many."""
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")  # the worker's own loader moves them to its device
        self.reload_weights(weights_iterator=list(weights.items()))
        return len(weights)
