"""Token bookkeeping of batched multi-turn rollouts, on tiny local models."""

from __future__ import annotations

import pytest
import torch

from contrail.agent import (
    ChatFormat,
    Generation,
    HFBackend,
    RolloutConfig,
    SamplingParams,
    play,
    rollout,
    start_episodes,
)
from contrail.envs.base import Step, Task
from contrail.testing import MagicWordEnv, tiny_model


@pytest.fixture(scope="module")
def chat(tokenizer):  # tokenizer: the tiny one of tests/conftest.py
    return ChatFormat.from_tokenizer(tokenizer)


class ScriptedBackend:
    """Replies with fixed texts, encoded canonically and ended by the stop token."""

    def __init__(self, tokenizer, chat, replies):
        self.tokenizer, self.chat, self.replies = tokenizer, chat, list(replies)
        self.calls = 0

    def generate(self, prompts, params):
        reply = self.replies[self.calls]
        self.calls += 1
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.chat.assistant_close_ids[0]]
        return [Generation(ids, [-0.5] * len(ids), stopped=True) for _ in prompts]


def easy_tasks(n=1):
    return MagicWordEnv().tasks("test", "easy")[:n]


def test_ids_equal_the_chat_template_rendering_of_the_conversation(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["berry", "cherry", "apple"])
    [traj] = rollout(backend, chat, easy_tasks(), lambda t: MagicWordEnv())
    assert traj.success and traj.turns == 3
    rendered = tokenizer.apply_chat_template(traj.messages, tokenize=False, add_generation_prompt=False)
    assert traj.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_mask_is_one_exactly_on_sampled_tokens(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["berry", "apple"])
    [traj] = rollout(backend, chat, easy_tasks(), lambda t: MagicWordEnv())
    sampled = [i for i, m in enumerate(traj.mask) if m]
    expected = []
    for reply in ("berry", "apple"):
        expected += tokenizer(reply, add_special_tokens=False)["input_ids"] + [chat.assistant_close_ids[0]]
    assert [traj.ids[i] for i in sampled] == expected
    assert traj.generated_tokens == len(expected) == sum(traj.mask)
    assert all((lp != 0) == bool(m) for lp, m in zip(traj.logprobs, traj.mask))
    assert len(traj.ids) == len(traj.mask) == len(traj.logprobs)


def test_invalid_outputs_are_counted_and_fed_back(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["hello", "grape", "lemon"])
    [traj] = rollout(backend, chat, easy_tasks(), lambda t: MagicWordEnv())
    assert traj.turns == 3 and not traj.success and traj.reward == 0
    assert traj.invalid_actions == 1
    assert traj.messages[-2]["content"] == "wrong . try again"  # the environment's own message


def test_turns_cut_at_the_token_limit_are_counted_and_marked(tokenizer, chat):
    class CutsSecondTurn(ScriptedBackend):  # its 2nd reply runs into the limit: no stop id, not stopped
        def generate(self, prompts, params):
            [generation] = super().generate(prompts, params)
            if self.calls != 2:
                return [generation]
            return [Generation(generation.ids[:-1], generation.logprobs[:-1], stopped=False)]

    backend = CutsSecondTurn(tokenizer, chat, ["berry", "cherry", "apple"])
    [traj] = rollout(backend, chat, easy_tasks(), lambda t: MagicWordEnv())
    assert traj.turns == 3 and traj.success
    assert traj.cut_turns == 1 and traj.cut_rate == pytest.approx(1 / 3)
    judged = [m for m in traj.messages if m["role"] == "assistant" and "valid" in m]
    assert [m.get("cut", False) for m in judged] == [False, True, False]
    assert traj.to_record()["cut_turns"] == 1
    # The template still closes the cut turn, so the ids stay the conversation's rendering.
    rendered = tokenizer.apply_chat_template(traj.messages, tokenize=False, add_generation_prompt=False)
    assert traj.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def random_policy(tokenizer, chat):
    model = tiny_model(tokenizer, seed=1)
    return model, HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=0)


def test_random_model_rollouts_keep_sampled_ids_and_logprobs(tokenizer, chat, random_policy):
    model, backend = random_policy
    config = RolloutConfig(max_new_tokens=6, max_episode_tokens=256)
    trajectories = rollout(backend, chat, easy_tasks(4) * 2, lambda t: MagicWordEnv(), config)
    for traj in trajectories:
        assert sum(traj.mask) == traj.generated_tokens > 0
        assert traj.turns <= 3
        # The sampler's log-probs equal the model's log-probs of those ids (temperature 1).
        ids = torch.tensor([traj.ids])
        with torch.no_grad():
            logits = model(ids).logits.log_softmax(-1)[0]
        for position, (token, flag, lp) in enumerate(zip(traj.ids, traj.mask, traj.logprobs)):
            if flag:
                assert lp == pytest.approx(logits[position - 1, token].item(), abs=1e-4)


