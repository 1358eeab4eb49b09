"""contrail's GRPO functions give TRL's numbers on the same batch.

Loss: compared against TRL 1.16's own ``trl.GRPOTrainer._compute_loss``
(trl/trainer/grpo_trainer.py), run on a real ``GRPOTrainer`` built offline
(a tiny random-init Llama saved to a tmp dir, a word-level tokenizer made
here). The trainer's per-token log-prob function
``_get_per_token_logps_and_entropies`` is replaced on the instance so that it
returns our fixed log-probs (a leaf tensor, so gradients can be compared too);
everything after it — ratio, clipping, k3, aggregation, entropy bonus — is
TRL's code. Matching settings:

=============================  =========================================================
TRL                            contrail ``policy_loss``
=============================  =========================================================
``loss_type="bnpo"``           ``aggregation="token-mean"``
``loss_type="dapo"``           ``"token-mean"`` (``num_items_in_batch`` = masked tokens)
``loss_type="grpo"``           ``"seq-mean-token-mean"`` (every row has a masked token:
                               TRL counts an empty row as a 0 in the mean, contrail skips it)
``loss_type="dr_grpo"``        ``"token-mean"`` with ``normalizer = batch · max_completion_length``
``epsilon`` / ``epsilon_high``  ``clip_low`` / ``clip_high``
``beta``                       ``beta``, with ``use_bias_correction_kl=False``: TRL 1.16
                               defaults to multiplying k3 by the ratio ρ (DeepSeek-V3.2),
                               contrail's k3 is the plain one (DeepSeekMath eq. 4)
``entropy_coef``               ``entropy_coef`` (token-mean only: TRL's bonus is always a
                               token mean, whatever the loss type)
=============================  =========================================================

Log-probs: ``trl.trainer.utils.selective_log_softmax`` and
``entropy_from_logits``. Advantages: TRL computes them inline in
``_generate_and_score_completions``; the test repeats its two lines with TRL's
exposed ``trl.trainer.utils.nanstd``.
"""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from trl.trainer.utils import entropy_from_logits, nanstd, selective_log_softmax  # noqa: E402

from contrail.grpo import group_advantages, policy_loss  # noqa: E402
from contrail.train.logprobs import selective_logprobs, token_entropy  # noqa: E402

BATCH, TOKENS, VOCAB = 4, 6, 32
MAX_COMPLETION_LENGTH = 8  # > TOKENS, so dr_grpo's constant differs from the padded width
TOL = 1e-6

