"""The evaluator: environment errors counted per experience, the same sampling at every call, RNG left alone,
episodes batched by opening length."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from contrail import envs
from contrail.agent import ChatFormat, Generation
from contrail.agent.rollout import RolloutConfig, Trajectory
from contrail.envs.base import Task
from contrail.evaluation import START_BATCHES, Evaluator, evaluate, preserved_rng, summarize
from contrail.testing import BerryWordEnv, MagicWordEnv, fed_widths, tiny_model, tiny_tokenizer

ROLLOUT = RolloutConfig(max_new_tokens=3, max_episode_tokens=256)


class ResetFails(BerryWordEnv):
    def on_reset(self, task):
        raise RuntimeError("engine did not start")


class StepFails(BerryWordEnv):
    def on_step(self, text):
        raise OSError("engine died")


def factory(task):
    """magic: fine; id 2 of magic-berry: the constructor raises; id 4: reset raises; id 6: step raises."""
    if task.env == "magic":
        return envs.make("magic")
    if task.id == 10_002:
        raise ValueError("cannot build this environment")
    if task.id == 10_004:
        return ResetFails()
    if task.id == 10_006:
        return StepFails()
    return envs.make("magic-berry")


def test_environment_errors_are_counted_per_experience_and_the_evaluation_goes_on(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    tasks = {"magic:easy": envs.make("magic").tasks("test", "easy")[:4],
             "magic-berry:easy": envs.make("magic-berry").tasks("test", "easy")[:4]}
    assert [t.id for t in tasks["magic-berry:easy"]] == [10_000, 10_002, 10_004, 10_006]
    evaluator = Evaluator(tasks, factory, ROLLOUT, k=2, batch_episodes=5, seed=3, show_progress=False)
    path = tmp_path / "stage-00.jsonl"
    results = evaluator(model, tokenizer, trajectories_path=path)
    assert results["magic:easy"].errors == 0
    assert results["magic-berry:easy"].errors == 3 * 2  # constructor, reset and step failures, k=2 each
    assert results["magic-berry:easy"].tasks == 4 and results["magic-berry:easy"].k == 2
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 * 4 * 2
    errors = sorted(r["error"] for r in records if r["error"])
    assert errors == ["OSError: engine died"] * 2 + ["RuntimeError: engine did not start"] * 2 + [
        "ValueError: cannot build this environment"] * 2
    # the same sampling seed at every call: a second evaluation is identical and rewrites the file
    again = evaluator(model, tokenizer, trajectories_path=path)
    assert again == results
    assert [json.loads(line) for line in path.read_text().splitlines()] == records


class DrawsFromGlobalRNGs(MagicWordEnv):
    """An environment that shuffles with the process-wide generators, as many engines do."""

    def on_reset(self, task):
        random.random(), np.random.rand(), torch.rand(1)
        return super().on_reset(task)


def test_evaluation_leaves_the_global_random_state_alone():
    """Otherwise evaluating between stages would move training's random streams (and break exact resume)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    tasks = {"magic:easy": envs.make("magic").tasks("test", "easy")[:2]}
    evaluator = Evaluator(tasks, lambda task: DrawsFromGlobalRNGs(), ROLLOUT, k=2, seed=0, show_progress=False)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    evaluator(model, tokenizer)
    after = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert after == (random.random(), np.random.rand(), torch.rand(1).item())
    model.train()
    evaluator(model, tokenizer)
    assert model.training  # the training mode is restored too


def test_preserved_rng_restores_even_after_an_error():
    torch.manual_seed(5)
    expected = torch.rand(1).item()
    torch.manual_seed(5)
    try:
        with preserved_rng():
            torch.rand(100), random.random()
            raise KeyError
    except KeyError:
        pass
    assert torch.rand(1).item() == expected


def test_summarize_counts_cut_turns_over_all_turns():
    def episode(task_id, turns, cut):
        task = Task(env="magic_word", id=task_id, split="test", difficulty="easy")
        return Trajectory(task=task, ids=[], mask=[], logprobs=[], messages=[], turns=turns, cut_turns=cut)

    result = summarize([episode(0, 3, 2), episode(0, 1, 0), episode(1, 2, 0)], k=2)
    assert result.cut_rate == pytest.approx(2 / 6)  # over turns, as the invalid-action rate
    assert np.isnan(summarize([], k=2).cut_rate)


def test_summarize_of_no_episodes_is_nan_not_an_error():
    result = summarize([], k=2)
    assert result.tasks == 0 and result.errors == 0 and np.isnan(result.avg_at_k)


