"""Deterministic, resumable task sampling, and the sampler of a stage."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from contrail.envs.base import Task

if TYPE_CHECKING:
    from contrail.strategies.base import Stage
    from contrail.stream import Stream

__all__ = ["TaskSampler", "stage_sampler"]


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


def stage_sampler(stage: Stage, stream: Stream) -> TaskSampler:
    """The task sampler of ``stage``: its weights over the stream's experiences' train tasks, seeded by the stage.

    A fresh sampler replays the stage's task sequence from its start, so a
    stage rebuilt from ``plan.json`` draws the same tasks.
    """
    experiences = {e.name: e for e in stream.experiences}
    unknown = [name for name in stage.weights if name not in experiences]
    if unknown:
        raise ValueError(
            f"stage {stage.index} ({stage.name}) samples {unknown}, which are not experiences of the stream; "
            f"valid: {', '.join(experiences)}"
        )
    pools = {name: experiences[name].train_tasks for name in stage.weights}
    return TaskSampler(pools, stage.weights, seed=stage.seed)
