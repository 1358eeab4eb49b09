"""Strategies' plans (stages, budgets, shares, orders) and the task sampler."""

import json
from collections import Counter
from dataclasses import dataclass

import pytest

from contrail import strategies
from contrail.envs.base import Env, Step, Task, UnknownNameError, register
from contrail.seeds import derive_seed
from contrail.strategies import (
    Curriculum,
    Mixture,
    Replay,
    Sequential,
    Stage,
    Strategy,
    TaskSampler,
    stage_sampler,
)
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

    def on_reset(self, task):
        return "go"

    def on_step(self, text):
        return Step(observation="ok", reward=1.0, done=True, success=True)

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
    stages = Sequential(steps_per_experience=7).plan(stream, seed=0)
    assert [s.index for s in stages] == [1, 2, 3]
    assert [s.name for s in stages] == [A.name, B.name, C.name]
    assert [s.new for s in stages] == [(A.name,), (B.name,), (C.name,)]
    assert [s.steps for s in stages] == [7, 4, 7]  # B declares its own budget
    assert all(s.weights == {s.name: 1.0} for s in stages)
    assert set(names_of(stage_sampler(stages[1], stream).sample(8))) == {B.name}
    assert stream.trained_at([s.new for s in stages]) == [1, 2, 3, None]


def test_mixture_is_one_stage_with_the_sequential_budget():
    stream = Stream([A, B, C])
    (stage,) = Mixture(steps_per_experience=5).plan(stream, seed=0)
    assert stage.index == 1 and stage.name == "mixture"
    assert stage.steps == 5 + 4 + 5
    assert stage.new == (A.name, B.name, C.name)
    assert stage.weights == pytest.approx({A.name: 1 / 3, B.name: 1 / 3, C.name: 1 / 3})
    assert Counter(names_of(stage_sampler(stage, stream).sample(30))) == {A.name: 10, B.name: 10, C.name: 10}
    assert stream.trained_at([stage.new]) == [1, 1, 1]


def test_mixture_weights_and_their_errors():
    stream = Stream([A, B, C])
    (stage,) = Mixture(weights={A.name: 2, B.name: 1}).plan(stream, seed=0)
    assert stage.weights == pytest.approx({A.name: 2 / 3, B.name: 1 / 3})
    assert stage.new == (A.name, B.name)  # C has no share: not trained
    assert Counter(names_of(stage_sampler(stage, stream).sample(30))) == {A.name: 20, B.name: 10}
    with pytest.raises(ValueError, match="not training experiences"):
        Mixture(weights={"nope:easy": 1}).plan(stream, seed=0)


def test_curriculum_declared_orders_easy_to_hard_stably():
    # A is hard (2/2), B easy (0/1), C easy (0/2), D medium (1/2): easy ones keep stream order.
    stream = Stream([A, B, C, D])
    stages = Curriculum(by="declared", steps_per_experience=2).plan(stream, seed=0)
    assert [s.name for s in stages] == [B.name, C.name, D.name, A.name]
    assert [s.index for s in stages] == [1, 2, 3, 4]
    assert [s.steps for s in stages] == [4, 2, 2, 2]
    assert stream.trained_at([s.new for s in stages]) == [4, 1, 2, 3]
    assert not Curriculum(by="declared").needs_base_success


def test_curriculum_measured_orders_by_base_success():
    stream = Stream([A, B, C])
    strategy = Curriculum(by="measured")
    assert strategy.needs_base_success
    stages = strategy.plan(stream, seed=0, base_success={A.name: 0.9, B.name: 0.1, C.name: 0.5})
    assert [s.name for s in stages] == [A.name, C.name, B.name]
    with pytest.raises(ValueError, match="needs base_success"):
        strategy.plan(stream, seed=0)
    with pytest.raises(ValueError, match="lacks training experiences.*tiny-other:easy"):
        strategy.plan(stream, seed=0, base_success={A.name: 0.9, C.name: 0.5})
    with pytest.raises(ValueError, match="declared, measured"):
        Curriculum(by="alphabetical")


def test_replay_shares():
    stream = Stream([A, B, C])
    stages = Replay(replay_share=0.4, steps_per_experience=5).plan(stream, seed=0)
    assert [s.new for s in stages] == [(A.name,), (B.name,), (C.name,)]
    assert [s.steps for s in stages] == [5, 4, 5]
    assert stages[0].weights == {A.name: 1.0}  # nothing to replay in stage 1
    assert stages[1].weights == pytest.approx({B.name: 0.6, A.name: 0.4})
    assert stages[2].weights == pytest.approx({C.name: 0.6, A.name: 0.2, B.name: 0.2})
    drawn = Counter(names_of(stage_sampler(stages[2], stream).sample(50)))
    assert drawn == {C.name: 30, A.name: 10, B.name: 10}
    assert stream.trained_at([s.new for s in stages]) == [1, 2, 3]


def test_replay_default_share_and_zero_share():
    stages = Replay().plan(Stream([A, B]), seed=0)
    assert stages[1].weights == pytest.approx({B.name: 0.75, A.name: 0.25})
    assert Replay(replay_share=0.0).plan(Stream([A, B]), seed=0)[1].weights == {B.name: 1.0}
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Replay(replay_share=1.0)


