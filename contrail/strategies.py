"""Strategies: small planners that turn a `Stream` into training stages.

A strategy decides *what* each stage trains on and for how many GRPO steps;
the runner drives the loop (train a stage, evaluate every test experience,
record a row) and the trainer knows nothing about continual learning.

=============  ==================================================================
strategy       plan
=============  ==================================================================
sequential     one stage per training experience, in stream order
mixture        one stage over all training experiences (weights, default uniform),
               with the sum of the sequential budgets (equal compute)
curriculum     sequential, reordered easy→hard: ``by="declared"`` (the environment's
               declared difficulty levels) or ``by="measured"`` (descending success
               of the untouched model on the training tasks, ``base_success``)
replay         sequential; stage ``s > 1`` draws ``replay_share`` of its tasks
               uniformly from the earlier experiences, the rest from the new one
=============  ==================================================================

A stage's budget is its experience's ``steps`` or, when that is ``None``, the
strategy's ``steps_per_experience``. ``Stage.experiences`` lists the
experiences a stage *newly* trains (so ``Stream.trained_at`` gives the stage
where each is first trained); ``Stage.weights`` lists every experience the
stage samples from, replayed ones included.

Writing your own strategy takes a few lines: a dataclass whose fields are its
options, a ``plan``, and optionally the ``before_stage``/``after_stage`` hooks,
which receive the trainer (to wrap it with a regulariser, say)::

    from dataclasses import dataclass
    from contrail import strategies
    from contrail.strategies import Stage, Strategy, TaskSampler, budget

    @strategies.register("reverse")
    @dataclass
    class Reverse(Strategy):
        steps_per_experience: int = 10
        seed: int = 0

        def plan(self, stream, base_success=None):
            return [
                Stage(i, e.name, [e.name], budget(e, self.steps_per_experience),
                      TaskSampler({e.name: e.train_tasks}, seed=self.seed + i), {e.name: 1.0})
                for i, e in enumerate(reversed(stream.train), start=1)
            ]

    strategies.make("reverse", steps_per_experience=5)   # or `strategy: {name: reverse}` in YAML
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from contrail import envs
from contrail.envs.base import Task, UnknownNameError
from contrail.stream import Experience, Stream

__all__ = [
    "Curriculum",
    "Mixture",
    "Replay",
    "Sequential",
    "Stage",
    "Strategy",
    "TaskSampler",
    "budget",
    "make",
    "names",
    "register",
]


# --- task sampling -----------------------------------------------------------------


class TaskSampler:
    """Deterministic, resumable draws of tasks from weighted pools.

    Each draw picks a pool by weight, then that pool's next task. Pools are
    chosen so the shares are exact over time (after ``n`` draws, pool ``i``
    has been drawn ``n·wᵢ`` times, to within one), and each pool is walked
    through a seeded shuffle, so a task repeats only after every task of its
    pool was used. The whole state is the per-pool draw counts.

    >>> sampler = TaskSampler({"a": tasks_a, "b": tasks_b}, {"a": 3, "b": 1}, seed=0)
    >>> batch = sampler.sample(4)            # three tasks of "a", one of "b"
    >>> state = sampler.state_dict()         # JSON-able; load_state_dict(state) resumes
    """

    def __init__(self, pools: dict[str, list[Task]], weights: dict[str, float] | None = None, seed: int = 0) -> None:
        if not pools:
            raise ValueError("TaskSampler needs at least one pool of tasks")
        weights = {name: 1.0 for name in pools} if weights is None else dict(weights)
        unknown = sorted(set(weights) - set(pools))
        if unknown:
            raise ValueError(f"weights name unknown pools {unknown}; pools: {sorted(pools)}")
        for name, weight in weights.items():
            if not weight >= 0:
                raise ValueError(f"weight of {name!r} must be >= 0, got {weight}")
        total = sum(weights.values())
        if total <= 0:
            raise ValueError(f"at least one weight must be positive, got {weights}")
        self.weights = {name: weights[name] / total for name in pools if weights.get(name, 0) > 0}
        for name in self.weights:
            if not pools[name]:
                raise ValueError(f"pool {name!r} has a positive weight but no tasks")
        self.pools = {name: list(pools[name]) for name in self.weights}
        self.seed = seed
        # Ties between pools are broken in a seeded order, not alphabetically.
        self._tie_order = sorted(self.weights)
        random.Random(f"{seed}:ties").shuffle(self._tie_order)
        self._counts = {name: 0 for name in self.weights}
        self._orders: dict[tuple[str, int], list[int]] = {}

    def sample(self, n: int) -> list[Task]:
        """The next ``n`` tasks."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self._draw() for _ in range(n)]

    def _draw(self) -> Task:
        drawn = sum(self._counts.values()) + 1
        # The pool furthest behind its share; ties go to the earliest in the seeded order.
        name = max(self._tie_order, key=lambda p: drawn * self.weights[p] - self._counts[p])
        count = self._counts[name]
        self._counts[name] = count + 1
        pool = self.pools[name]
        epoch, position = divmod(count, len(pool))
        return pool[self._order(name, epoch)[position]]

    def _order(self, name: str, epoch: int) -> list[int]:
        key = (name, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != name}  # keep one epoch per pool
            order = list(range(len(self.pools[name])))
            random.Random(f"{self.seed}:{name}:{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: draw counts plus a fingerprint of the pools."""
        return {"seed": self.seed, "sizes": {n: len(p) for n, p in self.pools.items()}, "counts": dict(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`; the pools, their sizes and the seed must match."""
        sizes = {n: len(p) for n, p in self.pools.items()}
        if state.get("sizes") != sizes or state.get("seed") != self.seed:
            raise ValueError(
                f"sampler state does not match this sampler: saved pools {state.get('sizes')} "
                f"seed {state.get('seed')}, "
                f"current pools {sizes} seed {self.seed}"
            )
        self._counts = {name: int(state["counts"][name]) for name in self.pools}

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}: {w:.2f}" for n, w in self.weights.items())
        return f"TaskSampler({{{shares}}}, seed={self.seed})"


# --- stages and strategies --------------------------------------------------------


@dataclass
class Stage:
    """One training stage: what to sample and for how many GRPO steps.

    ``experiences`` are the experiences this stage newly trains (their first
    stage gives ``trained_at``); ``weights`` are the shares of tasks per
    experience the ``sampler`` draws, replayed experiences included.
    """

    index: int
    name: str
    experiences: list[str]
    steps: int
    sampler: TaskSampler
    weights: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able description of the stage (no sampler state)."""
        return {
            "index": self.index,
            "name": self.name,
            "experiences": list(self.experiences),
            "steps": self.steps,
            "weights": dict(self.weights),
        }


class Strategy:
    """Base of every strategy: ``plan`` the stages; optional per-stage hooks.

    Subclasses are dataclasses whose fields are their options.
    ``needs_base_success`` tells the runner to measure the untouched model's
    success on each training experience's train tasks and pass it to ``plan``.
    """

    name: ClassVar[str] = ""
    needs_base_success: ClassVar[bool] = False

    def plan(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Stage]:
        raise NotImplementedError

    def before_stage(self, stage: Stage, trainer: Any) -> None:
        """Called by the runner before training ``stage``; default no-op."""

    def after_stage(self, stage: Stage, trainer: Any) -> None:
        """Called by the runner after training (and before evaluating) ``stage``; default no-op."""


def budget(experience: Experience, steps_per_experience: int) -> int:
    """GRPO steps for ``experience``: its own ``steps``, else the strategy default."""
    steps = experience.steps if experience.steps is not None else steps_per_experience
    if steps < 1:
        raise ValueError(f"steps for {experience.name} must be >= 1, got {steps}")
    return steps


def _training(stream: Stream) -> list[Experience]:
    if not stream.train:
        raise ValueError("the stream has no training experiences to plan")
    return list(stream.train)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _sequential_stages(order: Sequence[Experience], steps_per_experience: int, seed: int) -> list[Stage]:
    return [
        Stage(
            index=i,
            name=e.name,
            experiences=[e.name],
            steps=budget(e, steps_per_experience),
            sampler=TaskSampler({e.name: e.train_tasks}, seed=_stage_seed(seed, i)),
            weights={e.name: 1.0},
        )
        for i, e in enumerate(order, start=1)
    ]


def _stage_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator registering a strategy under ``name`` (see the module docstring)."""

    def decorate(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def names() -> list[str]:
    """Names of every registered strategy."""
    return sorted(_REGISTRY)


def options(name: str) -> list[str]:
    """The option names strategy ``name`` accepts."""
    cls = _strategy_class(name)
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def _strategy_class(name: str) -> type[Strategy]:
    if name not in _REGISTRY:
        raise UnknownNameError(f"unknown strategy {name!r}; valid: {', '.join(names())}")
    return _REGISTRY[name]


def make(name: str, **options_: Any) -> Strategy:
    """Build strategy ``name`` with ``options``; unknown names or options fail with the valid ones.

    >>> make("replay", replay_share=0.5).plan(stream)
    """
    cls = _strategy_class(name)
    valid = options(name)
    unknown = sorted(set(options_) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for strategy {name!r}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**options_)


@register("sequential")
@dataclass
class Sequential(Strategy):
    """One stage per training experience, in stream order."""

    steps_per_experience: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive("steps_per_experience", self.steps_per_experience)

    def plan(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Stage]:
        return _sequential_stages(_training(stream), self.steps_per_experience, self.seed)


@register("mixture")
@dataclass
class Mixture(Strategy):
    """One stage over every training experience, with the total sequential budget.

    ``weights`` (``{name: w}``) sets each experience's share of tasks
    (uniform by default; unlisted experiences get 0 and are not trained).
    """

    steps_per_experience: int = 10
    weights: dict[str, float] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive("steps_per_experience", self.steps_per_experience)

    def plan(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Stage]:
        train = _training(stream)
        pools = {e.name: e.train_tasks for e in train}
        if self.weights is None:
            raw = {name: 1.0 for name in pools}
        else:
            unknown = sorted(set(self.weights) - set(pools))
            if unknown:
                raise ValueError(f"mixture weights name {unknown}, not training experiences; valid: {list(pools)}")
            raw = {name: float(self.weights.get(name, 0.0)) for name in pools}
        sampler = TaskSampler(pools, raw, seed=_stage_seed(self.seed, 1))
        return [
            Stage(
                index=1,
                name="mixture",
                experiences=list(sampler.weights),
                steps=sum(budget(e, self.steps_per_experience) for e in train),
                sampler=sampler,
                weights=dict(sampler.weights),
            )
        ]


@register("curriculum")
@dataclass
class Curriculum(Strategy):
    """Sequential stages ordered easy→hard.

    ``by="declared"``: by the position of each experience's difficulty among
    its environment's declared levels (``easy`` before ``hard``; an experience
    without a difficulty sits in the middle); ties keep stream order.
    ``by="measured"``: by descending ``base_success`` (the untouched model's
    success on the training tasks), which the runner measures and passes in.
    """

    by: str = "declared"
    steps_per_experience: int = 10
    seed: int = 0

    BY: ClassVar[tuple[str, ...]] = ("declared", "measured")

    def __post_init__(self) -> None:
        if self.by not in self.BY:
            raise ValueError(f"curriculum 'by' must be one of {', '.join(self.BY)}, got {self.by!r}")
        _check_positive("steps_per_experience", self.steps_per_experience)

    @property
    def needs_base_success(self) -> bool:  # type: ignore[override]
        return self.by == "measured"

    def order(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Experience]:
        """The training experiences in curriculum order."""
        train = _training(stream)
        if self.by == "declared":
            return sorted(train, key=_declared_rank)
        if base_success is None:
            raise ValueError(
                "curriculum by='measured' needs base_success, the untouched model's success per training "
                "experience (the runner measures it); or use by='declared'"
            )
        missing = [e.name for e in train if e.name not in base_success]
        if missing:
            raise ValueError(f"base_success lacks training experiences {missing}; given: {sorted(base_success)}")
        return sorted(train, key=lambda e: -float(base_success[e.name]))

    def plan(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Stage]:
        return _sequential_stages(self.order(stream, base_success), self.steps_per_experience, self.seed)


def _declared_rank(experience: Experience) -> float:
    if experience.difficulty is None:
        return 0.5
    levels = tuple(getattr(envs.env_class(experience.env), "difficulties", ()))
    if experience.difficulty not in levels or len(levels) < 2:
        return 0.5
    return levels.index(experience.difficulty) / (len(levels) - 1)


@register("replay")
@dataclass
class Replay(Strategy):
    """Sequential, and stage ``s > 1`` draws ``replay_share`` of its tasks from earlier experiences.

    The replayed share is split uniformly among the distinct earlier
    experiences; stage 1 has nothing to replay and trains its experience alone.
    """

    replay_share: float = 0.25
    steps_per_experience: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.replay_share < 1.0:
            raise ValueError(f"replay_share must be in [0, 1), got {self.replay_share}")
        _check_positive("steps_per_experience", self.steps_per_experience)

    def plan(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Stage]:
        stages = []
        seen: dict[str, Experience] = {}
        for i, e in enumerate(_training(stream), start=1):
            earlier = [name for name in seen if name != e.name]
            weights = {e.name: 1.0}
            if earlier and self.replay_share > 0:
                weights = {e.name: 1.0 - self.replay_share}
                weights.update({name: self.replay_share / len(earlier) for name in earlier})
            pools = {name: (e if name == e.name else seen[name]).train_tasks for name in weights}
            stages.append(
                Stage(
                    index=i,
                    name=e.name,
                    experiences=[e.name],
                    steps=budget(e, self.steps_per_experience),
                    sampler=TaskSampler(pools, weights, seed=_stage_seed(self.seed, i)),
                    weights=weights,
                )
            )
            seen.setdefault(e.name, e)
        return stages
