"""Decode-step attention for CPUs: a few query positions against a long KV cache.

PyTorch's CPU ``scaled_dot_product_attention`` kernel is built for long
queries; for a decode step (one query per row against hundreds of cached
keys) it is several times slower than the two matrix products and a softmax
it stands for (measured on SmolLM2-135M's shapes, batch 64, 450 keys, bf16:
14.5 ms against 2.4 ms per layer), which made it most of a CPU decode step.
`decode_attention` computes those few-query cases directly, grouped-query
heads included. Longer queries (a turn's prefill) in bf16 on a CPU without
AMX tiles are computed a row at a time over the span of keys each row may see
(`_row_span_attention`), skipping its left padding; otherwise they go to PyTorch's
SDPA with the grouped heads read in place rather than copied
(`_grouped_sdpa`). Training and anything unusual go to transformers' own SDPA
path unchanged.

The HF backend switches a CPU model to it while it generates
(`decoding_attention`); nothing is changed for training or on GPUs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from contrail.precision import cpu_has_amx

IMPLEMENTATION = "contrail_decode"
MAX_DIRECT_QUERIES = 4  # beyond a few query positions SDPA's kernel is faster again
# From this many queries a bf16 prefill attends row by row (`_row_span_attention`) on a CPU without AMX tiles:
# 0.57-0.69x SDPA's time at 115-460 queries on the AVX512-BF16 EPYC (bench/rollout.py --prefill-attention);
# below it row by row gained little or lost (28-30 queries 0.92-1.00x, 8 queries 1.43x). With AMX, SDPA's
# kernel multiplies in tiles and row by row lost (a 2-core Xeon: 0.72-1.50x, 1.3x and 1.8-3.2x at those shapes).
MIN_SPAN_QUERIES = 64


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' interface: ``query (B, H, q, D)``, ``key``/``value (B, Hkv, L, D)``.

    Returns ``(output (B, q, H, D), None)`` as ``sdpa_attention_forward`` does.
    ``attention_mask`` is SDPA's: boolean ``(B, 1, q, L)``, True where a
    query may attend (or an additive float mask, or None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, queries, dim = query.shape
    if dropout > 0 or module.training or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if queries > MAX_DIRECT_QUERIES:
        if prefills_by_row(key, attention_mask, queries):
            scale = scaling if scaling is not None else dim ** -0.5
            spans = _spans_of(attention_mask, queries, key.shape[2])
            return _row_span_attention(query, key, value, spans, scale).transpose(1, 2).contiguous(), None
        return _grouped_sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
    if attention_mask is None:  # transformers leaves out an all-visible mask: the new queries are causal
        attention_mask = _causal_mask(queries, key.shape[2], query.device)
    attention_mask = attention_mask[:, :, -queries:, -key.shape[2]:]
    key, value, attention_mask = whole_buffers(key, value, attention_mask)
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query head h reads key/value head h // groups (transformers' repeat_kv)
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.reshape(batch, kv_heads, groups * queries, dim)
    # keys @ queries^T, transposed after: the product ``queries @ keys^T`` made a contiguous copy of the
    # transposed cache for every layer at every step (a quarter of a decode step at batch 64, 600 keys);
    # this way the cache is read as it lies and only the small scores are transposed.
    scores = torch.matmul(key, grouped.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.reshape(batch, kv_heads, groups, queries, length)
    scores = scores.float() * scale
    mask = attention_mask.unsqueeze(2)  # (B, 1, 1, q, L): the same for every head
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(-1).to(value.dtype).view(batch, kv_heads, groups * queries, length)
    output = torch.matmul(weights, value).view(batch, heads, queries, dim)
    return output.transpose(1, 2).contiguous(), None


def prefills_by_row(key: torch.Tensor, attention_mask: torch.Tensor | None, queries: int) -> bool:
    """Whether a prefill is faster row by row: a bf16 (or fp16) cache, a boolean mask, enough queries, no AMX.

    The cache's dtype decides: under autocast the queries leave the rotary
    embedding in fp32 while the cache holds bf16 (`contrail.agent.kv_cache`).
    """
    return (key.dtype in (torch.bfloat16, torch.float16) and attention_mask is not None
            and attention_mask.dtype == torch.bool and queries >= MIN_SPAN_QUERIES
            and key.device.type == "cpu" and not cpu_has_amx())


class RowSpans:
    """Where each row of a prefill's boolean mask ``(B, 1, q, L)`` needs masking, worked out once per forward.

    Row ``r``'s queries see keys ``begin[r]``..``end[r] - 1`` at most. Within
    that span a key is seen by every query (a cached token), by none
    (``holes[r]``: a padding slot, or a stopped row's), or by some (a new
    token, seen causally: columns ``mixed[r]``, relative to the span). Only
    the holes and the mixed columns need filling, not the whole span: the
    same positions get the same value, so the scores are the same bits as
    masking the span whole, at a fraction of the writes. transformers hands
    every layer of a forward the same mask object, so this runs once per
    forward (`_spans_of`), not once per layer. Over 64 of the quickstart's
    BabyAI test episodes (a 2-core EPYC, four alternating rounds) row-span
    attention took 0.84x its time masking whole spans (6.9 against 8.3 s of
    a 44-48 s batch), every episode the same.
    """

    def __init__(self, mask: torch.Tensor):
        rows = mask[:, 0]
        some, every = rows.any(1), rows.all(1)  # (B, L): keys some query of the row sees, and keys all do
        length = some.shape[-1]
        self.begin = some.int().argmax(-1).tolist()
        self.end = (length - some.flip(-1).int().argmax(-1)).tolist()
        self.hidden = ~mask
        self.holes: list[torch.Tensor | None] = []
        self.mixed: list[tuple[int, int]] = []
        for row, (begin, end) in enumerate(zip(self.begin, self.end)):
            holes = (~some[row, begin:end]).nonzero().squeeze(1)
            self.holes.append(holes if holes.numel() else None)
            mixed = (some[row, begin:end] & ~every[row, begin:end]).nonzero()
            self.mixed.append((int(mixed[0]), int(mixed[-1]) + 1) if mixed.numel() else (0, 0))

    def fill(self, scores: torch.Tensor, row: int, value: float) -> None:
        """Set row ``row``'s scores ``(..., q, span)`` to ``value`` wherever its mask hides the key."""
        if self.holes[row] is not None:
            scores.index_fill_(-1, self.holes[row], value)
        start, stop = self.mixed[row]
        if stop > start:
            begin = self.begin[row]
            scores[..., start:stop].masked_fill_(self.hidden[row, 0, :, begin + start:begin + stop], value)


