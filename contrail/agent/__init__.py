"""The acting side: chat rendering, generation backends, batched multi-turn rollouts."""

from contrail.agent.backend import Backend, Generation, HFBackend, SamplingParams
from contrail.agent.chat import ChatFormat, TemplateError
from contrail.agent.rollout import RolloutConfig, Trajectory, rollout

__all__ = [
    "Backend", "ChatFormat", "Generation", "HFBackend", "RolloutConfig", "SamplingParams",
    "TemplateError", "Trajectory", "rollout",
]
