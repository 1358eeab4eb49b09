"""GRPO advantages and loss, checked against values worked out by hand.

Most cases use 2 sequences × 3 tokens whose ratios ρ = exp(logπ - logπ_old)
are chosen directly (logprobs = old + log ρ), so every per-token term can be
read off: -min(ρA, clip(ρ)A).
"""

import math

import pytest
import torch

from contrail.grpo import group_advantages, loss_normalizer, policy_loss

# ---------------------------------------------------------------- advantages


def test_advantages_two_groups_use_sample_std():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], group_size=2)
    # group [1, 0]: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]))


def test_advantages_group_of_three_scaled_and_centred():
    rewards = torch.tensor([1.0, 2.0, 6.0])
    # mean 3, deviations (-2, -1, 3), sample variance (4 + 1 + 9) / 2 = 7
    expected = torch.tensor([-2.0, -1.0, 3.0]) / (math.sqrt(7.0) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 3), expected)
    torch.testing.assert_close(group_advantages(rewards, 3, scale=False), torch.tensor([-2.0, -1.0, 3.0]))


def test_advantages_custom_eps():
    adv = group_advantages([0.0, 2.0], 2, eps=1.0)
    # std sqrt(2), deviations ∓1
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]) / (math.sqrt(2.0) + 1.0))


@pytest.mark.parametrize("scale", [True, False])
def test_equal_rewards_give_exact_zero(scale):
    # 0.1 is not exactly representable: mean(0.1, 0.1, 0.1) - 0.1 is not 0 in float
    adv = group_advantages([0.1, 0.1, 0.1, 1.0, 0.0, 0.5], 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert not torch.isnan(adv).any()
    assert adv[3] > 0 and adv[4] < 0 and adv[5] == 0


@pytest.mark.parametrize("scale", [True, False])
def test_group_of_one_gets_zero_advantage(scale):
    adv = group_advantages([0.3, 5.0, -1.0], 1, scale=scale)
    assert torch.equal(adv, torch.zeros(3))


def test_advantages_accept_tensor_and_keep_float64():
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2)
    assert adv.dtype == torch.float64
    assert group_advantages([0, 1], 2).dtype == torch.float32  # ints become float32


