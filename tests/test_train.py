"""The masked-token trainer, demonstrations and behaviour cloning on tiny local models."""

from __future__ import annotations

import json

import pytest
import torch

from contrail.experiment import WarmStart
from contrail.testing import tiny_model, tiny_tokenizer
from contrail.train.config import TrainConfig
from contrail.train.demos import demonstrations
from contrail.train.trainer import (
    MIN_SHARED_PREFIX,
    CheckpointError,
    MaskedTokenTrainer,
    NonFiniteError,
    Sample,
    collate,
    cross_entropy_loss,
    pack_by_prompt,
    pack_by_tokens,
    shared_prefix_length,
)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def test_pack_by_tokens_respects_budget_and_keeps_every_sample():
    lengths = [5, 50, 7, 30, 12, 100, 3]
    groups = pack_by_tokens(lengths, budget=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert longest * len(group) <= 60 or len(group) == 1


def _loss(model, samples, tokenizer):
    batch = collate(samples, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        loss, _ = cross_entropy_loss(model, batch, float(batch.loss_mask.sum()))
    return float(loss)


def test_supervised_loss_falls_and_every_parameter_changes(tokenizer):
    model = tiny_model(tokenizer)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=8), tokenizer, use_cache=False)
    before = _loss(model, samples, tokenizer)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=3e-3, micro_batch_tokens=40))
    for _ in range(15):
        stats = trainer.step(samples, cross_entropy_loss)
    assert stats["micro_batches"] > 1  # the budget forced gradient accumulation
    after = _loss(trainer.unwrapped, samples, tokenizer)
    assert after < before * 0.5
    for name, parameter in trainer.unwrapped.named_parameters():
        assert not torch.equal(parameter.detach(), initial[name]), name


def test_micro_batching_gives_the_same_gradient_as_one_batch(tokenizer):
    samples, _ = demonstrations(WarmStart(envs=["magic", "magic-berry"], episodes=6), tokenizer, use_cache=False)
    grads = []
    for budget in (10_000, 40):
        model = tiny_model(tokenizer, seed=5)
        config = TrainConfig(lr=1e-3, micro_batch_tokens=budget, max_grad_norm=1e9)
        trainer = MaskedTokenTrainer(model, tokenizer, config)
        trainer.optimizer.step = lambda: None  # keep the gradient of the first step
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        stats = trainer.step(samples, cross_entropy_loss)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.unwrapped.parameters()]))
        assert (stats["micro_batches"] == 1) == (budget == 10_000)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_a_steps_per_token_stats_are_the_whole_batch_s_however_it_is_micro_batched(tokenizer):
    """Micro-batches weigh in by their learned tokens: one row learning 30 tokens counts 10x one learning 3."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, tokenizer.vocab_size, (20,), generator=generator).tolist()
    samples = []
    for learned in (3, 30, 5, 24):
        answer = torch.randint(5, tokenizer.vocab_size, (learned,), generator=generator).tolist()
        samples.append(Sample(ids=prompt + answer, mask=[0] * 20 + [1] * learned))
    nll = {}
    for budget in (10_000, 60):
        config = TrainConfig(lr=1e-3, micro_batch_tokens=budget)
        trainer = MaskedTokenTrainer(tiny_model(tokenizer, seed=5), tokenizer, config)
        stats = trainer.step(samples, cross_entropy_loss)
        nll[int(stats["micro_batches"])] = stats["nll_per_token"]
    one, split = sorted(nll)
    assert one == 1 and split > 1
    assert nll[split] == pytest.approx(nll[one], rel=1e-5)


def test_a_cpu_trainer_steps_with_the_fused_adamw_and_its_first_step_is_adam_s(tokenizer):
    """The fused kernel (one pass per tensor; bench/README.md) with AdamW's own semantics: after the decay,
    Adam's first step moves a weight by lr * g / (|g| + eps): never more than lr, and lr where |g| >> eps."""
    model = tiny_model(tokenizer)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=4), tokenizer, use_cache=False)
    lr, decay = 1e-3, 0.1
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=lr, weight_decay=decay))
    assert trainer.optimizer.defaults["fused"] is True
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    versions = [p._version for p in trainer.unwrapped.parameters()]
    trainer.step(samples, cross_entropy_loss)
    # The kernel bumps no version counter; the trainer does, for the vLLM sync (contrail.agent.vllm.fingerprint).
    assert all(p._version > v for p, v in zip(trainer.unwrapped.parameters(), versions))
    moved = 0
    for name, parameter in trainer.unwrapped.named_parameters():
        step = (parameter.detach() - before[name] * (1 - lr * decay)).abs()
        assert step.max() <= lr * 1.001, name
        moved += int((step > lr * 0.99).sum())
    assert moved > 0.9 * sum(p.numel() for p in before.values())