def test_per_turn_token_limit_cuts_turns_and_closes_them(tokenizer, chat, random_policy):
    _, backend = random_policy
    config = RolloutConfig(max_new_tokens=2, max_episode_tokens=256, temperature=1.0)
    for traj in rollout(backend, chat, easy_tasks(6), lambda t: MagicWordEnv(), config):
        runs, current = [], 0
        for flag in traj.mask + [0]:
            if flag:
                current += 1
            elif current:
                runs.append(current)
                current = 0
        assert runs and max(runs) <= 2
        assert len(runs) == traj.turns


def test_episode_token_limit_truncates(tokenizer, chat, random_policy):
    _, backend = random_policy
    config = RolloutConfig(max_new_tokens=4, max_episode_tokens=60)
    trajectories = rollout(backend, chat, easy_tasks(4), lambda t: MagicWordEnv(), config)
    for traj in trajectories:
        assert len(traj.ids) <= 60
    assert any(t.truncated for t in trajectories if not t.success)


def test_turn_limit_override(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["grape"] * 5)
    [traj] = rollout(backend, chat, easy_tasks(), lambda t: MagicWordEnv(), RolloutConfig(max_turns=2))
    assert traj.turns == 2 and not traj.truncated and traj.error is None


def test_turn_limit_override_can_exceed_the_environments_own_limit(tokenizer, chat):
    """Hard magic tasks allow 1 turn; the rollout's max_turns replaces that limit for the episode."""
    hard = MagicWordEnv().tasks("test", "hard")[:1]
    backend = ScriptedBackend(tokenizer, chat, ["grape", "lemon", "berry", "mango"])
    [own] = rollout(backend, chat, hard, lambda t: MagicWordEnv())
    assert own.turns == 1 and own.error is None
    backend = ScriptedBackend(tokenizer, chat, ["grape", "lemon", "apple", "mango"])
    [longer] = rollout(backend, chat, hard, lambda t: MagicWordEnv(), RolloutConfig(max_turns=4))
    assert longer.turns == 3 and longer.success and longer.error is None


def test_an_environment_that_cannot_be_built_fails_its_episode_not_the_rollout(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["apple"])
    tasks = easy_tasks(3)

    def make(task):
        if task == tasks[1]:
            raise OSError("the game files are missing")
        return MagicWordEnv()

    first, broken, last = rollout(backend, chat, tasks, make)
    assert broken.error == "OSError: the game files are missing" and broken.reward == 0 and not broken.success
    assert broken.turns == 0 and broken.messages[-1]["role"] == "error"
    assert first.success and last.success and first.error is None is last.error


def test_same_seed_same_trajectories(tokenizer, chat):
    model = tiny_model(tokenizer, seed=1)
    runs = []
    for _ in range(2):
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=7)
        runs.append(rollout(backend, chat, easy_tasks(3), lambda t: MagicWordEnv(), RolloutConfig(max_new_tokens=5)))
    assert [t.ids for t in runs[0]] == [t.ids for t in runs[1]]


class ExplodingEnv(MagicWordEnv):
    def on_step(self, text: str) -> Step:
        raise ConnectionError("environment server died")


def test_an_environment_that_dies_fails_its_episode_not_the_batch(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["apple"])
    tasks = easy_tasks(2)
    make = lambda task: ExplodingEnv() if task == tasks[0] else MagicWordEnv()  # noqa: E731
    broken, healthy = rollout(backend, chat, tasks, make)
    assert broken.error and "environment server died" in broken.error and broken.reward == 0
    assert healthy.success and healthy.error is None


def test_left_padded_batch_matches_single_prompt_greedy(tokenizer, chat, random_policy):
    model, _ = random_policy
    backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id)
    short = chat.prompt_ids([{"role": "user", "content": "say the word ."}])
    long = chat.prompt_ids([{"role": "user", "content": "say the word . what is your task ? say one word ."}])
    params = SamplingParams(max_new_tokens=5, temperature=0)
    batched = backend.generate([short, long], params)
    alone = [backend.generate([p], params)[0] for p in (short, long)]
    assert [g.ids for g in batched] == [g.ids for g in alone]
    for b, a in zip(batched, alone):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("max_episode_tokens", -1), ("max_turns", 0),
    ("max_turns", True), ("temperature", -0.1), ("temperature", float("inf")), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.5), ("top_p", float("nan")),
])
def test_rollout_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        RolloutConfig(**{field: value})


