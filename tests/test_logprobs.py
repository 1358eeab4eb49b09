"""Chunked log-probs and entropies against the plain full log-softmax."""

import copy
import math

import pytest
import torch

from contrail.train import checkpointed_prefix
from contrail.train.logprobs import logprobs_and_entropy, selective_logprobs, sequence_logprobs, token_entropy


def reference_logprobs(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def reference_entropy(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def random_batch(shape=(3, 7), vocab=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * scale
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


def test_hand_computed_values():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # softmax rows: (1/2, 1/2) and (3/4, 1/4)
    out = selective_logprobs(logits, torch.tensor([1, 1]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.5), math.log(0.25)]))
    entropy = token_entropy(logits)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    torch.testing.assert_close(entropy, torch.tensor([math.log(2.0), h]))


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 21, 1000])
def test_selective_logprobs_match_full_log_softmax(chunk_size):
    logits, targets = random_batch()
    out = selective_logprobs(logits, targets, chunk_size=chunk_size)
    assert out.shape == targets.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_logprobs(logits, targets), rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_token_entropy_matches_full_softmax(chunk_size):
    logits, _ = random_batch()
    out = token_entropy(logits, chunk_size=chunk_size)
    assert out.shape == logits.shape[:-1]
    torch.testing.assert_close(out, reference_entropy(logits), rtol=0, atol=1e-5)


def test_gradients_match_full_log_softmax():
    logits, targets = random_batch(seed=1)
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))

    mine = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    (selective_logprobs(mine, targets, chunk_size=4) * weights).sum().backward()
    (reference_logprobs(ref, targets) * weights).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=1e-6)

    mine.grad, ref.grad = None, None
    (token_entropy(mine, chunk_size=4) * weights).sum().backward()
    (reference_entropy(ref) * weights).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_logprobs_and_entropy_in_one_pass_match_the_full_softmax(entropy_grad):
    logits, targets = random_batch(seed=4)
    lp_weights, h_weights = torch.randn(2, *targets.shape, generator=torch.Generator().manual_seed(5))
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()

    logprobs, entropies = logprobs_and_entropy(mine, targets, chunk_size=4)
    torch.testing.assert_close(logprobs, reference_logprobs(logits, targets), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropies, reference_entropy(logits), rtol=0, atol=1e-5)
    # A logged entropy (detached, as GRPO without an entropy bonus) must not enter the gradient.
    entropy_term = entropies if entropy_grad else entropies.detach()
    ((logprobs * lp_weights).sum() + (entropy_term * h_weights).sum()).backward()
    expected = (reference_logprobs(ref, targets) * lp_weights).sum()
    if entropy_grad:
        expected = expected + (reference_entropy(ref) * h_weights).sum()
    expected.backward()
    torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=1e-5)


def test_gradcheck_float64():
    logits, targets = random_batch(shape=(2, 3), vocab=6, seed=3, scale=1.0)
    logits = logits.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: selective_logprobs(x, targets, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, chunk_size=4), (logits,))


def test_bf16_upcasts_to_fp32():
    logits, targets = random_batch(vocab=5000, scale=5.0)
    low = logits.bfloat16()
    out = selective_logprobs(low, targets, chunk_size=8)
    assert out.dtype == torch.float32
    # exact fp32 log-softmax of the same bf16 values: only summation order differs
    torch.testing.assert_close(out, reference_logprobs(low, targets), rtol=0, atol=1e-4)
    # and within bf16 rounding of the fp32 logits themselves
    torch.testing.assert_close(out, reference_logprobs(logits, targets), rtol=0, atol=0.1)
    torch.testing.assert_close(token_entropy(low, chunk_size=8), reference_entropy(low), rtol=0, atol=1e-4)

    mine, ref = low.clone().requires_grad_(), low.clone().requires_grad_()
    selective_logprobs(mine, targets, chunk_size=8).sum().backward()
    reference_logprobs(ref, targets).sum().backward()
    assert mine.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), rtol=1e-2, atol=1e-3)



def test_chunk_size_changes_no_bit():
    """Each row is computed alone, so the default chunk size is a speed choice only (bench/scoring.py (d))."""
    logits, targets = random_batch(shape=(37,), vocab=3000, scale=5.0)
    weights = torch.rand(2, 37, generator=torch.Generator().manual_seed(1))
    results = []
    for chunk_size in (1, 8, 32, 37):
        low = logits.bfloat16().requires_grad_()
        logprobs, entropies = logprobs_and_entropy(low, targets, chunk_size=chunk_size)
        (logprobs * weights[0] + entropies * weights[1]).sum().backward()
        results.append((logprobs.detach(), entropies.detach(), low.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))

