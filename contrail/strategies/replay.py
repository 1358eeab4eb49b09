"""``replay``: sequential, and each later stage draws a share of its tasks from earlier experiences."""

from __future__ import annotations

from dataclasses import dataclass

from contrail.seeds import derive_seed
from contrail.strategies.base import Stage, Strategy, budget, check_positive, training
from contrail.strategies.registry import register
from contrail.stream import Stream


@register("replay")
@dataclass
class Replay(Strategy):
    """Sequential, and stage ``s > 1`` draws ``replay_share`` of its tasks from earlier experiences.

    The replayed share is split uniformly among the distinct earlier
    experiences; stage 1 has nothing to replay and trains its experience alone.
    """

    replay_share: float = 0.25
    steps_per_experience: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.replay_share, bool) or not isinstance(self.replay_share, (int, float)) or \
                not 0.0 <= self.replay_share < 1.0:
            raise ValueError(f"replay_share must be in [0, 1), got {self.replay_share!r}")
        check_positive("steps_per_experience", self.steps_per_experience)

    def plan(self, stream: Stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        stages = []
        seen: list[str] = []
        for i, e in enumerate(training(stream), start=1):
            earlier = [name for name in seen if name != e.name]
            weights = {e.name: 1.0}
            if earlier and self.replay_share > 0:
                weights = {e.name: 1.0 - self.replay_share}
                weights.update({name: self.replay_share / len(earlier) for name in earlier})
            stages.append(Stage(index=i, name=e.name, new=(e.name,), steps=budget(e, self.steps_per_experience),
                                weights=weights, seed=derive_seed(seed, "stage", i)))
            if e.name not in seen:
                seen.append(e.name)
        return stages