def test_rollout_config_needs_room_for_a_turn_and_keywords():
    with pytest.raises(ValueError, match="^max_episode_tokens"):
        RolloutConfig(max_new_tokens=64, max_episode_tokens=32)
    with pytest.raises(TypeError):
        RolloutConfig(64, 256)  # keyword use only: a positional 1.0 cannot land in the wrong field


def test_task_is_recorded(tokenizer, chat):
    backend = ScriptedBackend(tokenizer, chat, ["apple"])
    [traj] = rollout(backend, chat, [Task("magic", 10_000, "test", "easy")], lambda t: MagicWordEnv())
    record = traj.to_record()
    assert record["task"] == {"env": "magic", "id": 10_000, "split": "test", "difficulty": "easy"}
    assert record["success"] is True and record["messages"][-1]["role"] == "assistant"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kept_kv_cache_gives_the_same_episodes_as_full_recomputation(tokenizer, chat, random_policy, temperature):
    model, _ = random_policy
    config = RolloutConfig(max_new_tokens=4, max_episode_tokens=256, temperature=temperature)
    tasks = easy_tasks(5)
    results = []
    for reuse in (True, False):
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=11, reuse_cache=reuse)
        results.append(rollout(backend, chat, tasks, lambda t: MagicWordEnv(), config))
    kept, recomputed = results
    assert max(t.turns for t in kept) > 1  # later turns really reused the cache
    assert [t.ids for t in kept] == [t.ids for t in recomputed]
    for a, b in zip(kept, recomputed):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_cache_is_reused_only_for_extending_prompts(tokenizer, chat, random_policy):
    model, _ = random_policy
    backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=3, temperature=0)
    prompt = chat.prompt_ids([{"role": "user", "content": "say the word ."}])
    first = backend.generate([prompt, prompt + [5]], params)
    assert backend._session is not None and len(backend._session.known) == 2
    # The next turn of the second episode only: the first row is dropped, the second extended.
    follow = prompt + [5] + first[1].ids + chat.close_after(first[1].ids) + chat.user_turn_ids("try again")
    [kept] = backend.generate([follow], params)
    fresh = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, reuse_cache=False)
    [recomputed] = fresh.generate([follow], params)
    assert kept.ids == recomputed.ids
    assert kept.logprobs == pytest.approx(recomputed.logprobs, abs=1e-4)


def test_a_next_turn_that_fits_the_kept_buffer_appends_in_place_without_a_copy(tokenizer, chat, random_policy,
                                                                              monkeypatch):
    import contrail.agent.backend as backend_module

    model, _ = random_policy
    backend = HFBackend(model, frozenset(), tokenizer.pad_token_id)  # no stop id: no row is parked
    params = SamplingParams(max_new_tokens=3, temperature=0)
    prompts = [chat.prompt_ids([{"role": "user", "content": f"say the word {word} ."}]) for word in ("a", "b c")]
    first = backend.generate(prompts, params)
    buffer = backend._session.pieces[0].cache.layers[0]._buffers[1].data_ptr()
    monkeypatch.setattr(backend_module, "_assembled", lambda *a, **k: pytest.fail("copied the kept cache"))
    follow = [p + g.ids + [5] for p, g in zip(prompts, first)]  # a short next turn: fits the buffer's headroom
    kept = backend.generate(follow, params)
    assert backend._session.pieces[0].cache.layers[0]._buffers[1].data_ptr() == buffer
    monkeypatch.undo()
    fresh = HFBackend(model, frozenset(), tokenizer.pad_token_id, reuse_cache=False)
    recomputed = fresh.generate(follow, params)
    assert [g.ids for g in kept] == [g.ids for g in recomputed]


