"""Sampling's linear layers on packed bf16 weights: the same bits as autocast's, switched on and off cleanly."""

from __future__ import annotations

import pytest
import torch

from contrail.agent.backend import HFBackend, SamplingParams
from contrail.agent.packed_linear import packed_linears, supported
from contrail.testing import tiny_model

needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU's oneDNN has no bf16 products")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 70])
def test_a_packed_layer_gives_autocast_bits(bias, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40, bias=bias)
    hidden = torch.randn(2, rows, 48)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(hidden)
        with packed_linears(layer):
            packed = layer(hidden)
    assert packed.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(packed, expected)


@needs_onednn_bf16
def test_layers_get_their_class_forward_back_even_after_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad(), pytest.raises(KeyError):
        with packed_linears(model):
            assert all("forward" in vars(layer) for layer in (model[0], model[2]))
            raise KeyError("boom")
    assert all("forward" not in vars(layer) for layer in model)


@needs_onednn_bf16
def test_a_layer_that_fails_to_pack_leaves_none_switched(monkeypatch):
    import contrail.agent.packed_linear as packed_linear

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    pack = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward",
                        lambda layer: pack(layer) if layer is model[0] else (_ for _ in ()).throw(MemoryError()))
    with torch.no_grad(), pytest.raises(MemoryError), packed_linears(model):
        pass
    assert all("forward" not in vars(layer) for layer in model)


class Shard(torch.Tensor):
    """A tensor subclass, as FSDP's DTensor shards are."""


@needs_onednn_bf16
def test_subclasses_and_subclassed_weights_keep_their_own_forward_and_gradients_are_refused():
    class Adapter(torch.nn.Linear):
        pass

    sharded = torch.nn.Linear(8, 8)
    sharded.weight = torch.nn.Parameter(sharded.weight.detach().as_subclass(Shard))
    model = torch.nn.Sequential(Adapter(8, 8), sharded, torch.nn.Linear(8, 8))
    with torch.no_grad(), packed_linears(model):
        assert "forward" not in vars(model[0]) and "forward" not in vars(model[1])
        assert "forward" in vars(model[2])
    with pytest.raises(RuntimeError, match="sampling"), packed_linears(model):
        pass


def test_supported_needs_bf16_autocast_on_a_cpu():
    model = torch.nn.Linear(4, 4)
    assert not supported(model, autocast_bf16=False)
    assert supported(model, autocast_bf16=True) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_onednn_bf16
def test_packed_sampling_draws_the_same_tokens_with_the_same_logprobs(tokenizer):
    """Over prefill and decode steps the packed path samples exactly what autocast's plain weights do."""
    model = tiny_model(tokenizer, hidden_size=64, seed=3)
    prompts = [tokenizer(f"say the word {word} .")["input_ids"] for word in ("apple", "berry", "door", "red")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    generations = {}
    for pack in (False, True):
        backend = HFBackend(model, set(), tokenizer.pad_token_id, seed=5, autocast_bf16=True, pack_weights=pack)
        generations[pack] = backend.generate(prompts, params, seeds=[11, 12, 13, 14])
    assert [g.ids for g in generations[True]] == [g.ids for g in generations[False]]
    assert [g.logprobs for g in generations[True]] == [g.logprobs for g in generations[False]]
    assert all("forward" not in vars(module) for module in model.modules())


@needs_onednn_bf16
def test_the_backend_packs_its_linears_while_it_samples(tokenizer, monkeypatch):
    import contrail.agent.packed_linear as packed_linear

    model = tiny_model(tokenizer, seed=3)
    packed = []
    pack = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward", lambda layer: packed.append(layer) or pack(layer))
    prompt = tokenizer("say the word apple .")["input_ids"]
    HFBackend(model, set(), tokenizer.pad_token_id, autocast_bf16=True).generate([prompt], SamplingParams(4))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert packed == linears
    packed.clear()
    HFBackend(model, set(), tokenizer.pad_token_id, autocast_bf16=False).generate([prompt], SamplingParams(4))
    assert packed == []  # fp32 sampling: nothing to pack
