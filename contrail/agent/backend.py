"""Generation backends: turn a batch of token-id prompts into sampled continuations.

A backend returns the sampled ids themselves (never text) and the sampler's
log-probability of each, so the rollout can keep token-in/token-out
bookkeeping. ``HFBackend`` runs a Hugging Face causal LM with its KV cache on
CPU or GPU; a vLLM backend plugs in behind the same two methods.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One sampled continuation: ids, their log-probs, and whether a stop id ended it."""

    ids: list[int]
    logprobs: list[float]
    stopped: bool


class Backend(Protocol):
    """What the rollout needs from a generator."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask logits outside the smallest set whose probability reaches ``top_p`` (nucleus)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(ids, log-probs under the sampling distribution)``."""
    logits = logits.float()
    if params.temperature == 0:
        logprobs = logits.log_softmax(-1)
        ids = logits.argmax(-1)
    else:
        logits = logits / params.temperature
        if params.top_p < 1:
            logits = _filter_top_p(logits, params.top_p)
        logprobs = logits.log_softmax(-1)
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)


class HFBackend:
    """Batched sampling from a transformers causal LM with a KV cache.

    Prompts are left-padded into one batch; rows that hit a stop id keep
    decoding pad tokens (ignored) until every row is done or the token limit
    is reached. Sampling uses its own seeded ``torch.Generator``, so the same
    seed and prompts give the same samples.
    """

    def __init__(self, model, stop_ids: set[int] | frozenset[int], pad_id: int, seed: int = 0,
                 max_batch_size: int = 64):
        self.model = model
        self.stop_ids = frozenset(stop_ids)
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self._device())
        self.generator.manual_seed(seed)
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept both.
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def generator_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_generator_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        results: list[Generation] = []
        # Longest prompts together: less padding per batch.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        by_index: dict[int, Generation] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for index, generation in zip(chunk, self._generate_batch([prompts[i] for i in chunk], params)):
                by_index[index] = generation
        results = [by_index[i] for i in range(len(prompts))]
        return results

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        device = self._device()
        was_training = self.model.training
        self.model.eval()
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        cache, logits = _cache_of(out), out.logits[:, -1]
        last_position = positions[:, -1]
        sampled, logprobs = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        stop = torch.tensor(sorted(self.stop_ids), device=device)
        for _ in range(params.max_new_tokens):
            ids, lps = sample_next(logits, params, self.generator)
            ids = torch.where(done, torch.full_like(ids, self.pad_id), ids)
            sampled.append(ids)
            logprobs.append(lps)
            done = done | torch.isin(ids, stop)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            last_position = last_position + 1
            out = self.model(input_ids=ids[:, None], attention_mask=attention,
                             position_ids=last_position[:, None], use_cache=True, **{self._cache_arg: cache})
            cache, logits = _cache_of(out), out.logits[:, -1]
        if was_training:
            self.model.train()
        return self._unpack(torch.stack(sampled, 1).tolist(), torch.stack(logprobs, 1).tolist())

    def _unpack(self, rows: list[list[int]], logprob_rows: list[list[float]]) -> list[Generation]:
        generations = []
        for ids, lps in zip(rows, logprob_rows):
            end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), None)
            keep = end if end is not None else len(ids)
            generations.append(Generation(ids[:keep], lps[:keep], stopped=end is not None))
        return generations
