"""A policy: a model with its tokenizer, chat format and generation backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from contrail.agent.backend import Backend, HFBackend
from contrail.agent.chat import ChatFormat
from contrail.models import load_model

if TYPE_CHECKING:
    from contrail.agent.rollout import RolloutConfig


VLLM_MAX_SEQS = 64  # sequences a vLLM engine decodes at once; one value, so every policy shares its engine


@dataclass
class Policy:
    """What acting needs: the model, its tokenizer, the append-only chat format, a backend."""

    model: object
    tokenizer: object
    chat: ChatFormat
    backend: Backend

    @classmethod
    def from_model(cls, model, tokenizer, seed: int = 0, max_batch_size: int = 64,
                   autocast_bf16: bool = False, rollout: "RolloutConfig | None" = None) -> "Policy":
        """Wrap a loaded model, sampling with the backend ``rollout.backend`` names (default: HF).

        ``autocast_bf16`` samples in bf16 from fp32 (training) weights (HF
        backend). With ``rollout.backend == "vllm"`` a vLLM engine samples
        from a copy of ``model``'s weights: colocated
        (`contrail.agent.vllm.VLLMBackend`) or a ``vllm serve`` server
        (`contrail.agent.vllm_server.VLLMServerBackend`), as
        ``rollout.vllm.mode`` says. ``max_batch_size``: the most episodes the
        HF backend decodes as one batch; pass the most that one rollout plays
        (a larger call is cut into chunks that keep no KV cache across turns).
        A vLLM engine schedules any number itself and keeps its own prefix
        cache, so it always takes `VLLM_MAX_SEQS`: the trainer's and the
        evaluator's policies then share one engine.
        """
        chat = ChatFormat.from_tokenizer(tokenizer)
        if rollout is not None and rollout.backend == "vllm":
            from contrail.agent.vllm import vllm_backend

            backend = vllm_backend(model, chat.stop_ids, seed=seed, config=rollout.vllm,
                                   max_model_len=rollout.max_episode_tokens, max_batch_size=VLLM_MAX_SEQS)
        else:
            backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=seed,
                                max_batch_size=max_batch_size, autocast_bf16=autocast_bf16)
        return cls(model, tokenizer, chat, backend)

    @classmethod
    def load(cls, name: str, device: str = "cpu", dtype: str = "float32", seed: int = 0,
             rollout: "RolloutConfig | None" = None, max_batch_size: int = 64) -> "Policy":
        """Load model ``name`` and wrap it (see `from_model` for ``rollout`` and ``max_batch_size``)."""
        model, tokenizer = load_model(name, dtype=dtype, device=device)
        return cls.from_model(model, tokenizer, seed=seed, rollout=rollout, max_batch_size=max_batch_size)