def _shared_prefix_prompts(chat):
    instructions = "you play a word game . " * 12  # every prompt opens with these
    prompts = [chat.prompt_ids([{"role": "user", "content": instructions + ask}])
               for ask in ("say the word .", "say the word . what is your task ?", "say one word .")]
    return [prompts[0], prompts[1], prompts[0], prompts[2], prompts[1]]  # groups of identical prompts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefix_prefill_samples_what_row_by_row_prefill_samples(tokenizer, chat, random_policy, temperature):
    model, _ = random_policy
    prompts = _shared_prefix_prompts(chat)
    params = SamplingParams(max_new_tokens=6, temperature=temperature)
    results = []
    for share in (True, False):
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=3, share_prefix=share)
        results.append(backend.generate(prompts, params))
    shared, plain = results
    assert [g.ids for g in shared] == [g.ids for g in plain]
    for a, b in zip(shared, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_shared_prefix_whose_rests_fall_in_several_buckets_is_extended_from_an_intact_copy(tokenizer, chat,
                                                                                          random_policy):
    """The prefix's cache feeds every bucket: a one-prompt bucket must not extend it in place (a later bucket
    would read the prefix with that prompt's tokens appended)."""
    model, _ = random_policy
    instructions = "you play a word game . " * 12
    prompts = [chat.prompt_ids([{"role": "user", "content": instructions + rest}])
               for rest in ("go .", "say the word . " * 40)]  # rests of 5 and 163 ids: two buckets, short first
    params = SamplingParams(max_new_tokens=6, temperature=0)
    shared = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, share_prefix=True).generate(prompts, params)
    plain = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, share_prefix=False).generate(prompts, params)
    assert [g.ids for g in shared] == [g.ids for g in plain]
    for a, b in zip(shared, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_turn_in_several_buckets_copies_each_row_once_and_extends_the_buckets_in_place(tokenizer, chat,
                                                                                        random_policy, monkeypatch):
    """Each bucket's rows are copied once into the turn's cache, ending where that bucket's new tokens begin,
    and each bucket's forward writes into that cache: no join copies the buckets' caches afterwards."""
    from contrail.agent.kv_cache import GrowingLayer

    model, _ = random_policy
    copies = []  # rows assembled, one entry per layer copied
    real_assemble = GrowingLayer.assemble

    def assemble(self, rows, width, room=0, ends=None):
        copies.append(len(rows))
        return real_assemble(self, rows, width, room, ends)

    monkeypatch.setattr(GrowingLayer, "assemble", assemble)
    instructions = "you play a word game . " * 12
    prompts = [chat.prompt_ids([{"role": "user", "content": instructions + rest}])
               for rest in ("go .", "say the word . " * 40, "go on .", "say the word . " * 38)]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    backend = HFBackend(model, frozenset(), tokenizer.pad_token_id)  # no stop id: every row decodes to the end
    first = backend.generate(prompts, params)
    layers = len(model.model.layers)
    assert copies == [len(prompts)] * layers  # the shared prefix's row, copied once per row; nothing joined
    follow = [p + g.ids + chat.user_turn_ids(text) for p, g, text in
              zip(prompts, first, ("ok", "the word is " * 40, "fine", "the word was " * 35))]
    copies.clear()
    kept = backend.generate(follow, params)
    assert copies == [len(prompts)] * layers  # two buckets again, one copy of each row
    monkeypatch.undo()
    plain = HFBackend(model, frozenset(), tokenizer.pad_token_id, reuse_cache=False, share_prefix=False)
    assert [g.ids for g in first] == [g.ids for g in plain.generate(prompts, params)]
    recomputed = plain.generate(follow, params)
    assert [g.ids for g in kept] == [g.ids for g in recomputed]
    for a, b in zip(kept, recomputed):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_shared_prefix_prefill_runs_the_shared_part_once(tokenizer, chat, random_policy):
    model, _ = random_policy
    prompts = _shared_prefix_prompts(chat)
    backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id)
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    try:
        backend.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0))
    finally:
        hook.remove()
    shared = min(len(p) for p in prompts) - 1
    while len({tuple(p[:shared]) for p in prompts}) > 1:
        shared -= 1
    assert fed[0] == (1, shared)  # the shared instructions, once
    assert fed[1][0] == 3  # then each distinct prompt's rest, once
    assert all(shape[0] == len(prompts) for shape in fed[2:])  # and every row decodes