# The last prefill mask's `RowSpans`: (the forward's mask object, the queries and keys it was cut to, its spans).
_last_spans: tuple[weakref.ref, tuple[int, int], RowSpans] | None = None


def _spans_of(attention_mask: torch.Tensor, queries: int, keys: int) -> RowSpans:
    """`RowSpans` of ``attention_mask`` cut to its last ``queries`` rows and ``keys`` columns, made once per forward."""
    global _last_spans
    last = _last_spans
    if last is not None and last[0]() is attention_mask and last[1] == (queries, keys):
        return last[2]
    spans = RowSpans(attention_mask[:, :, -queries:, -keys:])
    _last_spans = (weakref.ref(attention_mask), (queries, keys), spans)
    return spans


def _row_span_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: RowSpans,
                        scale: float) -> torch.Tensor:
    """A prefill's attention one row at a time, each row over the keys from its first visible one to its last.

    ``query (B, H, q, D)``, ``key``/``value (B, Hkv, L, D)``, ``spans`` the
    `RowSpans` of the boolean mask ``(B, 1, q, L)``; returns ``(B, H, q, D)``
    in the cache's dtype. A batch is left-padded to its
    longest row, and later turns leave holes, so SDPA's kernel computed a
    third or more of its scores for keys no query may see; it also ran at a
    quarter of the bf16 matrix-product rate (SmolLM2-135M's shapes, 20 rows,
    147 new tokens over 891 keys: 58 ms a layer against 31 ms this way).
    Row by row, each row's scores are two bf16 products over its own span,
    masked (holes, causality) and normalised in place. A query that may see
    nothing (a padding position of a fresh batch) gets weights over its span
    instead of NaN, as transformers' eager attention does; nothing reads it.
    """
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query head h reads key/value head h // groups (transformers' repeat_kv)
    grouped = (query * scale).to(key.dtype).reshape(batch, kv_heads, groups * queries, dim)
    output = key.new_empty(batch, kv_heads, groups * queries, dim)  # every row is written below
    lowest = torch.finfo(key.dtype).min  # not -inf: a query that sees nothing must not turn into NaN
    # A row none of whose queries sees a key (all padding) spans its whole width, all of it filled (`RowSpans`).
    for row, (begin, end) in enumerate(zip(spans.begin, spans.end)):
        scores = torch.matmul(grouped[row], key[row, :, begin:end].transpose(-1, -2))
        spans.fill(scores.view(kv_heads, groups, queries, end - begin), row, lowest)
        torch.matmul(scores.softmax(-1), value[row, :, begin:end], out=output[row])
    return output.view(batch, heads, queries, dim)