def test_ending_training_hands_the_heap_s_freed_pages_back_for_what_follows(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr("contrail.train.trainer.hand_back_freed_memory", lambda: calls.append("trim") or True)
    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(lr=1e-3))
    assert calls == []
    trainer.end()
    assert calls == ["trim"]


def test_lora_trains_only_adapters(tokenizer):
    pytest.importorskip("peft")
    model = tiny_model(tokenizer)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=4), tokenizer, use_cache=False)
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=1e-2, lora=True, lora_r=4))
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    trainer.step(samples, cross_entropy_loss)
    trainer.step(samples, cross_entropy_loss)
    for name, parameter in trainer.unwrapped.named_parameters():
        changed = not torch.equal(parameter.detach(), before[name])
        assert changed == ("lora_" in name), name


def test_under_bf16_autocast_lora_adapters_take_their_input_uncast_with_the_same_outputs(tokenizer):
    """PEFT's cast of a bf16 input up to the adapter's fp32 is a round trip under autocast: skipped, same logits."""
    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = tiny_model(tokenizer)
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lora=True, lora_r=4, precision="bf16"))
    layers = [m for m in trainer.unwrapped.modules() if isinstance(m, BaseTunerLayer)]
    ids = torch.tensor([[5, 9, 14, 7, 22, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = trainer.model(input_ids=ids).logits
    with trainer.autocast():
        assert layers and not any(layer.cast_input_dtype_enabled for layer in layers)
        logits = trainer.model(input_ids=ids).logits
    assert all(layer.cast_input_dtype_enabled for layer in layers)  # outside autocast PEFT casts as before
    assert torch.equal(logits, expected)


def test_full_weights_samples_from_the_lora_merged_model_and_restores_it(tokenizer):
    """Inside `full_weights` a LoRA model runs its merged weights (no adapter products) with the same outputs;
    on exit the base weights are back and the adapter is applied, and trains, as before."""
    pytest.importorskip("peft")
    from peft.tuners.lora import Linear as LoraLinear

    model = tiny_model(tokenizer)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=4), tokenizer, use_cache=False)
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=1e-2, lora=True, lora_r=4))
    trainer.step(samples, cross_entropy_loss)  # a trained adapter (B is no longer zero)
    ids = torch.tensor([samples[0].ids])
    peft_model = trainer.unwrapped
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids).logits
    base = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    with trainer.full_weights(), torch.no_grad():
        with trainer.full_weights():  # nested (a collect inside an evaluation): the outer one restores
            pass
        merged = peft_model(input_ids=ids).logits
        assert all(layer.merged for layer in peft_model.modules() if isinstance(layer, LoraLinear))
    assert torch.allclose(merged, unmerged, atol=1e-5)
    assert not any(layer.merged for layer in peft_model.modules() if isinstance(layer, LoraLinear))
    for name, parameter in peft_model.named_parameters():
        if name in base:
            assert torch.allclose(parameter, base[name], atol=1e-6), name
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, unmerged, atol=1e-5)
    assert trainer.step(samples, cross_entropy_loss)["loss"] > 0


