"""``sequential``: one stage per training experience, in stream order."""

from __future__ import annotations

from dataclasses import dataclass

from contrail.strategies.base import (
    Stage,
    Strategy,
    check_positive,
    sequential_stages,
    training,
)
from contrail.strategies.registry import register
from contrail.stream import Stream


@register("sequential")
@dataclass
class Sequential(Strategy):
    """One stage per training experience, in stream order."""

    steps_per_experience: int = 10

    def __post_init__(self) -> None:
        check_positive("steps_per_experience", self.steps_per_experience)

    def plan(self, stream: Stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        return sequential_stages(training(stream), self.steps_per_experience, seed)