def test_prompts_of_two_environments_are_prefilled_in_two_clusters(tokenizer, chat, random_policy):
    model, _ = random_policy
    first, second = ("you play a word game . " * 12), ("you are a careful player of games . " * 10)
    prompts = [chat.prompt_ids([{"role": "user", "content": head + ask}])
               for head in (first, second) for ask in ("say the word .", "say one word .")]
    prompts = [prompts[2], prompts[0], prompts[3], prompts[1], prompts[0]]  # interleaved, one repeated
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    results = []
    try:
        for share in (True, False):
            backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=5, share_prefix=share)
            fed.clear()
            results.append((backend.generate(prompts, params), list(fed)))
    finally:
        hook.remove()
    (shared, shared_fed), (plain, _) = results
    assert [g.ids for g in shared] == [g.ids for g in plain]
    for a, b in zip(shared, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # each environment: its instructions once (batch 1), then its two prompts' rest; then all five rows decode
    assert [shape[0] for shape in shared_fed[:4]] == [1, 2, 1, 2] and shared_fed[4][0] == 5


def test_sampling_draws_ids_with_their_probabilities_and_never_an_impossible_one():
    from contrail.agent.backend import sample_next

    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    logits = probs.log().expand(20_000, -1)  # -inf where the probability is 0
    generator = torch.Generator().manual_seed(0)
    ids, logprobs = sample_next(logits, SamplingParams(temperature=1.0), generator)
    counts = torch.bincount(ids, minlength=5).float() / len(ids)
    assert counts[1] == 0 and counts[3] == 0
    torch.testing.assert_close(counts, probs, rtol=0, atol=0.015)  # ~4 standard errors at 20,000 draws
    torch.testing.assert_close(logprobs, probs.log()[ids])


def test_new_parts_of_very_different_lengths_are_prefilled_in_buckets_with_the_same_samples(
        tokenizer, chat, random_policy):
    from contrail.agent.backend import _length_buckets

    assert _length_buckets([5, 6, 5, 7]) == [[0, 1, 2, 3]]  # similar lengths: one batch
    assert sorted(map(sorted, _length_buckets([3, 200, 4, 190, 5]))) == [[0, 2, 4], [1, 3]]
    # four lengths far apart: four buckets, each padded to its own (more than three are looked for)
    spread = [900, 3, 300, 100, 3, 900, 100, 300]
    assert sorted(map(sorted, _length_buckets(spread))) == [[0, 5], [1, 4], [2, 7], [3, 6]]
    assert len(_length_buckets(spread, max_buckets=2)) == 2
    model, _ = random_policy
    config = RolloutConfig(max_new_tokens=4, max_episode_tokens=512, temperature=1.0)
    tasks = easy_tasks(4)

    class Verbose(MagicWordEnv):  # answers at length, so its rows' next turns are much longer than the others'
        def on_step(self, text):
            step = super().on_step(text)
            return step if step.done else Step(observation="that is not it . " * 12, valid=step.valid)

    make = lambda task: Verbose() if task == tasks[0] else MagicWordEnv()  # noqa: E731
    results, prefills, widths = [], [], []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        for options in ({}, {"max_buckets": 1}, {"share_prefix": False}):
            backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=11, **options)
            widths.clear()
            results.append(rollout(backend, chat, tasks, make, config))
            prefills.append(sum(width > 1 for width in widths))
    finally:
        hook.remove()
    bucketed, one_bucket, plain = results
    assert max(t.turns for t in bucketed) > 1
    assert prefills[0] > prefills[1]  # the long rows' next turns were prefilled apart; with max_buckets=1 not
    for other in (one_bucket, plain):
        assert [t.ids for t in bucketed] == [t.ids for t in other]
        for a, b in zip(bucketed, other):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="max_buckets"):
        HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, max_buckets=0)


def test_length_buckets_are_the_split_forwarding_fewest_tokens():
    import itertools
    import random

    from contrail.agent.backend import BUCKET_OVERHEAD, _length_buckets

    def forwarded(lengths, buckets):
        return sum(len(b) * max(lengths[i] for i in b) + BUCKET_OVERHEAD for b in buckets)

    def fewest(lengths, most):  # every split of the sorted lengths into at most `most` runs
        ranked, n = sorted(lengths), len(lengths)
        splits = (c for k in range(most) for c in itertools.combinations(range(1, n), k))
        return min(sum((end - begin) * ranked[end - 1] + BUCKET_OVERHEAD
                       for begin, end in itertools.pairwise([0, *cuts, n])) for cuts in splits)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 20), rng.randint(50, 400)]) for _ in range(rng.randint(1, 9))]
        most = rng.randint(1, 6)
        buckets = _length_buckets(lengths, max_buckets=most, min_saving=0.0)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths))) and len(buckets) <= most
        assert forwarded(lengths, buckets) == fewest(lengths, most)


