"""BabyAI behind AgentGym's text interface: `BabyAIEnv` (registered as ``babyai``).

Modules: `levels` (the 40 levels and task ids), `view` (the description of
what the agent sees), `actions` (the macro-action menu and playing a macro),
`planner` and `expert` (the privileged expert), `solvable` (which test tasks
the expert solves), `env` (the environment).
"""

from contrail.envs.babyai.env import BabyAIEnv

__all__ = ["BabyAIEnv"]
