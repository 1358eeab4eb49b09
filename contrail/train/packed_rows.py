"""Rows after a shared prefix forwarded as one packed sequence, without padding.

A GRPO micro-batch is a group's episodes: one prompt, then each episode's
own turns, of lengths that differ by whole turns (a 1-turn success beside a
3-turn failure). `contrail.train.logprobs` forwards the prompt once and the
rows after it; right-padded to the longest, a fifth of a quickstart update's
forwarded tokens were padding (BabyAI, 28 trained episodes: 14,309
forwarded, 11,631 real), and every linear layer, norm and attention
computed them.

Here the rows' own tokens are laid end to end in one sequence of batch 1
after the prefix's cache, each token keeping its row's position id, so the
linear layers see only real tokens. Attention is the one place rows must
stay apart: `packed_rows_attention` attends each row's queries over the
prefix's keys and that row's own keys (causal, aligned at the end), one
call per row: PyTorch's SDPA, or with ``TrainConfig.row_attention`` (in
bf16 on a CPU without AMX) `contrail.train.row_attention`'s products. The
result is the padded forward's, up to floating-point rounding, and so are
its gradients.

>>> with packed_layout(model, prefix=455, lengths=[26, 231, 255, 286]):
...     output = model(input_ids=packed, position_ids=positions, past_key_values=prefix_cache)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from contrail.train import row_attention

IMPLEMENTATION = "contrail_packed_rows"
# Attention arguments the row-by-row SDPA calls do not apply (a model whose config sets them keeps padded rows).
UNSUPPORTED = ("softcap", "sliding_window", "position_bias")


@dataclass(frozen=True)
class Layout:
    """A packed forward's shape: ``prefix`` cached positions every row reads, then rows of ``lengths`` tokens."""

    prefix: int
    lengths: tuple[int, ...]

    def bounds(self) -> list[tuple[int, int]]:
        """Each row's ``(begin, end)`` among the packed tokens."""
        bounds, begin = [], 0
        for length in self.lengths:
            bounds.append((begin, begin + length))
            begin += length
        return bounds


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("contrail_packed_layout", default=None)


def packed_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' interface over the packed rows of the current `packed_layout`.

    ``query (1, H, S, D)`` holds the rows' tokens end to end; ``key``/``value
    (1, Hkv, P + S, D)`` the prefix's ``P`` positions, then the rows' own.
    Row ``r``'s queries see the prefix and its own earlier tokens, nothing
    of another row; transformers' mask (causal over the whole sequence) is
    not read. Returns ``(output (1, S, H, D), None)`` as SDPA's path does.
    """
    layout = _LAYOUT.get()
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    unsupported = {"dropout": dropout or None, **{name: kwargs.get(name) for name in UNSUPPORTED}}
    if any(value is not None for value in unsupported.values()):  # `supports` should have kept such a model away
        raise NotImplementedError(f"packed rows: attention with {unsupported}")
    prefix = layout.prefix
    if query.shape[0] != 1 or query.shape[2] != sum(layout.lengths) or key.shape[2] != prefix + query.shape[2]:
        raise ValueError(f"packed rows: query {tuple(query.shape)} and key {tuple(key.shape)} do not match "
                         f"a prefix of {prefix} and rows of {list(layout.lengths)} tokens")
    by_products = row_attention.applies(query)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    outputs = []
    for begin, end in layout.bounds():
        keys = torch.cat([key[:, :, :prefix], key[:, :, prefix + begin:prefix + end]], dim=2)
        values = torch.cat([value[:, :, :prefix], value[:, :, prefix + begin:prefix + end]], dim=2)
        if by_products:
            outputs.append(row_attention.row_attention(query[0, :, begin:end], keys[0], values[0], prefix,
                                                       scale)[None])
            continue
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, begin:end], keys, values, attn_mask=_end_aligned_causal(end - begin, prefix, query.device),
            scale=scale, enable_gqa=True))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _end_aligned_causal(queries: int, prefix: int, device) -> torch.Tensor:
    """``(queries, prefix + queries)``: True where query ``i`` may look (the prefix and its row up to itself)."""
    return torch.ones(queries, prefix + queries, dtype=torch.bool, device=device).tril(prefix)


def register() -> str:
    """Register `packed_rows_attention` (and SDPA's mask format) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, packed_rows_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    return IMPLEMENTATION


def supports(model) -> bool:
    """Whether ``model`` attends through SDPA on a CPU, with plain attention (no dropout, window or soft-capping),
    where packed rows replace its padded forward."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    plain = (not getattr(config, "attention_dropout", 0.0) and window is None
             and getattr(config, "attn_logit_softcapping", None) is None)
    return plain and next(model.parameters()).device.type == "cpu"


@contextlib.contextmanager
def packed_layout(model, prefix: int, lengths: list[int]) -> Iterator[None]:
    """Within the block, ``model`` attends as packed rows of ``lengths`` tokens after ``prefix`` cached ones."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = register()
    token = _LAYOUT.set(Layout(prefix, tuple(lengths)))
    try:
        yield
    finally:
        _LAYOUT.reset(token)
        config._attn_implementation = previous
