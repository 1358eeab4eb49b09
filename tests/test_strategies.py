"""Strategies' plans (stages, budgets, shares, orders) and the task sampler."""

import json
from collections import Counter
from dataclasses import dataclass

import pytest

from contrail import strategies
from contrail.envs.base import Env, Step, Task, UnknownNameError, register
from contrail.strategies import Curriculum, Mixture, Replay, Sequential, Stage, Strategy, TaskSampler
from contrail.stream import Experience, Stream


@register("tiny-levels")
class TinyLevels(Env):
    """Declares three levels, hardest last (all the curriculum needs)."""

    name = "tiny-levels"
    difficulties = ("easy", "medium", "hard")

    def instruction(self):
        return "say done"

    def tasks(self, split, difficulty=None):
        return [Task(self.name, i, split, difficulty or "easy") for i in range(3)]

    def reset(self, task):
        return "go"

    def step(self, text):
        return Step("ok", 1.0, True, True)

    def expert(self):
        return "done"


@register("tiny-other")
class TinyOther(TinyLevels):
    name = "tiny-other"
    difficulties = ("easy", "hard")


def experience(env, difficulty, n=6, steps=None):
    tasks = [Task(env, i, "train", difficulty) for i in range(n)]
    test = [Task(env, 100 + i, "test", difficulty) for i in range(2)]
    return Experience(f"{env}:{difficulty}", env, difficulty, tasks, test, steps)


A = experience("tiny-levels", "hard")
B = experience("tiny-other", "easy", steps=4)
C = experience("tiny-levels", "easy")
D = experience("tiny-levels", "medium")


def names_of(tasks):
    return [f"{t.env}:{t.difficulty}" for t in tasks]


# --- sampler ------------------------------------------------------------------------------


def test_sampler_cycles_through_a_pool_before_repeating():
    pool = [Task("x", i, "train", "easy") for i in range(5)]
    sampler = TaskSampler({"x": pool}, seed=3)
    epochs = [[t.id for t in sampler.sample(5)] for _ in range(6)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs)  # no repeat within an epoch
    assert len({tuple(epoch) for epoch in epochs}) > 1  # each epoch is reshuffled


def test_sampler_shares_are_exact_to_within_one():
    sampler = TaskSampler({"a": A.train_tasks, "b": B.train_tasks}, {"a": 3, "b": 1}, seed=0)
    for n in range(1, 41):
        sampler.sample(1)
        counts = sampler.state_dict()["counts"]
        assert abs(counts["a"] - 0.75 * n) <= 1 and abs(counts["b"] - 0.25 * n) <= 1


def test_sampler_is_deterministic_and_resumable():
    pools = {"a": A.train_tasks, "b": B.train_tasks, "c": C.train_tasks}
    full = TaskSampler(pools, seed=7).sample(30)
    first = TaskSampler(pools, seed=7)
    head = first.sample(11)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = TaskSampler(pools, seed=7)
    resumed.load_state_dict(state)
    assert head + resumed.sample(19) == full
    assert TaskSampler(pools, seed=8).sample(30) != full


