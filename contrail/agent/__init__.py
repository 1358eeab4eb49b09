"""The acting side: chat rendering, generation backends, batched multi-turn rollouts."""

from contrail.agent.backend import Backend, Generation, HFBackend, SamplingParams
from contrail.agent.chat import ChatFormat, TemplateError
from contrail.agent.rollout import (
    Episode,
    RolloutConfig,
    Trajectory,
    close_unfinished,
    play,
    rollout,
    start_episodes,
)

__all__ = [
    "Backend", "ChatFormat", "Episode", "Generation", "HFBackend", "RolloutConfig", "SamplingParams",
    "TemplateError", "Trajectory", "close_unfinished", "play", "rollout", "start_episodes",
]
