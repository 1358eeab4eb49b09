"""The CPU decode-step attention against transformers' own SDPA path."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from contrail.agent.attention import MAX_DIRECT_QUERIES, MIN_SPAN_QUERIES, decode_attention, decoding_attention
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


def _cache_copies(run, length: int, dim: int) -> int:
    """How many tensors of ``length`` x ``dim`` (a layer's cache, transposed or not) ``run()`` copies, nested
    copies inside kernels included (the profiler sees those)."""
    from torch.profiler import profile

    with profile(record_shapes=True) as trace:
        run()
    cache_shaped = lambda shape: tuple(shape[-2:]) in ((length, dim), (dim, length))  # noqa: E731
    return sum(1 for event in trace.events() if event.name == "aten::copy_"
               and event.input_shapes and cache_shaped(event.input_shapes[0]))


@pytest.mark.parametrize("queries", [1, MAX_DIRECT_QUERIES + 3])
def test_a_cache_that_is_the_start_of_a_larger_buffer_is_read_in_place(queries):
    """GrowingLayer's views: attention reads the whole buffer, its unfilled end masked, and copies none of it.

    bf16 and 64-wide heads, as the sampling cache is: there PyTorch's batched product copies strided views.
    """
    length, dim = 48, 64
    module, query, key, value, mask = (t.bfloat16() if torch.is_tensor(t) and t.is_floating_point() else t
                                       for t in _inputs(queries, length=length, dim=dim))
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    buffers = [torch.randn(3, 2, length + 16, dim).bfloat16() * 100 for _ in range(2)]  # unfilled: must not count
    for buffer, filled in zip(buffers, (key, value)):
        buffer[:, :, :length] = filled
    views = [buffer[:, :, :length] for buffer in buffers]
    out = {}
    copies = _cache_copies(lambda: out.update(mine=decode_attention(module, query, *views, mask, scaling=0.3)[0]),
                           length=length, dim=dim)
    assert copies == 0
    torch.testing.assert_close(out["mine"], theirs, rtol=0, atol=2e-2)
    # the same views made contiguous by hand: the count sees such copies
    assert _cache_copies(lambda: [view.contiguous() for view in views], length=length, dim=dim) == 2


@pytest.mark.parametrize("queries", [1, 3])
def test_without_a_mask_the_new_queries_attend_causally(queries):
    """No mask means nothing is padded: the last ``queries`` positions still must not see later ones."""
    module, query, key, value, _ = _inputs(queries)
    causal = torch.ones(queries, key.shape[2], dtype=torch.bool).tril(key.shape[2] - queries)[None, None]
    mine, _ = decode_attention(module, query, key, value, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, causal.expand(3, 1, -1, -1), scaling=0.3)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def _span_inputs(queries: int = MIN_SPAN_QUERIES, dtype=torch.bfloat16):
    """A bf16 prefill over a left-padded batch: row 0 padded 30 keys, row 1 with a hole, row 2 a fresh row
    whose first queries are padding and see nothing."""
    module, query, key, value, mask = _inputs(queries, batch=3, length=queries + 40, dim=64)
    mask[0, :, :, :30] = False
    mask[2, :, :, :10] = False
    mask[2, :, :10, :] = False  # padding queries of a fresh row: no visible key at all
    return module, query.to(dtype), key.to(dtype), value.to(dtype), mask


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])  # fp32: out of autocast's rotary
def test_a_bf16_prefill_attends_row_by_row_over_visible_keys_only(monkeypatch, query_dtype):
    """Keys no query of a row may see are never read: NaN there changes nothing, and SDPA is not called."""
    import contrail.agent.attention as attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)
    module, query, key, value, mask = _span_inputs()
    query = query.to(query_dtype)
    exact, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, scaling=0.3)
    key, value = key.clone(), value.clone()
    for tensor in (key, value):
        tensor[0, :, :30] = float("nan")  # row 0's left padding
        tensor[2, :, :10] = float("nan")
    monkeypatch.setattr(attention, "_grouped_sdpa", lambda *a, **k: pytest.fail("went to SDPA's kernel"))
    mine, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert mine.shape == (3, MIN_SPAN_QUERIES, 6, 64)
    assert torch.isfinite(mine).all()  # the queries that see nothing too
    seen = mask[:, 0].any(-1)  # (B, q): queries with something to see
    # bf16 scores: within bf16's rounding of the fp32 result (a wrong mask or span is off by ~0.5)
    torch.testing.assert_close(mine.float()[seen], exact[seen], rtol=0, atol=4e-2)


@pytest.mark.parametrize("queries, dtype, amx", [(MIN_SPAN_QUERIES - 1, torch.bfloat16, False),
                                                 (MIN_SPAN_QUERIES, torch.float32, False),
                                                 (MIN_SPAN_QUERIES, torch.bfloat16, True)])
def test_short_fp32_or_amx_prefills_stay_on_sdpa_kernel(monkeypatch, queries, dtype, amx):
    """Row by row pays only for long bf16 prefills on a CPU without AMX tiles (bench/rollout.py --prefill-attention)."""
    import contrail.agent.attention as attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: amx)
    module, query, key, value, mask = _span_inputs(queries, dtype)
    monkeypatch.setattr(attention, "_row_span_attention", lambda *a, **k: pytest.fail("went row by row"))
    mine, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert mine.shape == (3, queries, 6, 64)


def _prefill_mask(batch: int = 4, history: int = 50, new: int = 12, seed: int = 0) -> torch.Tensor:
    """A turn's prefill mask ``(B, 1, new, history + new)`` as transformers builds it: each row's history
    left-padded and holed (a stopped row's slots), its new tokens left-padded within the bucket and causal."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.ones(batch, history + new, dtype=torch.bool)
    for row in range(batch):
        keys[row, :int(torch.randint(0, 20, (1,), generator=g))] = False  # left padding
        keys[row, torch.randint(20, history, (3,), generator=g)] = False  # holes
        keys[row, history:history + row] = False  # the bucket's padding before this row's new tokens
    causal = torch.ones(new, history + new, dtype=torch.bool).tril(history)
    return (causal[None] & keys[:, None, :])[:, None]


def test_row_spans_fill_exactly_what_the_mask_hides():
    """Holes and the causal block filled apart give the bits of masking each row's whole span."""
    from contrail.agent.attention import RowSpans

    mask = _prefill_mask()
    spans = RowSpans(mask)
    for row, (begin, end) in enumerate(zip(spans.begin, spans.end)):
        assert mask[row, 0, :, :begin].sum() == 0 and mask[row, 0, :, end:].sum() == 0
        scores = torch.randn(2, 3, mask.shape[2], end - begin).bfloat16()
        whole = scores.clone().masked_fill_(~mask[row, 0, :, begin:end], -1e4)
        spans.fill(scores, row, -1e4)
        assert torch.equal(scores, whole), row
        assert spans.holes[row] is not None  # each row has holes, and the new block is causal
        assert spans.mixed[row][1] - spans.mixed[row][0] <= mask.shape[2]


def test_a_forwards_spans_are_worked_out_once_for_all_its_layers(monkeypatch):
    """transformers hands each layer the same mask: the spans come from it once per prefill forward."""
    import contrail.agent.attention as attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)
    made = []
    real = attention.RowSpans
    monkeypatch.setattr(attention, "RowSpans", lambda mask: made.append(1) or real(mask))
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, layers=3).eval()
    ids = torch.randint(5, 40, (2, MIN_SPAN_QUERIES + 4))
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), decoding_attention(model):
        from contrail.agent.kv_cache import growing_cache

        model(input_ids=ids, attention_mask=padding, past_key_values=growing_cache(), use_cache=True)
        assert made == [1]
        model(input_ids=ids, attention_mask=padding, past_key_values=growing_cache(), use_cache=True)
    assert made == [1, 1]