def test_sampler_rejects_mismatched_state_and_bad_weights():
    sampler = TaskSampler({"a": A.train_tasks}, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        sampler.load_state_dict(TaskSampler({"a": A.train_tasks[:2]}, seed=0).state_dict())
    with pytest.raises(ValueError, match="unknown pools"):
        TaskSampler({"a": A.train_tasks}, {"z": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        TaskSampler({"a": A.train_tasks}, {"a": -1.0})
    with pytest.raises(ValueError, match="no tasks"):
        TaskSampler({"a": []})
    # a zero-weight pool is never drawn, even when empty
    only_a = TaskSampler({"a": A.train_tasks, "b": []}, {"a": 1.0, "b": 0.0})
    assert set(names_of(only_a.sample(10))) == {"tiny-levels:hard"}


# --- plans ------------------------------------------------------------------------------


def test_sequential_one_stage_per_experience_with_budgets():
    stream = Stream([A, B, C], [A, B, C, D])
    stages = Sequential(steps_per_experience=7).plan(stream)
    assert [s.index for s in stages] == [1, 2, 3]
    assert [s.name for s in stages] == [A.name, B.name, C.name]
    assert [s.experiences for s in stages] == [[A.name], [B.name], [C.name]]
    assert [s.steps for s in stages] == [7, 4, 7]  # B declares its own budget
    assert all(s.weights == {s.name: 1.0} for s in stages)
    assert set(names_of(stages[1].sampler.sample(8))) == {B.name}
    assert stream.trained_at([s.experiences for s in stages]) == [1, 2, 3, None]


def test_mixture_is_one_stage_with_the_sequential_budget():
    stream = Stream([A, B, C])
    (stage,) = Mixture(steps_per_experience=5).plan(stream)
    assert stage.index == 1 and stage.name == "mixture"
    assert stage.steps == 5 + 4 + 5
    assert stage.experiences == [A.name, B.name, C.name]
    assert stage.weights == pytest.approx({A.name: 1 / 3, B.name: 1 / 3, C.name: 1 / 3})
    assert Counter(names_of(stage.sampler.sample(30))) == {A.name: 10, B.name: 10, C.name: 10}
    assert stream.trained_at([stage.experiences]) == [1, 1, 1]


def test_mixture_weights_and_their_errors():
    stream = Stream([A, B, C])
    (stage,) = Mixture(weights={A.name: 2, B.name: 1}).plan(stream)
    assert stage.weights == pytest.approx({A.name: 2 / 3, B.name: 1 / 3})
    assert stage.experiences == [A.name, B.name]  # C has no share: not trained
    assert Counter(names_of(stage.sampler.sample(30))) == {A.name: 20, B.name: 10}
    with pytest.raises(ValueError, match="not training experiences"):
        Mixture(weights={"nope:easy": 1}).plan(stream)


def test_curriculum_declared_orders_easy_to_hard_stably():
    # A is hard (2/2), B easy (0/1), C easy (0/2), D medium (1/2): easy ones keep stream order.
    stream = Stream([A, B, C, D])
    stages = Curriculum(by="declared", steps_per_experience=2).plan(stream)
    assert [s.name for s in stages] == [B.name, C.name, D.name, A.name]
    assert [s.index for s in stages] == [1, 2, 3, 4]
    assert [s.steps for s in stages] == [4, 2, 2, 2]
    assert stream.trained_at([s.experiences for s in stages]) == [4, 1, 2, 3]
    assert not Curriculum(by="declared").needs_base_success


def test_curriculum_measured_orders_by_base_success():
    stream = Stream([A, B, C])
    strategy = Curriculum(by="measured")
    assert strategy.needs_base_success
    stages = strategy.plan(stream, {A.name: 0.9, B.name: 0.1, C.name: 0.5})
    assert [s.name for s in stages] == [A.name, C.name, B.name]
    with pytest.raises(ValueError, match="needs base_success"):
        strategy.plan(stream)
    with pytest.raises(ValueError, match="lacks training experiences.*tiny-other:easy"):
        strategy.plan(stream, {A.name: 0.9, C.name: 0.5})
    with pytest.raises(ValueError, match="declared, measured"):
        Curriculum(by="alphabetical")


def test_replay_shares():
    stream = Stream([A, B, C])
    stages = Replay(replay_share=0.4, steps_per_experience=5).plan(stream)
    assert [s.experiences for s in stages] == [[A.name], [B.name], [C.name]]
    assert [s.steps for s in stages] == [5, 4, 5]
    assert stages[0].weights == {A.name: 1.0}  # nothing to replay in stage 1
    assert stages[1].weights == pytest.approx({B.name: 0.6, A.name: 0.4})
    assert stages[2].weights == pytest.approx({C.name: 0.6, A.name: 0.2, B.name: 0.2})
    drawn = Counter(names_of(stages[2].sampler.sample(50)))
    assert drawn == {C.name: 30, A.name: 10, B.name: 10}
    assert stream.trained_at([s.experiences for s in stages]) == [1, 2, 3]


def test_replay_default_share_and_zero_share():
    stages = Replay().plan(Stream([A, B]))
    assert stages[1].weights == pytest.approx({B.name: 0.75, A.name: 0.25})
    assert Replay(replay_share=0.0).plan(Stream([A, B]))[1].weights == {B.name: 1.0}
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Replay(replay_share=1.0)


def test_stage_samplers_differ_between_stages_and_seeds():
    stream = Stream([A, C])
    plan = Sequential(seed=0).plan(stream)
    again = Sequential(seed=0).plan(stream)
    other = Sequential(seed=1).plan(stream)
    assert plan[0].sampler.sample(6) == again[0].sampler.sample(6)
    assert [t.id for t in Sequential(seed=0).plan(stream)[0].sampler.sample(6)] != [
        t.id for t in other[0].sampler.sample(6)
    ]


def test_registry_make_and_user_strategy():
    assert {"sequential", "mixture", "curriculum", "replay"} <= set(strategies.names())
    assert isinstance(strategies.make("replay", replay_share=0.5), Replay)
    with pytest.raises(UnknownNameError, match="valid: .*sequential"):
        strategies.make("nope")
    with pytest.raises(ValueError, match="unknown option.*share.*valid: replay_share"):
        strategies.make("replay", share=0.5)

    @strategies.register("test-reverse")
    @dataclass
    class Reverse(Strategy):
        steps_per_experience: int = 3

        def plan(self, stream, base_success=None):
            return [
                Stage(i, e.name, [e.name], strategies.budget(e, self.steps_per_experience),
                      TaskSampler({e.name: e.train_tasks}, seed=i), {e.name: 1.0})
                for i, e in enumerate(reversed(stream.train), start=1)
            ]

    strategy = strategies.make("test-reverse")
    assert strategy.name == "test-reverse" and "test-reverse" in strategies.names()
    assert [s.name for s in strategy.plan(Stream([A, B]))] == [B.name, A.name]
    strategy.before_stage(None, None)  # default hooks are no-ops
    strategy.after_stage(None, None)


def test_empty_stream_fails_clearly():
    with pytest.raises(ValueError, match="no training experiences"):
        Sequential().plan(Stream([], [A]))


def test_stage_to_dict_is_json():
    (stage,) = Mixture().plan(Stream([A, B]))
    data = json.loads(json.dumps(stage.to_dict()))
    assert data == {"index": 1, "name": "mixture", "experiences": [A.name, B.name], "steps": 14,
                    "weights": {A.name: 0.5, B.name: 0.5}}