def test_banned_tokens_with_minus_inf_logits():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    out = selective_logprobs(logits, torch.tensor([0]))
    h = token_entropy(logits)
    torch.testing.assert_close(out, torch.tensor([math.log(0.5)]))
    torch.testing.assert_close(h, torch.tensor([math.log(2.0)]))
    (out + h).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_bad_inputs():
    logits, targets = random_batch()
    with pytest.raises(ValueError, match="targets must have shape"):
        selective_logprobs(logits, targets[:, :3])
    with pytest.raises(ValueError, match="integer token ids"):
        selective_logprobs(logits, targets.float())
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 50\)"):
        selective_logprobs(logits, targets + 50)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_logprobs(logits, targets, chunk_size=0)
    with pytest.raises(ValueError, match="floating"):
        token_entropy(targets)


# ---------------------------------------------------------------- sequence_logprobs on a tiny Llama


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model


def test_sequence_logprobs_alignment(tiny_llama):
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    logprobs, entropies = sequence_logprobs(tiny_llama, ids, torch.ones_like(ids), return_entropy=True)
    with torch.no_grad():
        full = torch.log_softmax(tiny_llama(input_ids=ids).logits.float(), dim=-1)
    assert logprobs.shape == ids.shape
    assert torch.all(logprobs[:, 0] == 0) and torch.all(entropies[:, 0] == 0)
    for t in range(1, ids.shape[1]):  # position t: logits at t-1, token t
        expected = full[torch.arange(2), t - 1, ids[:, t]]
        torch.testing.assert_close(logprobs[:, t], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropies[:, t], -(full[:, t - 1].exp() * full[:, t - 1]).sum(-1), rtol=0, atol=1e-5)


def test_sequence_logprobs_start_and_gradients(tiny_llama):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    everything = sequence_logprobs(tiny_llama, ids)
    tail = sequence_logprobs(tiny_llama, ids, start=5)
    assert torch.all(tail[:, :5] == 0)
    torch.testing.assert_close(tail[:, 5:], everything[:, 5:], rtol=0, atol=1e-5)
    tail.sum().backward()
    grads = [p.grad for p in tiny_llama.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert tiny_llama.lm_head.weight.grad.abs().sum() > 0
    tiny_llama.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="start"):
        sequence_logprobs(tiny_llama, ids, start=8)


def test_sequence_logprobs_padding_does_not_change_values(tiny_llama):
    g = torch.Generator().manual_seed(6)
    short = torch.randint(1, 128, (1, 5), generator=g)
    alone = sequence_logprobs(tiny_llama, short)
    pad = torch.zeros(1, 3, dtype=torch.long)
    ones, zeros = torch.ones(1, 5, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)

    right = sequence_logprobs(tiny_llama, torch.cat([short, pad], 1), torch.cat([ones, zeros], 1))
    torch.testing.assert_close(right[:, :5], alone, rtol=0, atol=1e-5)
    assert torch.all(right[:, 5:] == 0)

    left = sequence_logprobs(tiny_llama, torch.cat([pad, short], 1), torch.cat([zeros, ones], 1))
    # first real token has no real predecessor: 0, like position 0 of `alone`
    torch.testing.assert_close(left[:, 3:], alone, rtol=0, atol=1e-5)
    assert torch.all(left[:, :4] == 0)


def _shared_prefix_batch(prefix=6, lengths=(13, 10, 12), pad=0, seed=7):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, 128, (prefix,), generator=g)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.cat([head, torch.randint(1, 128, (length - prefix,), generator=g)])
        attention[row, :length] = 1
    return ids, attention