def test_checkpoint_resume_continues_identically(tokenizer, tmp_path):
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=6), tokenizer, use_cache=False)
    config = TrainConfig(lr=1e-3, warmup_steps=4)

    straight = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, config)
    for _ in range(4):
        straight.step(samples, cross_entropy_loss)

    first = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, config)
    for _ in range(2):
        first.step(samples, cross_entropy_loss)
    first.save(tmp_path / "ckpt", extra={"note": "half"})
    from contrail.models import load_model

    model, tok = load_model(str(tmp_path / "ckpt"))
    resumed = MaskedTokenTrainer(model, tok, config)
    assert resumed.load_state(tmp_path / "ckpt") == {"note": "half"}
    assert resumed.global_step == 2
    for _ in range(2):
        resumed.step(samples, cross_entropy_loss)
    for a, b in zip(straight.unwrapped.parameters(), resumed.unwrapped.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_load_weights_copies_saved_weights_into_the_live_parameters(tokenizer, tmp_path):
    config = TrainConfig(lr=1e-3)
    saved = MaskedTokenTrainer(tiny_model(tokenizer, seed=1), tokenizer, config)
    saved.save_model(tmp_path / "model")
    live = MaskedTokenTrainer(tiny_model(tokenizer, seed=2), tokenizer, config)
    parameters = list(live.unwrapped.parameters())
    live.load_weights(tmp_path / "model")
    assert all(a is b for a, b in zip(parameters, live.unwrapped.parameters()))  # in place: the optimizer's own
    want, got = saved.unwrapped.state_dict(), live.unwrapped.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)
    assert live.unwrapped.lm_head.weight is live.unwrapped.model.embed_tokens.weight  # still tied


def test_load_weights_refuses_another_models_weights_and_changes_nothing(tokenizer, tmp_path):
    config = TrainConfig(lr=1e-3)
    MaskedTokenTrainer(tiny_model(tokenizer, layers=3), tokenizer, config).save_model(tmp_path / "deeper")
    MaskedTokenTrainer(tiny_model(tokenizer, hidden_size=48), tokenizer, config).save_model(tmp_path / "wider")
    live = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, config)
    before = {name: tensor.clone() for name, tensor in live.unwrapped.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"unexpected \['model.layers.2"):
        live.load_weights(tmp_path / "deeper")
    with pytest.raises(CheckpointError, match="of another shape"):
        live.load_weights(tmp_path / "wider")
    assert all(torch.equal(before[name], tensor) for name, tensor in live.unwrapped.state_dict().items())


def test_load_weights_takes_a_lora_adapter_in_place_and_refuses_one_of_another_rank(tokenizer, tmp_path):
    saved = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(lr=1e-2, lora=True, lora_r=4))
    saved.step([Sample(ids=list(range(3, 13)), mask=[0] * 4 + [1] * 6)], cross_entropy_loss)  # B moves off zero
    saved.save_model(tmp_path / "rank4")
    rank8 = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(lora=True, lora_r=8))
    rank8.save_model(tmp_path / "rank8")
    live = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(lr=1e-2, lora=True, lora_r=4))
    adapters = {name: p for name, p in live.unwrapped.named_parameters() if "lora_" in name}
    with pytest.raises(CheckpointError, match="of another shape"):
        live.load_weights(tmp_path / "rank8")
    live.load_weights(tmp_path / "rank4")
    want = {name: p for name, p in saved.unwrapped.named_parameters() if "lora_" in name}
    assert adapters.keys() == want.keys() and any(name.endswith("lora_B.default.weight") for name in want)
    assert all(adapters[name] is p for name, p in live.unwrapped.named_parameters() if "lora_" in name)
    assert all(torch.equal(adapters[name], want[name]) for name in want)