def test_an_experiences_episodes_do_not_depend_on_what_shares_their_batches():
    """Each episode samples from its own seeded streams: evaluating an experience alone or beside
    another, in batches of any size, plays the same episodes (a stage-1-only run and a full run agree)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=2)
    rollout = RolloutConfig(max_new_tokens=4, max_episode_tokens=256, temperature=1.0)
    magic = envs.make("magic").tasks("test", "easy")[:4]
    berry = envs.make("magic-berry").tasks("test", "easy")[:3]

    def magic_episodes(tasks, batch_episodes, seed=5):
        played: dict = {}
        Evaluator(tasks, factory, rollout, k=2, batch_episodes=batch_episodes, seed=seed,
                  show_progress=False)(model, tokenizer, episodes=played)
        return [(t.task.id, t.sample, t.ids) for t in played["magic:easy"]]

    alone = magic_episodes({"magic:easy": magic}, batch_episodes=8)
    beside = magic_episodes({"magic-berry:easy": berry, "magic:easy": magic}, batch_episodes=5)
    assert sorted(alone) == sorted(beside)
    assert sorted(alone) != sorted(magic_episodes({"magic:easy": magic}, batch_episodes=8, seed=6))


def test_an_evaluation_batch_beyond_64_episodes_keeps_its_kv_cache_across_turns():
    """Every episode's history is prefilled once: a batch larger than the backend's default of 64
    rows used to be cut into chunks that re-prefilled every history each turn."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    tasks = {"magic:easy": envs.make("magic").tasks("test", "easy")}  # 20 tasks x k=4: 80 episodes, one batch
    rollout = RolloutConfig(max_new_tokens=3, max_episode_tokens=256, max_turns=3)
    played: dict = {}
    with fed_widths(model) as widths:
        Evaluator(tasks, factory, rollout, k=4, batch_episodes=80, seed=1, show_progress=False)(
            model, tokenizer, episodes=played)
    assert max(t.turns for t in played["magic:easy"]) == 3  # later turns were played
    instructions = widths[0]  # the first forward: the prompts' shared opening, once
    assert instructions > 16
    assert sum(width >= instructions for width in widths) == 1  # never prefilled again


@pytest.fixture(scope="module")
def chat(tokenizer):  # tokenizer: the tiny one of tests/conftest.py
    return ChatFormat.from_tokenizer(tokenizer)


class LongOpenings(MagicWordEnv):
    """The magic word game whose opening question is longer for every other easy task."""

    def on_reset(self, task):
        return "what is your word ?" + " please" * (8 if task.id % 4 == 2 else 0)


class RecordsPrompts:
    """A backend that always answers the magic word and records each call's prompt lengths."""

    def __init__(self, tokenizer, chat):
        self.reply = tokenizer("apple", add_special_tokens=False)["input_ids"] + [chat.assistant_close_ids[0]]
        self.calls: list[list[int]] = []

    def generate(self, prompts, params, seeds=None):
        self.calls.append([len(p) for p in prompts])
        return [Generation(list(self.reply), [-0.5] * len(self.reply), stopped=True) for _ in prompts]


def test_episodes_are_batched_by_opening_length_and_reported_in_task_order(tokenizer, chat, tmp_path):
    """A batch is left-padded to its longest prompt, so short and long openings play in separate
    batches; results and the trajectories file still follow the tasks' order."""
    tasks = MagicWordEnv().tasks("test", "easy")[:8]  # openings alternate short, long
    backend = RecordsPrompts(tokenizer, chat)
    played: dict = {}
    path = tmp_path / "episodes.jsonl"
    results = evaluate(backend, chat, {"magic:easy": tasks}, lambda task: LongOpenings(), config=ROLLOUT,
                       batch_episodes=4, show_progress=False, episodes=played, trajectories_path=path, seed=0)
    assert len(backend.calls) == 2 and all(len(set(lengths)) == 1 for lengths in backend.calls)
    assert backend.calls[0][0] < backend.calls[1][0]  # the short openings first
    assert [t.task.id for t in played["magic:easy"]] == [t.id for t in tasks]
    written = [json.loads(line)["task"]["id"] for line in path.read_text().splitlines()]
    assert written == [t.id for t in tasks]
    assert results["magic:easy"].avg_at_k == 1.0
    in_order = RecordsPrompts(tokenizer, chat)
    evaluate(in_order, chat, {"magic:easy": tasks}, lambda task: LongOpenings(), config=ROLLOUT, batch_episodes=4,
             show_progress=False, seed=0, by_opening_length=False)
    assert all(len(set(lengths)) == 2 for lengths in in_order.calls)  # task order mixes them