@pytest.mark.parametrize("entropy", [False, True])
def test_shared_prefix_forward_gives_the_plain_forward_values_and_gradients(tiny_llama, entropy):
    ids, attention = _shared_prefix_batch()
    results = []
    for shared in (0, 6):
        tiny_llama.zero_grad(set_to_none=True)
        out = sequence_logprobs(tiny_llama, ids, attention, start=7, return_entropy=entropy, shared_prefix=shared)
        values = out if not entropy else out[0] + out[1]
        (values * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    tiny_llama.zero_grad(set_to_none=True)


@pytest.mark.skipif(not checkpointed_prefix.supported(), reason="this transformers drops a checkpointed layer's cache")
def test_shared_prefix_under_gradient_checkpointing_gives_the_plain_values_and_gradients(tiny_llama):
    ids, attention = _shared_prefix_batch()
    layer_calls = []
    # A layer's own hooks stay outside the checkpoint; its MLP's run again when the backward replays it.
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args: layer_calls.append(1))
             for layer in tiny_llama.model.layers]
    checkpointed_prefix.enable_checkpointing(tiny_llama)
    tiny_llama.train()
    results = []
    try:
        for shared in (0, 6):
            tiny_llama.zero_grad(set_to_none=True)
            layer_calls.clear()
            logprobs, entropy = sequence_logprobs(tiny_llama, ids, attention, start=7, return_entropy=True,
                                                  shared_prefix=shared)
            values = logprobs + entropy
            (values * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
            results.append((values.detach(), {n: p.grad.clone() for n, p in tiny_llama.named_parameters()},
                            len(layer_calls)))
    finally:
        getattr(tiny_llama, "activation_checkpointing_disable", tiny_llama.gradient_checkpointing_disable)()
        tiny_llama.eval()
        for hook in hooks:
            hook.remove()
        tiny_llama.zero_grad(set_to_none=True)
    (plain, plain_grads, plain_calls), (shared, shared_grads, shared_calls) = results
    layers = len(tiny_llama.model.layers)
    assert plain_calls == 2 * layers  # checkpointing really replayed every layer in the backward
    assert shared_calls == 3 * layers  # the prefix once, unreplayed; the rows' part forward and replay
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(not getattr(m, "gradient_checkpointing", False) for m in tiny_llama.modules())


def test_shared_prefix_under_checkpointing_refuses_a_transformers_that_would_drop_its_cache(tiny_llama, monkeypatch):
    monkeypatch.setattr(checkpointed_prefix, "supported", lambda: False)  # as an older transformers
    ids, attention = _shared_prefix_batch()
    checkpointed_prefix.enable_checkpointing(tiny_llama)
    tiny_llama.train()
    try:
        with pytest.raises(ValueError, match="needs a transformers whose checkpointed layers"):
            sequence_logprobs(tiny_llama, ids, attention, start=7, shared_prefix=6)
        sequence_logprobs(tiny_llama, ids, attention, start=7)  # without sharing it still scores
    finally:
        getattr(tiny_llama, "activation_checkpointing_disable", tiny_llama.gradient_checkpointing_disable)()
        tiny_llama.eval()


def test_shared_prefix_forward_runs_the_prefix_once(tiny_llama):
    ids, attention = _shared_prefix_batch()
    fed = []
    hook = tiny_llama.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        sequence_logprobs(tiny_llama, ids, attention, start=7, shared_prefix=6)
    finally:
        hook.remove()
    assert fed == [(1, 6), (3, ids.shape[1] - 6)]


def test_shared_prefix_must_be_shared_and_before_start(tiny_llama):
    ids, attention = _shared_prefix_batch()
    with pytest.raises(ValueError, match="not the same"):
        sequence_logprobs(tiny_llama, ids, attention, start=8, shared_prefix=7)
    with pytest.raises(ValueError, match="shared_prefix must be in"):
        sequence_logprobs(tiny_llama, ids, attention, start=6, shared_prefix=6)


def _sampled_positions(attention, start=7, seed=8):
    """A loss mask: some real tokens from ``start`` on, as an episode's sampled turns between observations."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(attention.shape, generator=g) < 0.5).long() * attention
    mask[:, :start] = 0
    return mask


@pytest.mark.parametrize("shared", [0, 6])
@pytest.mark.parametrize("entropy", [False, True])
def test_positions_give_the_plain_values_and_gradients_at_the_wanted_tokens(tiny_llama, shared, entropy):
    ids, attention = _shared_prefix_batch()
    positions = _sampled_positions(attention)
    weights = torch.linspace(0.5, 1.5, ids.shape[1]) * positions
    results = []
    for wanted in (None, positions):
        tiny_llama.zero_grad(set_to_none=True)
        out = sequence_logprobs(tiny_llama, ids, attention, start=7, return_entropy=entropy, shared_prefix=shared,
                                positions=wanted)
        values = out if not entropy else out[0] + out[1]
        (values * weights).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}))
    (plain, plain_grads), (selected, selected_grads) = results
    torch.testing.assert_close(selected, plain * positions, rtol=0, atol=1e-5)
    assert torch.all(selected[positions == 0] == 0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(selected_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    tiny_llama.zero_grad(set_to_none=True)


def _head_rows(model, run):
    """How many hidden states the LM head maps while ``run()`` runs, call by call."""
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: seen.append(output.shape[:-1].numel()))
    try:
        run()
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("shared", [0, 6])
def test_positions_run_the_head_only_where_it_predicts_a_wanted_token(tiny_llama, shared):
    ids, attention = _shared_prefix_batch()
    positions = _sampled_positions(attention)
    seen = _head_rows(tiny_llama, lambda: sequence_logprobs(tiny_llama, ids, attention, start=7,
                                                            shared_prefix=shared, positions=positions))
    assert seen[-1] == int(positions.sum())
    assert sum(seen) < ids.shape[0] * (ids.shape[1] - 6)  # less than every position from the first wanted one


def test_positions_through_a_lora_model(tiny_llama):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(copy.deepcopy(tiny_llama), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids, attention = _shared_prefix_batch()
    positions = _sampled_positions(attention)
    with torch.no_grad():
        plain = sequence_logprobs(model, ids, attention, start=7)
        selected = []
        seen = _head_rows(model.get_base_model(), lambda: selected.append(
            sequence_logprobs(model, ids, attention, start=7, positions=positions)))
    assert seen == [int(positions.sum())]  # the head, found through PEFT's wrappers, ran for those tokens only
    torch.testing.assert_close(selected[0], plain * positions, rtol=0, atol=1e-5)


@pytest.mark.parametrize("entropy", [False, True])
def test_packed_rows_give_the_padded_forward_values_and_gradients(tiny_llama, entropy):
    ids, attention = _shared_prefix_batch(lengths=(13, 8, 12, 7))
    wanted = attention.clone()
    wanted[:, :7] = 0  # the loss's tokens: the rows' own, from position 7
    fed = []
    hook = tiny_llama.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    results = []
    try:
        for packed in (False, True):
            tiny_llama.zero_grad(set_to_none=True)
            fed.clear()
            out = sequence_logprobs(tiny_llama, ids, attention, start=7, return_entropy=entropy, shared_prefix=6,
                                    positions=wanted, packed=packed)
            values = out if not entropy else out[0] + out[1]
            (values * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
            results.append((values.detach(), {n: p.grad.clone() for n, p in tiny_llama.named_parameters()},
                            list(fed)))
    finally:
        hook.remove()
        tiny_llama.zero_grad(set_to_none=True)
    (padded, padded_grads, padded_fed), (packed, packed_grads, packed_fed) = results
    assert padded_fed == [(1, 6), (4, 13 - 6)]
    assert packed_fed == [(1, 6), (1, (13 + 8 + 12 + 7) - 4 * 6)]  # the rows' own tokens end to end, no padding
    assert bool((packed[wanted == 0] == 0).all()) and bool((packed[wanted == 1] != 0).all())
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_bf16_rows_attend_by_products_where_in_use_and_keep_the_padded_values(tiny_llama, row_attention_calls):
    from contrail.train import row_attention

    calls = row_attention_calls
    ids, attention = _shared_prefix_batch(lengths=(13, 8, 11))
    wanted = attention.clone()
    wanted[:, :7] = 0
    results = []
    for packed in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), row_attention.in_use():
            results.append(sequence_logprobs(tiny_llama, ids, attention, start=7, shared_prefix=6, positions=wanted,
                                             packed=packed))
    assert calls == [(4, length - 6) for _ in range(2) for length in (13, 8, 11)]  # each layer, each row
    padded, packed = results
    assert bool((packed[wanted == 1] != 0).all())
    torch.testing.assert_close(packed, padded, rtol=0, atol=0.05)  # bf16 rounding, SDPA's kernel against products


def test_packed_rows_fall_back_to_padding_where_sdpa_is_not_the_attention(tiny_llama, monkeypatch):
    ids, attention = _shared_prefix_batch()
    wanted = attention.clone()
    wanted[:, :7] = 0
    monkeypatch.setattr(tiny_llama.config, "_attn_implementation", "eager")
    fed = []
    hook = tiny_llama.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        eager = sequence_logprobs(tiny_llama, ids, attention, start=7, shared_prefix=6, positions=wanted, packed=True)
    finally:
        hook.remove()
    assert fed == [(1, 6), (3, 13 - 6)]  # padded: packed rows need SDPA's kernel per row
    monkeypatch.undo()
    packed = sequence_logprobs(tiny_llama, ids, attention, start=7, shared_prefix=6, positions=wanted, packed=True)
    torch.testing.assert_close(packed, eager, rtol=0, atol=1e-5)


def test_packed_rows_only_replace_plain_sdpa_attention(tiny_llama, monkeypatch):
    from contrail.train import packed_rows

    assert packed_rows.supports(tiny_llama)
    # Qwen2's configs carry a window they do not use.
    monkeypatch.setattr(tiny_llama.config, "sliding_window", 4096, raising=False)
    monkeypatch.setattr(tiny_llama.config, "use_sliding_window", False, raising=False)
    assert packed_rows.supports(tiny_llama)
    monkeypatch.setattr(tiny_llama.config, "use_sliding_window", True)
    assert not packed_rows.supports(tiny_llama)  # the per-row calls would attend past the window
    monkeypatch.undo()
    monkeypatch.setattr(tiny_llama.config, "attention_dropout", 0.1)
    assert not packed_rows.supports(tiny_llama)
    monkeypatch.undo()
    monkeypatch.setattr(tiny_llama.config, "attn_logit_softcapping", 50.0, raising=False)
    assert not packed_rows.supports(tiny_llama)
