"""The CPU decode-step attention against transformers' own SDPA path."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from contrail.agent.attention import MAX_DIRECT_QUERIES, decode_attention, decoding_attention
from contrail.testing import tiny_model, tiny_tokenizer


def _inputs(queries: int, batch=3, heads=6, kv_heads=2, length=11, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, dim, generator=g)
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    mask = torch.ones(batch, 1, queries, length, dtype=torch.bool).tril(length - queries)
    mask[0, :, :, :4] = False  # left padding: holes at the start of row 0
    mask[1, :, :, 5] = False   # a hole in the middle (a row that had stopped)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, is_causal=True)
    return module, query, key, value, mask


@pytest.mark.parametrize("queries", [1, 3, MAX_DIRECT_QUERIES])
def test_decode_attention_equals_sdpa_with_grouped_heads_and_holes(queries):
    module, query, key, value, mask = _inputs(queries)
    mine, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert mine.shape == theirs.shape == (3, queries, 6, 8)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_longer_queries_read_grouped_heads_in_place_and_equal_sdpa(monkeypatch):
    module, query, key, value, mask = _inputs(MAX_DIRECT_QUERIES + 3, length=14)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    import transformers.integrations.sdpa_attention as sdpa

    def no_copies(*args, **kwargs):
        raise AssertionError("the key/value heads were copied (repeat_kv)")

    monkeypatch.setattr(sdpa, "repeat_kv", no_copies)
    mine, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_training_goes_to_transformers_sdpa_itself(monkeypatch):
    module, query, key, value, mask = _inputs(1)
    module.training = True
    called = []
    import transformers.integrations.sdpa_attention as sdpa

    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: called.append(1) or real(*a, **k))
    decode_attention(module, query, key, value, mask)
    assert called == [1]


def test_a_cpu_model_decodes_with_it_inside_the_block_only():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 4]])
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=plain.past_key_values).logits
        again = model(input_ids=ids, use_cache=True)
        with decoding_attention(model):
            assert model.config._attn_implementation == "contrail_decode"
            mine = model(input_ids=ids[:, -1:], past_key_values=again.past_key_values).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(mine, step, rtol=0, atol=1e-5)