@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """TRL's trainer leaves Accelerate's process-wide state behind (bf16 mixed precision among it);
    later trainers in this process would inherit it, so it is reset after each test."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-init Llama and a local word-level tokenizer, saved to disk."""
    path = tmp_path_factory.mktemp("tiny-llama")
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def make_trainer(model_dir, tmp_path, **loss_args):
    path, tokenizer = model_dir
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        num_generations=2,
        max_completion_length=MAX_COMPLETION_LENGTH,
        use_bias_correction_kl=False,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        **loss_args,
    )
    trainer = trl.GRPOTrainer(
        model=str(path),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["w1 w2", "w3 w4"]}),
        processing_class=tokenizer,
    )
    # What Trainer's training loop sets before the first step with no accumulation.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64) * 3
    # ratios spread over ~[0.55, 1.8]: well inside and outside both clip bounds
    old = logprobs + (torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64) - 0.5) * 1.2
    ref = logprobs + torch.randn(BATCH, TOKENS, generator=g, dtype=torch.float64) * 0.5
    entropy = torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64) * 2
    advantages = group_advantages(torch.rand(BATCH, generator=g, dtype=torch.float64), group_size=2)
    lengths = torch.tensor([6, 3, 1, 5])  # ragged completions, right-padded
    mask = (torch.arange(TOKENS).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return logprobs, old, ref, entropy, advantages, mask


def trl_loss(trainer, logprobs, old, ref, entropy, advantages, mask):
    """TRL's loss and its gradient w.r.t. the log-probs, with our log-probs injected."""
    leaf = logprobs.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, entropy, None)
    inputs = {
        "prompt_ids": torch.ones(BATCH, 2, dtype=torch.long),
        "prompt_mask": torch.ones(BATCH, 2, dtype=torch.long),
        "completion_ids": torch.full((BATCH, TOKENS), 3, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


CASES = [
    # (TRL loss_type, TRL args, contrail aggregation, extra contrail args)
    ("bnpo", dict(beta=0.0, epsilon=0.2), "token-mean", {}),
    ("bnpo", dict(beta=0.04, epsilon=0.2, epsilon_high=0.28), "token-mean", {}),
    ("dapo", dict(beta=0.0, epsilon=0.2, epsilon_high=0.28), "token-mean", {}),
    ("dapo", dict(beta=0.1, epsilon=0.1, epsilon_high=0.3), "token-mean", {}),
    ("grpo", dict(beta=0.0, epsilon=0.2), "seq-mean-token-mean", {}),
    ("grpo", dict(beta=0.04, epsilon=0.2, epsilon_high=0.28), "seq-mean-token-mean", {}),
    ("dr_grpo", dict(beta=0.04, epsilon=0.2), "token-mean", {"normalizer": BATCH * MAX_COMPLETION_LENGTH}),
    ("bnpo", dict(beta=0.04, epsilon=0.2, entropy_coef=0.01), "token-mean", {}),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_policy_loss_matches_trl_compute_loss(model_dir, tmp_path, case):
    loss_type, trl_args, aggregation, extra = CASES[case]
    trainer = make_trainer(model_dir, tmp_path, loss_type=loss_type, **trl_args)
    logprobs, old, ref, entropy, advantages, mask = random_batch(seed=case)

    expected, expected_grad, metrics = trl_loss(trainer, logprobs, old, ref, entropy, advantages, mask)

    leaf = logprobs.clone().requires_grad_()
    beta = trl_args["beta"]
    entropy_coef = trl_args.get("entropy_coef", 0.0)
    loss, stats = policy_loss(
        leaf,
        old,
        advantages,
        mask,
        clip_low=trl_args["epsilon"],
        clip_high=trl_args.get("epsilon_high", trl_args["epsilon"]),
        aggregation=aggregation,
        ref_logprobs=ref if beta else None,
        beta=beta,
        entropy=entropy,
        entropy_coef=entropy_coef,
        **extra,
    )
    loss.backward()

    print(f"{loss_type} {trl_args}: |loss diff| {abs(loss.item() - expected.item()):.2e}, "
          f"max |grad diff| {(leaf.grad - expected_grad).abs().max().item():.2e}")
    assert abs(loss.item() - expected.item()) < TOL
    assert (leaf.grad - expected_grad).abs().max().item() < TOL
    # the batch must exercise clipping, or the comparison proves little
    assert 0 < stats["clip_fraction"] < 1
    assert stats["clip_fraction"] == pytest.approx(metrics["clip_ratio/region_mean"], abs=TOL)
    assert stats["entropy_mean"] == pytest.approx(metrics["entropy"], abs=TOL)
    if beta:
        assert stats["kl_mean"] == pytest.approx(metrics["kl"], abs=TOL)


def test_selective_logprobs_and_entropy_match_trl():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 4
    targets = torch.randint(0, 40, (3, 5), generator=g)
    ours = selective_logprobs(logits, targets, chunk_size=4)
    assert (ours - selective_log_softmax(logits, targets)).abs().max() < TOL
    assert (token_entropy(logits, chunk_size=4) - entropy_from_logits(logits, chunk_size=4)).abs().max() < 1e-5
    # TRL returns bf16 for bf16 logits (log_softmax in bf16); contrail returns fp32 from an fp32
    # logsumexp, so TRL's values are contrail's rounded to bf16's 8-bit mantissa: within 2^-7 relative.
    low = logits.bfloat16()
    theirs = selective_log_softmax(low, targets).float()
    torch.testing.assert_close(selective_logprobs(low, targets), theirs, rtol=2**-7, atol=0)


def test_group_advantages_match_trl_formula():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.9, 0.9, 0.1])
    groups = rewards.view(-1, 4)
    # trl/trainer/grpo_trainer.py, _generate_and_score_completions, scale_rewards="group"
    mean = groups.mean(dim=1).repeat_interleave(4)
    std = nanstd(groups, dim=1).repeat_interleave(4)
    expected = (rewards - mean) / (std + 1e-4)
    assert (group_advantages(rewards, 4) - expected).abs().max() < TOL
    assert (group_advantages(rewards, 4, scale=False) - (rewards - mean)).abs().max() < TOL
