"""Stages and the `Strategy` base: what each stage trains on, as plain data.

A `Stage` is frozen plain data (JSON via `Stage.to_dict` / `Stage.from_dict`),
so ``plan.json`` can be replayed: the runner builds the stage's task sampler
from it with `contrail.strategies.stage_sampler`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from contrail.seeds import check_seed, derive_seed
from contrail.stream import Experience, Stream

if TYPE_CHECKING:  # the trainer pulls in torch; planning must not
    from contrail.grpo.trainer import GRPOTrainer

__all__ = ["Stage", "Strategy", "budget", "check_positive", "sequential_stages", "training"]


@dataclass(frozen=True)
class Stage:
    """One training stage: which experiences to sample, in what shares, for how many GRPO steps.

    ``new`` are the experiences this stage newly trains (their first stage
    gives ``trained_at``); ``weights`` are the shares of tasks drawn from each
    experience, replayed ones included (positive, summing to 1 in the
    built-in strategies); ``seed`` seeds the stage's task order.
    """

    index: int
    name: str
    new: tuple[str, ...]
    steps: int
    weights: dict[str, float]
    seed: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "new", tuple(self.new))
        object.__setattr__(self, "weights", dict(self.weights))
        check_positive("index", self.index)
        check_positive("steps", self.steps)
        check_seed(self.seed, "seed")
        if not self.weights:
            raise ValueError(f"weights of stage {self.index} must name at least one experience")
        for name, weight in self.weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    math.isfinite(weight) and weight > 0):
                raise ValueError(f"weights of stage {self.index}: {name!r} must be a finite number > 0, got {weight!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"index", "name", "new", "steps", "weights", "seed"}``."""
        return {"index": self.index, "name": self.name, "new": list(self.new), "steps": self.steps,
                "weights": dict(self.weights), "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stage:
        """The inverse of `to_dict`."""
        return cls(index=int(data["index"]), name=str(data["name"]), new=tuple(data["new"]),
                   steps=int(data["steps"]), weights={str(k): float(v) for k, v in data["weights"].items()},
                   seed=int(data["seed"]))


class Strategy:
    """Base of every strategy: ``plan`` the stages; optional per-stage hooks.

    Subclasses are dataclasses whose fields are their options (no ``seed``:
    `plan` receives the run's). ``needs_base_success`` tells the runner to
    measure the untouched model's success on each training experience's
    train tasks and pass it to ``plan``. The runner calls ``plan`` once, then
    per stage ``before_stage``, trains, ``after_stage`` — also after a resume,
    with the trainer holding the weights of the last finished stage.
    """

    name: ClassVar[str] = ""
    needs_base_success: ClassVar[bool] = False

    def plan(self, stream: Stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        """The stages of ``stream``; built-ins set ``Stage.seed = derive_seed(seed, "stage", index)``."""
        raise NotImplementedError

    def before_stage(self, stage: Stage, trainer: GRPOTrainer) -> None:
        """Called by the runner before training ``stage``; default no-op."""

    def after_stage(self, stage: Stage, trainer: GRPOTrainer) -> None:
        """Called by the runner after training (and before evaluating) ``stage``; default no-op."""


def budget(experience: Experience, steps_per_experience: int) -> int:
    """GRPO steps for ``experience``: its own ``steps``, else the strategy default."""
    steps = experience.steps if experience.steps is not None else steps_per_experience
    if steps < 1:
        raise ValueError(f"steps for {experience.name} must be >= 1, got {steps}")
    return steps


def training(stream: Stream) -> list[Experience]:
    """The stream's training experiences; an empty list is a mistake worth saying."""
    if not stream.train:
        raise ValueError("the stream has no training experiences to plan")
    return list(stream.train)


def check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def sequential_stages(order: Sequence[Experience], steps_per_experience: int, seed: int) -> list[Stage]:
    """One stage per experience of ``order``, each training it alone."""
    return [
        Stage(index=i, name=e.name, new=(e.name,), steps=budget(e, steps_per_experience),
              weights={e.name: 1.0}, seed=derive_seed(seed, "stage", i))
        for i, e in enumerate(order, start=1)
    ]