def test_stage_seeds_come_from_the_run_seed_and_drive_the_task_order():
    stream = Stream([A, C])
    plan = Sequential().plan(stream, seed=0)
    assert [s.seed for s in plan] == [derive_seed(0, "stage", 1), derive_seed(0, "stage", 2)]
    again = Sequential().plan(stream, seed=0)
    other = Sequential().plan(stream, seed=1)
    assert stage_sampler(plan[0], stream).sample(6) == stage_sampler(again[0], stream).sample(6)
    assert [t.id for t in stage_sampler(plan[0], stream).sample(6)] != [
        t.id for t in stage_sampler(other[0], stream).sample(6)]
    assert "seed" not in strategies.options("sequential")  # the run's seed, not an option


def test_stage_is_frozen_plain_data_and_round_trips_through_json():
    stream = Stream([A, B])
    (stage,) = Mixture().plan(stream, seed=3)
    data = json.loads(json.dumps(stage.to_dict()))
    assert data == {"index": 1, "name": "mixture", "new": [A.name, B.name], "steps": 14,
                    "weights": {A.name: 0.5, B.name: 0.5}, "seed": derive_seed(3, "stage", 1)}
    again = Stage.from_dict(data)
    assert again == stage and again.new == (A.name, B.name)
    assert stage_sampler(again, stream).sample(10) == stage_sampler(stage, stream).sample(10)  # plan.json replays
    with pytest.raises(AttributeError):
        stage.steps = 3
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        Stage(index=1, name="x", new=("x",), steps=0, weights={"x": 1.0}, seed=0)
    with pytest.raises(ValueError, match="'x' must be a finite number > 0"):
        Stage(index=1, name="x", new=("x",), steps=1, weights={"x": float("nan")}, seed=0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        Stage(index=1, name="x", new=("x",), steps=1, weights={"x": 1.0}, seed=-1)


def test_stage_sampler_needs_the_stage_experiences_in_the_stream():
    stage = Stage(index=1, name="gone", new=("gone:easy",), steps=1, weights={"gone:easy": 1.0}, seed=0)
    with pytest.raises(ValueError, match="not experiences of the stream; valid: tiny-levels:hard"):
        stage_sampler(stage, Stream([A]))


@dataclass
class Reverse(Strategy):
    """A user strategy: stages in reverse stream order."""

    steps_per_experience: int = 3

    def plan(self, stream, *, seed, base_success=None):
        return [Stage(index=i, name=e.name, new=(e.name,), steps=strategies.budget(e, self.steps_per_experience),
                      weights={e.name: 1.0}, seed=derive_seed(seed, "stage", i))
                for i, e in enumerate(reversed(stream.train), start=1)]


def test_registry_make_and_user_strategy():
    assert {"sequential", "mixture", "curriculum", "replay", "kl_anchor", "ewc"} <= set(strategies.names())
    assert isinstance(strategies.make("replay", replay_share=0.5), Replay)
    with pytest.raises(UnknownNameError, match="valid: .*sequential"):
        strategies.make("nope")
    with pytest.raises(strategies.StrategyOptionError, match="unknown option.*share.*valid: replay_share"):
        strategies.make("replay", share=0.5)
    assert strategies.options("kl_anchor") == ["steps_per_experience", "beta"]
    assert strategies.options("ewc") == ["steps_per_experience", "lam", "fisher_tasks"]

    strategies.register("test-reverse")(Reverse)
    strategies.register("test-reverse")(Reverse)  # the same class again is fine
    strategy = strategies.make("test-reverse")
    assert strategy.name == "test-reverse" and "test-reverse" in strategies.names()
    assert [s.name for s in strategy.plan(Stream([A, B]), seed=0)] == [B.name, A.name]
    strategy.before_stage(None, None)  # default hooks are no-ops
    strategy.after_stage(None, None)
    with pytest.raises(ValueError, match="already registered by .*Reverse"):
        strategies.register("test-reverse")(type("Other", (Reverse,), {}))


def test_a_strategy_named_by_module_path():
    strategy = strategies.make(f"{__name__}:Reverse", steps_per_experience=2)
    assert isinstance(strategy, Reverse) and strategy.steps_per_experience == 2
    assert strategies.options(f"{__name__}:Reverse") == ["steps_per_experience"]
    with pytest.raises(UnknownNameError, match="no module named 'no_such_pkg.mod'"):
        strategies.make("no_such_pkg.mod:Thing")
    with pytest.raises(UnknownNameError, match="has no attribute 'Missing'"):
        strategies.make(f"{__name__}:Missing")
    with pytest.raises(UnknownNameError, match="not a contrail.strategies.Strategy subclass"):
        strategies.make(f"{__name__}:Stream")


def test_a_strategy_named_by_entry_point(monkeypatch):
    from importlib import metadata

    point = metadata.EntryPoint(name="test-entry", value=f"{__name__}:Reverse", group="contrail.strategies")
    real = metadata.entry_points

    def entry_points(**kwargs):
        return [point] if kwargs.get("group") == "contrail.strategies" else real(**kwargs)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert "test-entry" in strategies.names()
    assert isinstance(strategies.make("test-entry", steps_per_experience=4), Reverse)


def test_empty_stream_fails_clearly():
    with pytest.raises(ValueError, match="no training experiences"):
        Sequential().plan(Stream([], [A]), seed=0)