def test_each_experience_plays_in_batches_of_its_own(tokenizer, chat):
    """In bf16 a product's rounding depends on its batch's shape, so batched together one experience's
    row would depend on what else the stream tests: each plays apart, a part-filled batch at its end."""
    tasks = MagicWordEnv().tasks("test", "easy")[:6]  # openings of one length: only the grouping splits them
    experiences = {"first": tasks[:3], "second": tasks[3:]}
    apart, mixed = RecordsPrompts(tokenizer, chat), RecordsPrompts(tokenizer, chat)
    results = evaluate(apart, chat, experiences, lambda task: MagicWordEnv(), config=ROLLOUT, batch_episodes=4,
                       show_progress=False, seed=0)
    assert [len(lengths) for lengths in apart.calls] == [3, 3]
    assert results["first"].tasks == results["second"].tasks == 3
    evaluate(mixed, chat, experiences, lambda task: MagicWordEnv(), config=ROLLOUT, batch_episodes=4,
             show_progress=False, seed=0, mixed_batches=True)
    assert [len(lengths) for lengths in mixed.calls] == [4, 2]


class OpenEnvironments:
    """Makes magic word games and counts how many are open, now and at most."""

    def __init__(self, cheap_to_hold=True):
        self.now = self.most = 0
        counter = self

        class Counted(MagicWordEnv):
            def close(self):
                counter.now -= 1

        Counted.cheap_to_hold = cheap_to_hold
        self.environment = Counted

    def __call__(self, task):
        self.now += 1
        self.most = max(self.most, self.now)
        return self.environment()


def test_an_evaluation_opens_environments_a_few_batches_at_a_time(tokenizer, chat):
    """Episodes are started START_BATCHES batches at a time, so a long evaluation never holds
    every environment open at once."""
    tasks = MagicWordEnv().tasks("test", "easy")[:20]
    environments = OpenEnvironments()
    evaluate(RecordsPrompts(tokenizer, chat), chat, {"magic:easy": tasks}, environments, config=ROLLOUT,
             batch_episodes=2, show_progress=False)
    assert environments.most == 2 * START_BATCHES < len(tasks)
    assert environments.now == 0


def test_environments_that_are_dear_to_hold_are_opened_a_batch_at_a_time(tokenizer, chat):
    """ALFWorld's episodes each hold a planner library for the process's life: none is started
    ahead of its batch."""
    environments = OpenEnvironments(cheap_to_hold=False)
    evaluate(RecordsPrompts(tokenizer, chat), chat, {"magic:easy": MagicWordEnv().tasks("test", "easy")[:20]},
             environments, config=ROLLOUT, batch_episodes=2, show_progress=False)
    assert environments.most == 2 and environments.now == 0


def test_a_failing_generation_closes_every_started_environment(tokenizer, chat):
    """An internal error propagates with its traceback, and the environments started for the
    batches that never played are closed too."""
    backend = RecordsPrompts(tokenizer, chat)
    played = backend.generate

    def second_call_fails(prompts, params, seeds=None):
        if backend.calls:
            raise RuntimeError("backend bug")
        return played(prompts, params, seeds)

    backend.generate = second_call_fails
    environments = OpenEnvironments()
    with pytest.raises(RuntimeError, match="backend bug"):
        evaluate(backend, chat, {"magic:easy": MagicWordEnv().tasks("test", "easy")[:6]}, environments,
                 config=ROLLOUT, batch_episodes=2, show_progress=False)
    assert environments.most == 6 and environments.now == 0


def test_an_interrupt_while_starting_ahead_closes_the_environments_already_started(tokenizer, chat):
    """Ctrl-C while the episodes after the first batch start: the first batch's environments are closed too."""
    environments = OpenEnvironments()

    def interrupted_at_the_third(task):
        if environments.most == 2:
            raise KeyboardInterrupt
        return environments(task)

    with pytest.raises(KeyboardInterrupt):
        evaluate(RecordsPrompts(tokenizer, chat), chat, {"magic:easy": MagicWordEnv().tasks("test", "easy")[:6]},
                 interrupted_at_the_third, config=ROLLOUT, batch_episodes=2, show_progress=False)
    assert environments.most == 2 and environments.now == 0