def _grouped_sdpa(module, query, key, value, attention_mask, scaling, **kwargs) -> tuple[torch.Tensor, None]:
    """A prefill (many queries) through PyTorch's SDPA kernel with grouped heads read in place.

    With a mask, transformers copies every key/value head ``groups`` times
    before SDPA (``repeat_kv``); a turn's prefill over a long cache spent
    16% of its time in those copies (SmolLM2-135M, batch 64, 150 new tokens
    over 600 cached). ``enable_gqa`` lets the kernel read the shared heads.
    Without a mask (causal only) transformers' path is already in place.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    key, value, attention_mask = whole_buffers(key, value, attention_mask)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _causal_mask(queries: int, length: int, device) -> torch.Tensor:
    """``(1, 1, queries, length)``, True where query ``i`` (the ``i``-th of the last ``queries`` positions) may look."""
    return torch.ones(queries, length, dtype=torch.bool, device=device).tril(length - queries)[None, None]


def whole_buffers(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole cache buffers ``key`` and ``value`` are the filled start of, ``mask`` widened to hide the rest.

    `contrail.agent.kv_cache.GrowingLayer` returns views of the first ``L``
    positions of buffers with room for more. PyTorch's CPU batched products
    and SDPA kernel copy such a view into a contiguous tensor first: two
    copies of each layer's cache at every decode step. Attending over the
    whole (contiguous, zero-initialised) buffer instead, with the unfilled
    positions masked out, reads it in place, as transformers' static cache
    does; it computes a few more scores, each of which the mask zeroes.
    Other tensors (and a float mask) are returned as they are.
    """
    key_buffer, value_buffer = _buffer_of(key), _buffer_of(value)
    if key_buffer is None or value_buffer is None or mask.dtype != torch.bool \
            or key_buffer.shape[-2] != value_buffer.shape[-2] or mask.shape[-1] != key.shape[-2]:
        return key, value, mask
    unfilled = key_buffer.shape[-2] - key.shape[-2]
    return key_buffer, value_buffer, torch.nn.functional.pad(mask, (0, unfilled), value=False)


def _buffer_of(view: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor ``view`` is the leading positions of (``view[..., :L, :]``), or None."""
    base = view._base
    if base is None or not base.is_contiguous() or base.dim() != view.dim() or view.data_ptr() != base.data_ptr():
        return None
    if base.shape[:-2] != view.shape[:-2] or base.shape[-1] != view.shape[-1] or view.stride() != base.stride():
        return None
    return base


def register() -> str:
    """Register `decode_attention` (and SDPA's mask format) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, decode_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    return IMPLEMENTATION


@contextlib.contextmanager
def decoding_attention(model) -> Iterator[None]:
    """Within the block, a CPU model using SDPA attends with `decode_attention`; anything else is left alone."""
    config = getattr(model, "config", None)
    device = next(model.parameters()).device
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or device.type != "cpu":
        yield
        return
    config._attn_implementation = register()
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
