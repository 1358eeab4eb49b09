"""A packed row's bf16 attention (products and a hand-written backward) against fp64 SDPA."""

import pytest
import torch

from contrail.train import row_attention


def _reference(query, key, value, prefix, scale):
    """fp64 SDPA over the row's end-aligned causal mask, grouped heads repeated."""
    queries = query.shape[1]
    mask = torch.ones(queries, prefix + queries, dtype=torch.bool).tril(prefix)
    return torch.nn.functional.scaled_dot_product_attention(
        query[None].double(), key[None].double(), value[None].double(), attn_mask=mask, scale=scale,
        enable_gqa=True)[0]


def _with_gradients(attend, inputs, grad):
    inputs = [tensor.detach().requires_grad_() for tensor in inputs]
    output = attend(*inputs)
    output.backward(grad.to(output.dtype))
    return [output.detach().double()] + [tensor.grad.double() for tensor in inputs]


def _relative_error(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("prefix, queries", [(11, 7), (0, 9), (23, 1)])
def test_row_attention_gives_sdpas_values_and_gradients_to_bf16_rounding(prefix, queries):
    g = torch.Generator().manual_seed(prefix + queries)
    heads, kv_heads, dim, scale = 6, 2, 16, 0.25
    query = torch.randn(heads, queries, dim, generator=g).bfloat16()
    key = torch.randn(kv_heads, prefix + queries, dim, generator=g).bfloat16()
    value = torch.randn(kv_heads, prefix + queries, dim, generator=g).bfloat16()
    grad = torch.randn(heads, queries, dim, generator=g)
    got = _with_gradients(lambda q, k, v: row_attention.row_attention(q, k, v, prefix, scale),
                          [query, key, value], grad)
    want = _with_gradients(lambda q, k, v: _reference(q, k, v, prefix, scale), [query, key, value], grad)
    assert got[0].dtype == want[0].dtype and got[0].shape == (heads, queries, dim)
    for name, ours, reference in zip(["output", "query", "key", "value"], got, want):
        # bf16 keeps 8 bits: a few parts in a thousand per element, about 1e-2 over a product's sums.
        assert _relative_error(ours, reference) < 2e-2, name


def test_row_attention_computes_in_bf16_whatever_its_inputs_and_autocast():
    query, key, value = torch.randn(4, 5, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = row_attention.row_attention(query, key, value, 3, 0.5)
    assert output.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="a row of 5 tokens after a prefix of 4"):
        row_attention.row_attention(query, key, value, 4, 0.5)


def test_row_attention_applies_in_use_to_bf16_on_a_cpu_without_amx(monkeypatch):
    monkeypatch.setattr(row_attention, "cpu_has_amx", lambda: False)
    query = torch.randn(2, 3, 4)
    assert not row_attention.applies(query.bfloat16())  # not in use: SDPA's kernel
    with row_attention.in_use():
        assert not row_attention.applies(query)  # fp32: SDPA's kernel
        assert row_attention.applies(query.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert row_attention.applies(query)  # the trainer's bf16: fp32 queries, bf16 products
        with row_attention.in_use(False):
            assert not row_attention.applies(query.bfloat16())
        monkeypatch.setattr(row_attention, "cpu_has_amx", lambda: True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not row_attention.applies(query)  # AMX multiplies SDPA's tiles; not measured here
    monkeypatch.setattr(row_attention, "cpu_has_amx", lambda: False)
    assert not row_attention.applies(query.bfloat16())


@pytest.mark.parametrize("configured", [False, True])
def test_the_trainer_attends_packed_rows_by_products_only_when_configured(row_attention_calls, configured):
    from contrail.experiment import WarmStart
    from contrail.testing import tiny_model, tiny_tokenizer
    from contrail.train.config import TrainConfig
    from contrail.train.demos import demonstrations
    from contrail.train.trainer import MaskedTokenTrainer, cross_entropy_loss

    calls = row_attention_calls
    tokenizer = tiny_tokenizer()
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=4), tokenizer, use_cache=False)
    config = TrainConfig(lr=1e-3, precision="bf16", row_attention=configured)
    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, config)
    assert trainer.pack_rows
    stats = trainer.step(samples, cross_entropy_loss)
    assert bool(calls) == configured
    assert torch.isfinite(torch.tensor(stats["loss"]))
