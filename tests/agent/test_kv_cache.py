"""The in-place KV cache against transformers' concatenating one."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from contrail.agent.kv_cache import MIN_HEADROOM, GrowingLayer, growing_cache
from contrail.testing import tiny_model, tiny_tokenizer


def _states(length, batch=2, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, dim, generator=g), torch.randn(batch, heads, length, dim, generator=g)


def test_updates_return_what_concatenation_returns_across_reallocations():
    mine, theirs = GrowingLayer(), DynamicLayer()
    for step, length in enumerate([5] + [1] * (MIN_HEADROOM + 10) + [40]):
        keys, values = _states(length, seed=step)
        got, expected = mine.update(keys, values), theirs.update(keys, values)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert mine.get_seq_length() == theirs.get_seq_length() == 5 + MIN_HEADROOM + 10 + 40


def test_a_decode_step_writes_in_place_without_copying_the_cache():
    layer = GrowingLayer()
    layer.update(*_states(10))
    buffer = layer.keys.data_ptr()
    for step in range(MIN_HEADROOM):
        layer.update(*_states(1, seed=step + 1))
    assert layer.keys.data_ptr() == buffer  # still views of the first buffer: no per-step copy
    assert layer.keys.shape[-2] == 10 + MIN_HEADROOM


def test_replaced_tensors_are_adopted_and_a_copy_never_writes_into_the_original():
    layer = GrowingLayer()
    layer.update(*_states(6))
    layer.batch_select_indices(torch.tensor([1, 1, 0]))  # rows replaced by a gather, as the HF backend does
    keys, values = _states(1, batch=3, seed=3)
    out_keys, _ = layer.update(keys, values)
    assert out_keys.shape == (3, 2, 7, 4)
    torch.testing.assert_close(out_keys[:, :, -1], keys[:, :, 0])

    original = layer.keys.clone()
    twin = copy.copy(layer)  # a shallow copy, as `_Session.take` makes
    twin.update(*_states(1, batch=3, seed=4))
    layer_keys, _ = layer.update(*_states(1, batch=3, seed=5))
    torch.testing.assert_close(layer_keys[:, :, :7], original, rtol=0, atol=0)
    assert twin.keys.data_ptr() != layer.keys.data_ptr()


def test_a_model_generates_the_same_logits_with_either_cache():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 4], [1, 6, 8, 10, 12, 3]])
    outputs = []
    with torch.no_grad():
        for cache in (DynamicCache(), growing_cache()):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            steps = [out.logits[:, -1]]
            for token in range(3, 3 + MIN_HEADROOM + 5):  # past the first buffer's headroom
                step = torch.full((2, 1), 3 + token % 9)
                out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits[:, -1])
            outputs.append(torch.stack(steps))
    assert isinstance(out.past_key_values.layers[0], GrowingLayer)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6)


def test_under_autocast_the_cache_keeps_bf16_and_the_model_computes_what_it_did_from_fp32():
    """Attention casts the fp32 keys the rotary embedding returns to bf16 anyway: storing them so is exact."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 4], [1, 6, 8, 10, 12, 3]])
    outputs, caches = [], []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for cache in (DynamicCache(), growing_cache()):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            steps = [out.logits[:, -1]]
            for token in range(8):
                out = model(input_ids=torch.full((2, 1), 3 + token), past_key_values=out.past_key_values,
                            use_cache=True)
                steps.append(out.logits[:, -1])
            outputs.append(torch.stack(steps).float())
            caches.append(out.past_key_values.layers[0])
    assert caches[0].keys.dtype == torch.float32  # transformers' cache: fp32 keys, cast at every use
    assert caches[1].keys.dtype == caches[1].values.dtype == torch.bfloat16
    torch.testing.assert_close(caches[1].keys, caches[0].keys.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def test_the_unfilled_end_of_a_buffer_is_zero_since_attention_reads_it_masked():
    """A masked score's weight is 0, and 0 x NaN is NaN: the positions past the cache must hold finite values."""
    from contrail.agent.attention import whole_buffers

    layer = GrowingLayer()
    for step, length in enumerate([5, 1, 1, MIN_HEADROOM]):  # the last update reallocates
        keys, values = layer.update(*_states(length, seed=step))
        mask = torch.ones(2, 1, 1, keys.shape[-2], dtype=torch.bool)
        whole_keys, whole_values, whole_mask = whole_buffers(keys, values, mask)
        filled = keys.shape[-2]
        assert whole_keys.shape[-2] > filled and whole_mask.shape[-1] == whole_keys.shape[-2]
        assert not whole_mask[..., filled:].any()
        for whole in (whole_keys, whole_values):
            assert torch.equal(whole[..., filled:, :], torch.zeros_like(whole[..., filled:, :]))


def test_selecting_rows_copies_them_once_into_a_buffer_that_later_steps_write_in_place():
    layer, reference = GrowingLayer(), DynamicLayer()
    for states in (_states(10, batch=4), _states(1, batch=4, seed=1)):
        layer.update(*states)
        reference.update(*states)
    rows = torch.tensor([3, 1])
    layer.batch_select_indices(rows)
    reference.batch_select_indices(rows)
    selected = layer.keys.data_ptr()
    for step in range(3):
        states = _states(1, seed=step + 2)
        got, expected = layer.update(*states), reference.update(*states)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert layer.keys.data_ptr() == selected  # no reallocation after the select: it kept room
    assert layer.keys.shape[:2] == (2, 2)


def test_a_copied_layer_holds_no_buffer_of_its_original():
    layer = GrowingLayer()
    layer.update(*_states(10))
    twin = copy.copy(layer)
    assert twin._buffers is None and layer._buffers is not None  # a taken session frees its original's buffer
    twin.keys, twin.values = twin.keys[:1], twin.values[:1]
    before = layer.keys.clone()
    twin.update(*_states(1, batch=1, seed=3))
    torch.testing.assert_close(layer.keys, before, rtol=0, atol=0)


def test_assembling_left_pads_the_named_rows_in_order_into_one_buffer_the_next_updates_append_to():
    short, long = GrowingLayer(), GrowingLayer()
    short_states, long_states = _states(3, batch=1, seed=1), _states(5, batch=3, seed=2)
    short.update(*short_states)
    long.update(*long_states)
    assembled = GrowingLayer()
    assembled.update(*_states(2, batch=1, seed=3))  # what it held before is replaced
    # out of order, a repeat, and a run of consecutive rows (copied as one slice)
    rows = [(long, 2), (short, 0), (long, 0), (long, 1), (long, 2)]
    assembled.assemble(rows, width=5, room=70)
    assert assembled.keys.shape == (5, 2, 5, 4)
    for got, short_part, long_part in zip((assembled.keys, assembled.values), short_states, long_states):
        torch.testing.assert_close(got[1, :, 2:], short_part[0], rtol=0, atol=0)
        assert not got[1, :, :2].any()  # left padding is zeros
        torch.testing.assert_close(got[[0, 2, 3, 4]], long_part[[2, 0, 1, 2]], rtol=0, atol=0)
    assert assembled.spare() >= 70 + MIN_HEADROOM  # the room asked for, then the usual headroom
    buffer = assembled.keys.data_ptr()
    new = _states(70, batch=5, seed=4)  # a prefill of the room's size
    keys, values = assembled.update(*new)
    assert assembled.keys.data_ptr() == buffer  # appended in place: no copy
    torch.testing.assert_close(keys[:, :, 5:], new[0], rtol=0, atol=0)
    torch.testing.assert_close(keys[2:4, :, :5], long_states[0][:2], rtol=0, atol=0)


def test_rows_assembled_to_end_at_their_own_positions_are_extended_in_place_by_row_range():
    """A turn's prefill buckets: each bucket's rows end where its new tokens begin, and extending a bucket's
    row range (`rows`) writes into the joined buffer, so no join copies them afterwards."""
    short, long = GrowingLayer(), GrowingLayer()
    short_states, long_states = _states(3, batch=2, seed=1), _states(5, batch=1, seed=2)
    short.update(*short_states)
    long.update(*long_states)
    joint = GrowingLayer()
    # bucket one: the two short rows, 6 new tokens (end at 9 - 6 = 3); bucket two: the long row, 4 new (end at 5)
    joint.assemble([(short, 0), (short, 1), (long, 0)], width=5, room=4, ends=[3, 3, 5])
    assert joint.keys.shape == (3, 2, 5, 4)
    torch.testing.assert_close(joint.keys[:2, :, :3], short_states[0], rtol=0, atol=0)
    assert not joint.keys[:2, :, 3:].any()  # after a row's end: zeros until its bucket writes there
    torch.testing.assert_close(joint.values[2:, :, :5], long_states[1], rtol=0, atol=0)
    buffer = joint._buffers[1].data_ptr()
    first, second = joint.rows(0, 2, 3), joint.rows(2, 3, 5)
    new_short, new_long = _states(6, batch=2, seed=3), _states(4, batch=1, seed=4)
    first.update(*new_short)
    second.update(*new_long)
    assert first.writes_into(joint) and second.writes_into(joint)
    joint.filled(9)
    assert joint._buffers[1].data_ptr() == buffer and joint.keys.shape == (3, 2, 9, 4)
    torch.testing.assert_close(joint.keys[:2, :, 3:9], new_short[0], rtol=0, atol=0)
    torch.testing.assert_close(joint.values[2:, :, 5:9], new_long[1], rtol=0, atol=0)
    torch.testing.assert_close(joint.keys[:2, :, :3], short_states[0], rtol=0, atol=0)  # history kept
    overflow = joint.rows(0, 1, 9)
    overflow.update(*_states(joint.spare() + 1, batch=1, seed=5))  # past the buffer: a buffer of its own
    assert not overflow.writes_into(joint)