@pytest.mark.parametrize(
    "rewards, group_size, message",
    [
        ([1.0, 2.0, 3.0], 2, "multiple of group_size"),
        ([1.0, 2.0], 0, "group_size"),
        ([1.0, 2.0], 1.5, "group_size"),
        ([[1.0, 2.0]], 2, "1-D"),
        ([1.0, float("nan")], 2, "NaN"),
    ],
)
def test_advantages_bad_input(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


# ---------------------------------------------------------------- loss helpers

OLD = -1.0


def batch(ratios, advantages, mask=None):
    """logprobs with exactly the given ratios to old logprobs of -1."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    old = torch.full_like(ratios, OLD)
    logprobs = (old + ratios.log()).requires_grad_()
    mask = torch.ones_like(ratios, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    return logprobs, old, torch.tensor(advantages, dtype=torch.float64), mask


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- loss values


def test_unclipped_region_both_aggregations():
    lp, old, adv, mask = batch([[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]], [2.0, -1.0], mask=[[1, 1, 1], [1, 0, 0]])
    # seq 0 (A=2): -2.2, -1.8, -2.0;  seq 1 (A=-1): +1 (one masked token)
    loss, stats = policy_loss(lp, old, adv, mask, aggregation="token-mean")
    close(loss, (-2.2 - 1.8 - 2.0 + 1.0) / 4)
    loss, _ = policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean")
    close(loss, (-6.0 / 3 + 1.0) / 2)
    assert stats["clip_fraction"] == 0.0
    assert stats["tokens"] == 4.0
    assert stats["ratio_mean"] == pytest.approx((1.1 + 0.9 + 1.0 + 1.0) / 4)
    assert stats["kl_mean"] == 0.0
    assert "entropy_mean" not in stats


def test_clipped_region_positive_and_negative_advantages():
    lp, old, adv, mask = batch([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]], [2.0, -1.0])
    # A=2,  ρ=1.5: -min(3.0, 1.2·2)  = -2.4  clipped
    # A=2,  ρ=0.5: -min(1.0, 0.8·2)  = -1.0  (pessimistic: unclipped term)
    # A=2,  ρ=1.0: -2.0
    # A=-1, ρ=0.5: -min(-0.5, -0.8) = 0.8   clipped
    # A=-1, ρ=1.5: -min(-1.5, -1.2) = 1.5   (unclipped)
    # A=-1, ρ=1.0: 1.0
    loss, stats = policy_loss(lp, old, adv, mask)
    close(loss, (-2.4 - 1.0 - 2.0 + 0.8 + 1.5 + 1.0) / 6)
    assert stats["clip_fraction"] == pytest.approx(2 / 6)


def test_gradient_by_hand():
    lp, old, adv, mask = batch([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]], [2.0, -1.0])
    loss, _ = policy_loss(lp, old, adv, mask)
    loss.backward()
    # d(-ρA)/dlogπ = -ρA on unclipped tokens, 0 where the clipped (constant) term won; / 6 tokens
    expected = torch.tensor([[0.0, -0.5 * 2, -1.0 * 2], [0.0, 1.5, 1.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(lp.grad, expected)


def test_asymmetric_clip_high():
    lp, old, adv, mask = batch([[1.25, 1.5, 1.0], [0.5, 1.0, 1.0]], [2.0, -1.0])
    # clip range [0.8, 1.28]:  1.25 stays (-2.5), 1.5 → 1.28 (-2.56), 0.5 → 0.8 for A<0 (+0.8)
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, (-2.5 - 2.56 - 2.0 + 0.8 + 1.0 + 1.0) / 6)
    assert stats["clip_fraction"] == pytest.approx(2 / 6)
    # symmetric 0.2 would clip 1.25 too: -2.4
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(loss, (-2.4 - 2.4 - 2.0 + 0.8 + 1.0 + 1.0) / 6)
    assert stats["clip_fraction"] == pytest.approx(3 / 6)


def test_masked_tokens_contribute_nothing_even_if_garbage():
    lp, old, adv, mask = batch([[1.1, 0.9, 1.0], [1.0, 1.2, 1.0]], [2.0, -1.0], mask=[[1, 1, 0], [0, 1, 1]])
    clean_loss, clean_stats = policy_loss(lp, old, adv, mask, ref_logprobs=old, beta=0.1)
    clean_loss.backward()
    clean_grad = lp.grad.clone()

    dirty_lp = lp.detach().clone()
    dirty_old, dirty_ref = old.clone(), old.clone()
    dirty_lp[0, 2], dirty_lp[1, 0] = float("-inf"), float("nan")
    dirty_old[0, 2], dirty_old[1, 0] = float("inf"), float("-inf")
    dirty_ref[0, 2], dirty_ref[1, 0] = float("nan"), float("inf")
    dirty_lp.requires_grad_()
    loss, stats = policy_loss(dirty_lp, dirty_old, adv, mask, ref_logprobs=dirty_ref, beta=0.1)
    loss.backward()

    torch.testing.assert_close(loss, clean_loss)
    assert stats == pytest.approx(clean_stats)
    assert torch.isfinite(dirty_lp.grad).all()
    torch.testing.assert_close(dirty_lp.grad, clean_grad)
    assert dirty_lp.grad[0, 2] == 0 and dirty_lp.grad[1, 0] == 0
    # The value: A=2 → -2.2, -1.8; A=-1 → -min(-1.2, -1.2) = 1.2, 1.0. ref = old sits at
    # d = ref - logπ = -log ρ, so k3 = e^d - d - 1 = 1/ρ + log ρ - 1 on each masked token.
    k3 = sum(1 / r + math.log(r) - 1 for r in (1.1, 0.9, 1.2, 1.0))
    close(loss, (-2.2 - 1.8 + 1.2 + 1.0 + 0.1 * k3) / 4)


def test_kl_penalty_k3_values():
    ln2 = math.log(2.0)
    lp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    ref = lp.detach() + torch.tensor([[ln2, -ln2, 0.0], [0.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.zeros(2, dtype=torch.float64)  # isolate the KL term
    # k3(d) = e^d - d - 1:  d=ln2 → 1 - ln2,  d=-ln2 → ln2 - 1/2,  d=0 → 0;  sum 1/2
    loss, stats = policy_loss(lp, lp.detach(), adv, mask, ref_logprobs=ref, beta=0.1)
    close(loss, 0.1 * 0.5 / 4)
    assert stats["kl_mean"] == pytest.approx(0.5 / 4)
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, aggregation="seq-mean-token-mean", ref_logprobs=ref, beta=0.1)
    close(loss, 0.1 * (0.5 / 3 + 0.0) / 2)
    loss.backward()
    # d k3 / d logπ = 1 - e^d (d = ref - logπ), times β / (2 sequences · 3 or 1 tokens)
    expected = torch.tensor([[1 - 2.0, 1 - 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64) * 0.1 / 6
    torch.testing.assert_close(lp.grad, expected)


def test_kl_reported_without_penalty_when_beta_zero():
    lp, old, adv, mask = batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [1.0, -1.0])
    ref = lp.detach() + math.log(2.0)
    loss0, _ = policy_loss(lp, old, adv, mask)
    loss, stats = policy_loss(lp, old, adv, mask, ref_logprobs=ref, beta=0.0)
    torch.testing.assert_close(loss, loss0)
    assert stats["kl_mean"] == pytest.approx(1 - math.log(2.0))


def test_entropy_bonus():
    lp, old, adv, mask = batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [0.0, 0.0], mask=[[1, 1, 0], [1, 0, 0]])
    entropy = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]], dtype=torch.float64)
    loss, stats = policy_loss(lp, old, adv, mask, entropy=entropy, entropy_coef=0.01)
    close(loss, -0.01 * (1.0 + 2.0 + 3.0) / 3)
    assert stats["entropy_mean"] == pytest.approx(2.0)
    loss, _ = policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean", entropy=entropy, entropy_coef=0.01)
    close(loss, -0.01 * (1.5 + 3.0) / 2)
    # entropy given for logging only: no effect on the loss
    loss, stats = policy_loss(lp, old, adv, mask, entropy=entropy)
    close(loss, 0.0)
    assert stats["entropy_mean"] == pytest.approx(2.0)


def test_seq_mean_skips_sequences_without_tokens():
    lp, old, adv, mask = batch([[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]], [2.0, -1.0], mask=[[1, 1, 0], [0, 0, 0]])
    loss, stats = policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean")
    close(loss, (-2.2 - 1.8) / 2)  # seq 0's mean, not halved by the empty seq 1
    assert stats["tokens"] == 2.0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_no_masked_tokens_gives_zero_not_nan(aggregation):
    lp, old, adv, mask = batch([[1.1, 0.9, 1.0], [1.0, 1.0, 1.0]], [2.0, -1.0], mask=[[0, 0, 0], [0, 0, 0]])
    loss, stats = policy_loss(lp, old, adv, mask, aggregation=aggregation)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))
    assert stats == {"clip_fraction": 0.0, "ratio_mean": 0.0, "kl_mean": 0.0, "tokens": 0.0}


def test_float_mask_and_bf16_logprobs():
    lp, old, adv, mask = batch([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]], [2.0, -1.0])
    expected, _ = policy_loss(lp, old, adv, mask)
    loss, _ = policy_loss(lp.float(), old.float(), adv.float(), mask.float())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss, _ = policy_loss(lp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask.long())
    assert loss.dtype == torch.float32  # computed in fp32 even from bf16 inputs
    assert loss.item() == pytest.approx(expected.item(), abs=2e-2)


# ---------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_normalizer_makes_micro_batches_add_up(aggregation):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = lp.detach() + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3
    ref = lp.detach() + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    ).bool()

    def loss_of(rows, normalizer=None):
        return policy_loss(
            lp[rows], old[rows], adv[rows], mask[rows], clip_high=0.28, aggregation=aggregation,
            ref_logprobs=ref[rows], beta=0.04, normalizer=normalizer,
        )[0]

    full = loss_of(slice(None))
    (full_grad,) = torch.autograd.grad(full, lp)

    # 5 + 2 + 0 + 1 + 3 + 4 = 15 masked tokens; 5 sequences with a token (row 2 is empty)
    normalizer = loss_normalizer(mask, aggregation)
    assert normalizer == (15.0 if aggregation == "token-mean" else 5.0)
    parts = [slice(0, 2), slice(2, 5), slice(5, 6)]
    assert loss_normalizer([mask[p] for p in parts], aggregation) == normalizer

    total = sum(loss_of(p, normalizer) for p in parts)
    (split_grad,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)
    # the reason for the normalizer: averaging the micro-batches' own means is another number
    naive = sum(loss_of(p) for p in parts) / len(parts)
    assert abs(naive.item() - full.item()) > 1e-3


# ---------------------------------------------------------------- validation


def test_bad_inputs_raise_clear_errors():
    lp, old, adv, mask = batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [1.0, -1.0])
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(lp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(lp, old, adv, mask[:1])
    with pytest.raises(ValueError, match=r"advantages must be \(batch,\)"):
        policy_loss(lp, old, adv.unsqueeze(1), mask)
    with pytest.raises(ValueError, match=r"\(batch, tokens\)"):
        policy_loss(lp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match="unknown aggregation 'seq-mean'"):
        policy_loss(lp, old, adv, mask, aggregation="seq-mean")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        policy_loss(lp, old, adv, mask, ref_logprobs=old[:1], beta=0.1)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(lp, old, adv, mask, entropy_coef=0.01)
    with pytest.raises(ValueError, match="only 0 and 1"):
        policy_loss(lp, old, adv, mask.long() * 2)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(lp, old, adv, mask, normalizer=0.0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        loss_normalizer(mask, "sum")
