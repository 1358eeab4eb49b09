"""A policy: a model with its tokenizer, chat format and generation backend."""

from __future__ import annotations

from dataclasses import dataclass

from contrail.agent.backend import HFBackend
from contrail.agent.chat import ChatFormat
from contrail.models import load_model


@dataclass
class Policy:
    """What acting needs: the model, its tokenizer, the append-only chat format, a backend."""

    model: object
    tokenizer: object
    chat: ChatFormat
    backend: HFBackend

    @classmethod
    def from_model(cls, model, tokenizer, seed: int = 0, max_batch_size: int = 64,
                   autocast_bf16: bool = False) -> "Policy":
        """Wrap a loaded model; ``autocast_bf16`` samples in bf16 from fp32 (training) weights."""
        chat = ChatFormat.from_tokenizer(tokenizer)
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=seed, max_batch_size=max_batch_size,
                            autocast_bf16=autocast_bf16)
        return cls(model, tokenizer, chat, backend)

    @classmethod
    def load(cls, name: str, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> "Policy":
        model, tokenizer = load_model(name, dtype=dtype, device=device)
        return cls.from_model(model, tokenizer, seed=seed)
