"""Strategies: small planners that turn a `Stream` into training stages, and per-stage hooks.

A strategy decides *what* each stage trains on and for how many GRPO steps
(`Strategy.plan` → a list of `Stage`, plain data); the runner drives the loop
(per stage: ``before_stage``, train on `stage_sampler(stage, stream)`,
``after_stage``, evaluate, record a row) and the trainer knows nothing about
continual learning. Hooks change training only through the trainer's public
seams (`GRPOTrainer.add_loss_term`, `GRPOTrainer.add_trajectory_editor`,
`GRPOTrainer.collect`).

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
kl_anchor      sequential; every update adds ``beta``·KL(π_θ ‖ π_prev) on its sampled
               tokens, π_prev = the policy at the end of the previous stage
ewc            sequential; from stage 2 every update adds ``lam``/2·Σ F_i (θ_i - θ*_i)²,
               F = diagonal Fisher from the previous stage's rollouts, θ* its weights
=============  ==================================================================

A stage's budget is its experience's ``steps`` or, when that is ``None``, the
strategy's ``steps_per_experience``. Stage seeds are
``derive_seed(seed, "stage", index)`` of the run's root seed.

Writing your own strategy takes a few lines: a dataclass whose fields are its
options, a ``plan``, and optionally the hooks. Name it in YAML by its
registered name, by an entry point in the ``contrail.strategies`` group, or as
``"pkg.module:Class"``::

    from dataclasses import dataclass
    from contrail import strategies
    from contrail.seeds import derive_seed
    from contrail.strategies import Stage, Strategy, budget

    @strategies.register("reverse")
    @dataclass
    class Reverse(Strategy):
        steps_per_experience: int = 10

        def plan(self, stream, *, seed, base_success=None):
            return [Stage(index=i, name=e.name, new=(e.name,), steps=budget(e, self.steps_per_experience),
                          weights={e.name: 1.0}, seed=derive_seed(seed, "stage", i))
                    for i, e in enumerate(reversed(stream.train), start=1)]

    strategies.make("reverse", steps_per_experience=5)   # or `strategy: {name: reverse}` in YAML
"""

from contrail.strategies.base import Stage, Strategy, budget
from contrail.strategies.curriculum import Curriculum
from contrail.strategies.ewc import EWC
from contrail.strategies.kl_anchor import KLAnchor
from contrail.strategies.mixture import Mixture
from contrail.strategies.registry import (
    ENTRY_POINT_GROUP,
    StrategyOptionError,
    make,
    names,
    options,
    register,
    strategy_class,
)
from contrail.strategies.replay import Replay
from contrail.strategies.sampler import TaskSampler, stage_sampler
from contrail.strategies.sequential import Sequential

__all__ = [
    "ENTRY_POINT_GROUP", "EWC", "Curriculum", "KLAnchor", "Mixture", "Replay", "Sequential", "Stage", "Strategy",
    "StrategyOptionError", "TaskSampler", "budget", "make", "names", "options", "register", "stage_sampler",
    "strategy_class",
]
