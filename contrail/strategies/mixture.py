"""``mixture``: one stage over every training experience, with the total sequential budget."""

from __future__ import annotations

from dataclasses import dataclass

from contrail.seeds import derive_seed
from contrail.strategies.base import Stage, Strategy, budget, check_positive, training
from contrail.strategies.registry import register
from contrail.stream import Stream


@register("mixture")
@dataclass
class Mixture(Strategy):
    """One stage over every training experience, with the sum of the sequential budgets (equal compute).

    ``weights`` (``{name: w}``) sets each experience's share of tasks
    (uniform by default; unlisted experiences get 0 and are not trained).
    """

    steps_per_experience: int = 10
    weights: dict[str, float] | None = None

    def __post_init__(self) -> None:
        check_positive("steps_per_experience", self.steps_per_experience)
        for name, weight in (self.weights or {}).items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                raise ValueError(f"weights: {name!r} must be a number >= 0, got {weight!r}")

    def plan(self, stream: Stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        train = training(stream)
        names = [e.name for e in train]
        if self.weights is None:
            raw = {name: 1.0 for name in names}
        else:
            unknown = sorted(set(self.weights) - set(names))
            if unknown:
                raise ValueError(f"mixture weights name {unknown}, not training experiences; valid: {names}")
            raw = {name: float(self.weights.get(name, 0.0)) for name in names}
        total = sum(raw.values())
        if total <= 0:
            raise ValueError(f"mixture weights must give at least one experience a positive share, got {raw}")
        shares = {name: w / total for name, w in raw.items() if w > 0}
        steps = sum(budget(e, self.steps_per_experience) for e in train)
        return [Stage(index=1, name="mixture", new=tuple(shares), steps=steps, weights=shares,
                      seed=derive_seed(seed, "stage", 1))]
