"""One packed row's attention in bf16 on a CPU: matrix products and a softmax, its backward written out.

`contrail.train.packed_rows` attends each row of a packed micro-batch over
the shared prefix's keys and its own (causal). Through PyTorch's CPU SDPA
kernel that was the largest part of a GRPO update: 13.6 of 32.7 s on one
quickstart step's episodes (SmolLM2-135M, LoRA, bf16, a 2-core EPYC; its
backward alone 10.3 s), the kernel running at a quarter to a third of the
bf16 matrix-product rate on rows of a few hundred queries and a 64-wide
head. Here a row is the two bf16 products of the forward and the four of
the backward, each at the matrix-product rate, with the softmax and its
backward one pass each over the row's ``(heads, queries, keys)`` weights:

    scores  = (q · scale) kᵀ        (own × own block masked causally)
    weights = softmax(scores)       (bf16 out, fp32 inside)
    out     = weights v
    backward: dv = weightsᵀ dout; dweights = dout vᵀ;
              dscores = softmax_backward(dweights, weights);
              dq = dscores k · scale; dk = dscoresᵀ (q · scale)

The weights are recomputed in the backward rather than kept, as flash
attention does: kept, they would be a micro-batch's ``heads × queries ×
keys`` for every layer (about 2 GB at the quickstart's 4,096 tokens).

The scores are rounded to bf16 before the softmax, as in the HF backend's
own sampling attention (`contrail.agent.attention`); SDPA's kernel keeps
them in fp32. The result differs from SDPA's by bf16 rounding, not more
(`tests/test_row_attention.py` holds it to an fp64 reference); on the
quickstart's model the packed rows' log-probs lie as close to fp32's as
SDPA's do (README, "Measured here", session 42).
Queries share key/value heads in groups (grouped-query attention) in place.

It is off by default (``TrainConfig.row_attention``): rounding otherwise
than SDPA's kernel moves every episode after the first update, and over the
quickstart's three seeds the stage-1 gains kept their mean (+0.081 against
+0.078) but the main job's seed 0 lost its own (+0.008 against +0.086).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from contrail.precision import cpu_has_amx

__all__ = ["row_attention", "applies", "in_use"]

_IN_USE: contextvars.ContextVar[bool] = contextvars.ContextVar("contrail_row_attention", default=False)


@contextlib.contextmanager
def in_use(on: bool = True) -> Iterator[None]:
    """Within the block, packed rows attend here where `applies` (``on``), else through SDPA's kernel.

    The trainer enters it around each forward with ``TrainConfig.row_attention``.
    """
    token = _IN_USE.set(on)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def applies(query: torch.Tensor) -> bool:
    """Whether a packed row's attention runs here: `in_use`, on a CPU without AMX tiles, computing in bf16.

    The computing dtype is autocast's where autocast is on (the trainer's bf16
    precision), else the query's. With AMX, SDPA's kernel multiplies in tiles;
    that was not measured here, so it keeps SDPA.
    """
    if not _IN_USE.get() or query.device.type != "cpu" or cpu_has_amx():
        return False
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    return dtype == torch.bfloat16


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int,
                  scale: float) -> torch.Tensor:
    """One row's attention: ``query (H, q, D)`` over ``key``/``value (Hkv, prefix + q, D)``; returns ``(H, q, D)``.

    Query ``i`` sees the ``prefix`` keys and the row's own keys up to its
    own position (the row's tokens come last, aligned with its queries).
    Computed in bf16 (inputs are cast), differentiable in all three inputs.
    """
    heads, queries, dim = query.shape
    kv_heads = key.shape[0]
    if key.shape[1] != prefix + queries or heads % kv_heads:
        raise ValueError(f"row attention: query {tuple(query.shape)} and key {tuple(key.shape)} do not make "
                         f"a row of {queries} tokens after a prefix of {prefix}")
    # Query head h reads key/value head h // groups (transformers' repeat_kv): a key/value head's groups of
    # queries are stacked as the rows of one product.
    grouped = (query * scale).to(torch.bfloat16).reshape(kv_heads, heads // kv_heads * queries, dim)
    output = _RowAttention.apply(grouped, key.to(torch.bfloat16), value.to(torch.bfloat16), prefix)
    return output.view(heads, queries, dim)


def _weights(grouped: torch.Tensor, key: torch.Tensor, prefix: int) -> torch.Tensor:
    """Softmax weights ``(Hkv, groups * q, prefix + q)`` of the scaled, grouped queries over the row's keys."""
    kv_heads, rows, length = grouped.shape[0], grouped.shape[1], key.shape[1]
    queries = length - prefix
    scores = torch.matmul(grouped, key.transpose(-1, -2))
    # Only the own × own block hides anything: every query sees the whole prefix.
    future = torch.ones(queries, queries, dtype=torch.bool, device=key.device).triu(1)
    scores.view(kv_heads, rows // queries, queries, length)[..., prefix:].masked_fill_(future, float("-inf"))
    return torch.softmax(scores, -1)


class _RowAttention(torch.autograd.Function):
    """``softmax(grouped keyᵀ, masked) value`` with the backward above; bf16 in and out."""

    @staticmethod
    def forward(ctx, grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int) -> torch.Tensor:
        ctx.save_for_backward(grouped, key, value)
        ctx.prefix = prefix
        with torch.autocast("cpu", enabled=False):  # bf16 throughout, whatever the caller's autocast says
            return torch.matmul(_weights(grouped, key, prefix), value)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grouped, key, value = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            return _backward(grouped, key, value, ctx.prefix, grad_output)


def _backward(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int,
              grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """`_RowAttention`'s gradients with respect to its grouped queries, keys and values."""
    weights = _weights(grouped, key, prefix)  # recomputed: the same bits as the forward's
    grad_output = grad_output.to(value.dtype)
    grad_value = torch.matmul(weights.transpose(-1, -2), grad_output)
    grad_weights = torch.matmul(grad_output, value.transpose(-1, -2))
    grad_scores = torch._softmax_backward_data(grad_weights, weights, -1, weights.dtype)
    grad_grouped = torch.matmul(grad_scores, key)
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), grouped)
    return grad_grouped, grad_key, grad_value, None