# --- configuration, non-finite updates, checkpoints ------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("lr", float("nan"), "lr must be a finite number"),
    ("lr", float("inf"), "lr must be a finite number"),
    ("lr", 0.0, "lr must be > 0"),
    ("lr", "1e-3", "lr must be a finite number"),
    ("weight_decay", -0.1, "weight_decay must be >= 0"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("warmup_steps", 1.5, "warmup_steps must be an integer"),
    ("max_grad_norm", 0.0, "max_grad_norm must be > 0"),
    ("max_grad_norm", float("inf"), "max_grad_norm must be a finite number"),
    ("micro_batch_tokens", 1, "micro_batch_tokens must be >= 2"),
    ("precision", "fp8", "precision must be one of auto, fp32, bf16"),
    ("lora", "yes", "lora must be true or false"),
    ("lora_r", 0, "lora_r must be >= 1"),
    ("lora_alpha", 0, "lora_alpha must be > 0"),
    ("lora_dropout", 1.0, r"lora_dropout must be in \[0, 1\)"),
    ("lora_dropout", -0.1, r"lora_dropout must be in \[0, 1\)"),
    ("lora_target_modules", "", "lora_target_modules must be a non-empty string"),
    ("max_nonfinite_steps", 0, "max_nonfinite_steps must be >= 1"),
])
def test_every_train_config_value_is_validated(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        TrainConfig(**{field: value})


def test_non_finite_steps_are_skipped_then_stop_training(tokenizer):
    model = tiny_model(tokenizer)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=4), tokenizer, use_cache=False)
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=1e-3, max_nonfinite_steps=2))
    before = [p.detach().clone() for p in trainer.unwrapped.parameters()]

    def nan_loss(model, batch, normalizer):
        loss, stats = cross_entropy_loss(model, batch, normalizer)
        return loss * float("nan"), stats

    stats = trainer.step(samples, nan_loss)
    assert stats["nonfinite_skipped"] == 1.0 and trainer.global_step == 0 and trainer.nonfinite_streak == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.unwrapped.parameters()))
    assert all(p.grad is None for p in trainer.unwrapped.parameters())  # nothing leaks into the next step
    assert "nonfinite_skipped" not in trainer.step(samples, cross_entropy_loss)
    assert trainer.nonfinite_streak == 0
    trainer.step(samples, nan_loss)
    with pytest.raises(NonFiniteError, match="2 updates in a row"):
        trainer.step(samples, nan_loss)


def test_trainer_state_is_tensors_and_json_and_rng_resumes_exactly(tokenizer, tmp_path):
    import random

    import numpy as np

    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(), seed=4)
    samples, _ = demonstrations(WarmStart(envs=["magic"], episodes=2), tokenizer, use_cache=False)
    trainer.step(samples, cross_entropy_loss)
    random.random(), np.random.rand(), torch.rand(1)  # move every RNG off its seed
    trainer.save(tmp_path / "ckpt", extra={"epoch": 3, "generator": torch.arange(4)})
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    assert set(state) == {"optimizer", "scheduler", "rng", "extra"}
    assert json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())["extra"] == {"epoch": 3}
    resumed = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(), seed=4)
    extra = resumed.load_state(tmp_path / "ckpt")
    assert extra["epoch"] == 3 and torch.equal(extra["generator"], torch.arange(4))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    with pytest.raises(TypeError, match="JSON serializable"):
        resumed.save(tmp_path / "bad", extra={"object": object()})


def test_a_crafted_trainer_state_is_refused_without_running_it(tokenizer, tmp_path):
    """`contrail sft` resumes from out/checkpoint by default: its trainer_state.pt must never run code."""
    import os

    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig())
    trainer.save(tmp_path / "checkpoint", extra={"epoch": 0})
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Exploit(), "scheduler": {}, "rng": {}, "extra": {}},
               tmp_path / "checkpoint" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="refused to load: not a tensors-only checkpoint"):
        trainer.load_state(tmp_path / "checkpoint")
    assert not marker.exists()
    (tmp_path / "checkpoint" / "trainer_state.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError):
        trainer.load_state(tmp_path / "checkpoint")


def test_non_finite_weights_are_never_saved(tokenizer, tmp_path):
    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig())
    with torch.no_grad():
        next(trainer.unwrapped.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to save non-finite weights"):
        trainer.save(tmp_path / "ckpt")
    with pytest.raises(NonFiniteError):
        trainer.save_model(tmp_path / "model")
    assert not (tmp_path / "ckpt" / "model").exists() and not (tmp_path / "model").exists()


def test_weights_finite_is_exact_when_finite_weights_sum_past_the_float_range(tokenizer):
    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig())
    weight = next(trainer.unwrapped.parameters())
    with torch.no_grad():
        weight[:2, :] = 3e38  # every element finite, their sum overflows to inf
    assert trainer.weights_finite()
    with torch.no_grad():
        weight[0, 0] = float("inf")
    assert not trainer.weights_finite()
    with torch.no_grad():
        weight.fill_(0.5)
        weight[-1, -1] = float("nan")
    assert not trainer.weights_finite()


