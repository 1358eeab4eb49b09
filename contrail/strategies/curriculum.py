"""``curriculum``: sequential stages ordered easy→hard (declared levels, or measured base success)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from contrail import envs
from contrail.strategies.base import (
    Stage,
    Strategy,
    check_positive,
    sequential_stages,
    training,
)
from contrail.strategies.registry import register
from contrail.stream import Experience, Stream


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

    BY: ClassVar[tuple[str, ...]] = ("declared", "measured")

    def __post_init__(self) -> None:
        if self.by not in self.BY:
            raise ValueError(f"curriculum 'by' must be one of {', '.join(self.BY)}, got {self.by!r}")
        check_positive("steps_per_experience", self.steps_per_experience)

    @property
    def needs_base_success(self) -> bool:  # type: ignore[override]
        return self.by == "measured"

    def order(self, stream: Stream, base_success: dict[str, float] | None = None) -> list[Experience]:
        """The training experiences in curriculum order."""
        train = training(stream)
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

    def plan(self, stream: Stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        return sequential_stages(self.order(stream, base_success), self.steps_per_experience, seed)


def _declared_rank(experience: Experience) -> float:
    if experience.difficulty is None:
        return 0.5
    levels = tuple(getattr(envs.env_class(experience.env), "difficulties", ()))
    if experience.difficulty not in levels or len(levels) < 2:
        return 0.5
    return levels.index(experience.difficulty) / (len(levels) - 1)