def test_per_episode_seeds_make_an_episode_independent_of_its_batch(tokenizer, chat, random_policy):
    model, _ = random_policy
    config = RolloutConfig(max_new_tokens=4, max_episode_tokens=256, temperature=1.0)
    tasks = easy_tasks(3)

    def play(indices, seeds):
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=0)
        return rollout(backend, chat, [tasks[i] for i in indices], lambda t: MagicWordEnv(), config, seeds=seeds)

    together = play([0, 1, 2], [10, 11, 12])
    alone = play([1], [11])
    reordered = play([2, 1], [12, 11])
    assert max(t.turns for t in together) > 1  # later turns, from the kept cache, are covered too
    assert together[1].ids == alone[0].ids == reordered[1].ids
    assert together[2].ids == reordered[0].ids
    assert together[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)
    # Without them, the backend's one generator serves the batch in order: the batch moves the draws.
    shared = [rollout(HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=0), chat,
                      [tasks[i] for i in indices], lambda t: MagicWordEnv(), config) for indices in ([0, 1], [1])]
    assert shared[0][1].ids != shared[1][0].ids


def test_one_seed_gives_two_nearby_models_mostly_the_same_samples(tokenizer, chat, random_policy):
    """Common random numbers: a small change of the weights changes few sampled ids under one seed."""
    model, _ = random_policy
    nudged = tiny_model(tokenizer, seed=1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in nudged.parameters():
            parameter.add_(0.02 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    prompts = [tokenizer(f"task {i}:", add_special_tokens=False)["input_ids"] for i in range(16)]
    params = SamplingParams(max_new_tokens=1, temperature=1.0)

    def first_ids(net, seeds):
        backend = HFBackend(net, chat.stop_ids, tokenizer.pad_token_id, seed=0)
        return [g.ids[0] for g in backend.generate(prompts, params, seeds=seeds)]

    seeds = list(range(100, 116))
    coupled = sum(a == b for a, b in zip(first_ids(model, seeds), first_ids(nudged, seeds)))
    independent = sum(a == b for a, b in zip(first_ids(model, seeds), first_ids(nudged, list(range(200, 216)))))
    assert coupled >= 14 and independent <= 4, (coupled, independent)


def test_seeds_must_match_the_prompts(tokenizer, chat, random_policy):
    _, backend = random_policy
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), seeds=[1, 2])
    with pytest.raises(ValueError, match="1 seeds for 2 tasks"):
        rollout(backend, chat, easy_tasks(2), lambda t: MagicWordEnv(), seeds=[1])


class WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts autocast's fp32 -> bf16 copies of tensors shaped like ``weights``."""

    def __init__(self, weights):
        super().__init__()
        self.shapes, self.count = {tuple(w.shape) for w in weights if w.dim() == 2}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and tuple(args[0].shape) in self.shapes):
            self.count += 1
        return func(*args, **kwargs)


def test_bf16_sampling_casts_frozen_weights_once_per_call_and_leaves_them_frozen(tokenizer, chat):
    """Autocast caches casts of trainable weights only; a LoRA run's frozen base would be cast every token."""
    model = tiny_model(tokenizer, seed=1)
    weights = [p for p in model.parameters() if p.dim() == 2]
    prompt = chat.prompt_ids([{"role": "user", "content": "say the word ."}])
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    results = {}
    for trainable in (True, False):
        model.requires_grad_(trainable)
        backend = HFBackend(model, set(), tokenizer.pad_token_id, seed=4, autocast_bf16=True,  # no stop: 6 steps
                            pack_weights=False)  # autocast's own casts (packing casts each weight once anyway)
        with WeightCasts(weights) as casts:
            results[trainable] = backend.generate([prompt, prompt[1:]], params)
        assert casts.count <= len(weights), casts.count  # each weight once, not once per forward
        assert all(p.requires_grad == trainable for p in model.parameters())
    assert [g.ids for g in results[True]] == [g.ids for g in results[False]]


def _forward_shapes(model):
    """A list that receives the ``input_ids`` shape of every forward of ``model``, and the hook's handle."""
    shapes = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    return shapes, handle