def test_pack_by_prompt_keeps_a_prompt_together_and_counts_its_prefix_once():
    prompt = lambda k: [k] * 30  # noqa: E731 - three prompts of 30 ids
    samples = [Sample(prompt(k) + [7] * n, [0] * 30 + [1] * n) for k, n in
               [(1, 10), (2, 5), (1, 12), (3, 8), (2, 6), (1, 9), (3, 4), (2, 7), (3, 5)]]
    # a whole group costs 30 + 3 * (longest suffix) <= 30 + 36: it fits in 70, two groups do not
    groups = pack_by_prompt(samples, budget=70)
    assert sorted(i for g in groups for i in g) == list(range(len(samples)))
    assert len(groups) == 3
    for group in groups:
        assert len({samples[i].ids[0] for i in group}) == 1
        assert shared_prefix_length([samples[i] for i in group]) == 29  # the last shared id predicts the first trained
    assert shared_prefix_length(samples) == 0  # nothing shared across prompts
    short = [Sample([5] * MIN_SHARED_PREFIX + [1, 2], [0] * MIN_SHARED_PREFIX + [1, 1])] * 2
    assert shared_prefix_length(short) == 0  # MIN_SHARED_PREFIX - 1 ids: not worth a forward of their own


def test_pack_by_prompt_keeps_environments_apart_when_that_forwards_fewer_tokens():
    # Two environments' instructions (40 ids each), then a task of 5 ids and 10 trained ids.
    def demo(env, task):
        return Sample([env] * 40 + [task] * 5 + [7] * 10, [0] * 45 + [1] * 10)

    samples = [demo(env, task) for task in (11, 12, 13) for env in (1, 2)]
    groups = pack_by_prompt(samples, budget=10_000)  # room for all in one, sharing nothing
    assert len(groups) == 2
    for group in groups:
        assert len({samples[i].ids[0] for i in group}) == 1
        assert shared_prefix_length([samples[i] for i in group]) == 40


def test_pack_by_prompt_packed_counts_each_rows_own_tokens_and_keeps_groups_whole():
    # Two groups (a 1-turn success beside 3-turn failures), prompts sharing their first 50 of 60 ids.
    def episode(task, own):
        prompt = [1] * 50 + [task] * 10
        return Sample(prompt + [7] * own, [0] * 60 + [1] * own)

    samples = [episode(task, own) for task in (2, 3) for own in (5, 5, 5, 90)]
    padded = pack_by_prompt(samples, budget=10_000)
    packed = pack_by_prompt(samples, budget=10_000, packed=True)
    assert sorted(i for g in packed for i in g) == list(range(len(samples)))
    # Padded, a long episode would cost its group's other rows 85 pads each: it is forwarded alone.
    assert sorted(map(len, padded)) == [1, 1, 3, 3]
    # Packed, each group is one micro-batch forwarding its prompt once (59 ids; each row's own 6, 6, 6, 91), and the
    # groups stay apart: together they would forward the 10 ids they do not share once per row (their first
    # rows, one at a time, would have joined: each costs its own ids either way).
    assert sorted(sorted(g) for g in packed) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for group in packed:
        assert shared_prefix_length([samples[i] for i in group]) == 59
    # The budget still bounds a micro-batch's forwarded tokens, counted without padding.
    assert [len(g) for g in pack_by_prompt(samples[:4], budget=59 + 3 * 6, packed=True)] == [3, 1]


def test_pack_by_prompt_packed_keeps_an_environments_demonstrations_apart_from_another_sharing_a_header():
    # Demonstrations open with a chat header every environment shares (20 ids), then their environment's
    # instructions (40 ids), a task (5 ids) and 10 trained ids: one of environment 1, three of environment 2.
    def demo(env, task):
        return Sample([9] * 20 + [env] * 40 + [task] * 5 + [7] * 10, [0] * 65 + [1] * 10)

    samples = [demo(1, 11), demo(2, 11), demo(2, 12), demo(2, 13)]
    groups = pack_by_prompt(samples, budget=10_000, packed=True)
    # Joined, all four would share only the header: 20 + 4 * 55 = 240 ids. Apart: 75, and 60 + 3 * 15 = 105.
    assert sorted(sorted(g) for g in groups) == [[0], [1, 2, 3]]
    assert shared_prefix_length([samples[i] for i in groups[-1]]) == 60