@pytest.mark.parametrize("seeded", [False, True])
def test_stopped_rows_leave_the_decode_batch_without_changing_any_sample(tokenizer, chat, random_policy, seeded):
    model, _ = random_policy
    stop = frozenset(range(5, len(tokenizer), 6))  # a sixth of the vocabulary stops a row: rows stop at many steps
    prompts = [chat.prompt_ids([{"role": "user", "content": f"say the word {word} ."}])
               for word in ("apple", "berry", "cherry", "grape", "lemon", "mango", "red", "blue", "green", "door",
                            "key", "ball")]  # distinct prompts: each next turn extends its own row's cache
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    seeds = list(range(100, 100 + len(prompts))) if seeded else None
    runs = {}
    for park in (True, False):
        backend = HFBackend(model, stop, tokenizer.pad_token_id, seed=7, park_stopped=park)
        shapes, handle = _forward_shapes(model)
        try:
            first = backend.generate(prompts, params, seeds)
            decoded = [shape[0] for shape in shapes if shape[1] == 1]
            # Every other episode goes on: its next prompt extends what the kept (joined) cache holds.
            follow = [p + g.ids + chat.user_turn_ids("try again") for p, g in zip(prompts, first)][::2]
            shapes.clear()
            second = backend.generate(follow, params, seeds[::2] if seeded else None)
        finally:
            handle.remove()
        runs[park] = (first + second, decoded, shapes[0])
    (parked, parked_sizes, extended), (plain, plain_sizes, _) = runs[True], runs[False]
    # The second turn went on from the joined cache: each row prefilled its new ids (and its stop id, when it
    # left the batch before that was fed), not its history.
    assert extended[0] == len(follow) and extended[1] <= len(chat.user_turn_ids("try again")) + 1
    assert len({len(g.ids) for g in parked[:len(prompts)]}) > 3  # rows really stopped at different steps
    assert [g.ids for g in parked] == [g.ids for g in plain]
    for a, b in zip(parked, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert set(plain_sizes) == {len(prompts)}
    assert min(parked_sizes) < len(prompts) and parked_sizes == sorted(parked_sizes, reverse=True)
    assert sum(parked_sizes) < sum(plain_sizes)


def test_a_turn_s_parked_pieces_are_joined_only_when_a_next_turn_extends_them(tokenizer, chat, random_policy,
                                                                              monkeypatch):
    import contrail.agent.backend as backend_module

    model, _ = random_policy
    # For each assembled cache, the sessions its rows came from. The sessions themselves are kept, not their ids:
    # a freed session's id can be handed to a later piece, which would make an unrelated read look like a reuse.
    read = []
    real_assembled = backend_module._assembled

    def assembled(sources, room=0, release=(), ends=None):
        read.append([session for session, _ in sources])
        return real_assembled(sources, room, release, ends)

    def reads_of(pieces):
        """For each assembled cache, how many of ``pieces`` it read."""
        return [sum(any(session is piece for session in sessions) for piece in pieces) for sessions in read]

    monkeypatch.setattr(backend_module, "_assembled", assembled)
    stop = frozenset(range(5, len(tokenizer), 6))  # rows stop at many steps, so some are parked
    # One long shared prefix and one-word ends: the prefill is one cluster and one bucket, so it joins nothing.
    prompts = [chat.prompt_ids([{"role": "user", "content": "say the word " * 30 + f"{word} ."}])
               for word in ("apple", "berry", "cherry", "grape", "lemon", "mango", "red", "blue")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    backend = HFBackend(model, stop, tokenizer.pad_token_id, seed=7)
    first = backend.generate(prompts, params)
    assert len({len(g.ids) for g in first}) > 3  # rows stopped at different steps: some were parked
    pieces = list(backend._session.pieces)
    assert len(pieces) > 1
    assert not any(reads_of(pieces))  # the last turn of an episode drops them: no copy yet
    backend.reset_cache()
    first = backend.generate(prompts, params)
    pieces = list(backend._session.pieces)
    read.clear()
    backend.generate([p + g.ids + chat.user_turn_ids("again") for p, g in zip(prompts, first)], params)
    assert max(reads_of(pieces)) > 1  # the next turn read the first's parked pieces


def test_a_next_turn_lets_each_old_layer_go_once_copied(tokenizer, chat, random_policy, monkeypatch):
    """Joining the last turn's pieces into the next turn's cache frees them layer by layer, so the whole old
    cache never sits beside the whole new one (a rollout's peak memory)."""
    import weakref

    from contrail.agent.kv_cache import GrowingLayer

    model, _ = random_policy
    stop = frozenset(range(5, len(tokenizer), 6))  # rows stop at many steps, so the turn ends in several pieces
    prompts = [chat.prompt_ids([{"role": "user", "content": f"say the word {word} ."}])
               for word in ("apple", "berry", "cherry", "grape", "lemon", "mango", "red", "blue")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    backend = HFBackend(model, stop, tokenizer.pad_token_id, seed=7)
    first = backend.generate(prompts, params)
    old = [weakref.ref(layer) for piece in backend._session.pieces for layer in piece.cache.layers]
    alive = []  # for each layer copied from the old pieces: how many old layers were alive then
    real_assemble = GrowingLayer.assemble

    def assemble(self, rows, width, room=0, ends=None):
        if any(layer is ref() for layer, _ in rows for ref in old):
            alive.append(sum(ref() is not None for ref in old))
        return real_assemble(self, rows, width, room, ends)

    monkeypatch.setattr(GrowingLayer, "assemble", assemble)
    backend.generate([p + g.ids + chat.user_turn_ids("again") for p, g in zip(prompts, first)], params)
    layers = len(model.model.layers)
    assert len(alive) >= layers > 1  # every layer was copied from the pieces
    assert alive[-1] < alive[0]  # the last copy ran with the first layers already gone
    assert all(ref() is None for ref in old)


def test_a_prefill_joining_repeated_prompts_lets_each_part_layer_go_once_copied(tokenizer, chat, random_policy,
                                                                                 monkeypatch):
    """A group's repeated prompts are prefilled once and their rows copied out layer by layer, each part's
    layer freed before the next is copied."""
    import weakref

    from contrail.agent.kv_cache import GrowingLayer

    model, _ = random_policy
    distinct = [chat.prompt_ids([{"role": "user", "content": f"say the word {word} ."}])
                for word in ("apple", "berry", "cherry", "grape")]
    prompts = [prompt for prompt in distinct for _ in range(2)]  # a group of two per prompt
    backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=7)
    previous, freed = [], []  # for each join copy after the first: were the last copy's source layers gone?
    real_assemble = GrowingLayer.assemble

    def assemble(self, rows, width, room=0, ends=None):
        if len(rows) == len(prompts):  # the join of the distinct prompts' rows into the batch
            if previous:
                freed.append(all(ref() is None for ref in previous))
            previous[:] = [weakref.ref(layer) for layer, _ in rows]
        return real_assemble(self, rows, width, room, ends)

    monkeypatch.setattr(GrowingLayer, "assemble", assemble)
    backend.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert len(freed) == len(model.model.layers) - 1 > 0
    assert all(freed)


def test_started_episodes_play_as_a_rollout_plays_them_and_seeds_are_all_or_none(tokenizer, chat, random_policy):
    """`rollout` is `start_episodes` then `play`: the same seeded episodes either way; a batch mixing
    seeded and unseeded episodes is refused (an unseeded one has no stream to draw from)."""
    _, backend = random_policy
    tasks = easy_tasks(3)
    config = RolloutConfig(max_new_tokens=4, max_episode_tokens=256)
    whole = rollout(backend, chat, tasks, lambda t: MagicWordEnv(), config, seeds=[1, 2, 3])
    started = start_episodes(tasks, lambda t: MagicWordEnv(), chat, config, seeds=[1, 2, 3])
    openings = [list(e.trajectory.ids) for e in started]
    assert all(e.trajectory.turns == 0 and not any(e.trajectory.mask) for e in started)  # nothing generated yet
    assert all(t.ids[:len(opening)] == opening for t, opening in zip(whole, openings))
    parts = play(backend, chat, started, config)
    assert [t.ids for t in parts] == [t.ids for t in whole]
    mixed = (start_episodes(tasks[:1], lambda t: MagicWordEnv(), chat, config, seeds=[1])
             + start_episodes(tasks[1:2], lambda t: MagicWordEnv(), chat, config))
    with pytest.raises(ValueError, match="some episodes were started with seeds and some without"):
        play(backend, chat, mixed, config)


def test_per_turn_rates_pool_every_turn_so_a_long_episode_weighs_by_its_turns():
    from contrail.agent.rollout import Trajectory, per_turn_rate

    task = Task("magic", 0, "test", "easy")
    short = Trajectory(task, [], [], [], [], turns=1, invalid_actions=1, cut_turns=1)
    long = Trajectory(task, [], [], [], [], turns=3, invalid_actions=0, cut_turns=2)
    assert per_turn_rate([short, long], "invalid_actions") == 0.25  # not the episodes' mean, 0.5
    assert per_turn_rate([short, long], "cut_turns") == 0.75
    assert per_turn_rate([], "cut_turns") == 0.0
    assert per_turn_rate([], "cut_turns", empty=7.0) == 7.0
