"""Scripted actors that play through the same rollout path as a model.

`ExpertBackend` writes each environment's expert text and `RandomBackend` a
random valid action; both encode the text with the model's tokenizer and end
it with the stop token, exactly where a model's sampled ids would be. So
expert demonstrations and random baselines go through the same parsing,
chat rendering and token bookkeeping as a model's rollouts.
"""

from __future__ import annotations

import random

from contrail.agent.backend import Generation, SamplingParams
from contrail.agent.chat import ChatFormat
from contrail.envs.base import Env


class _TextActor:
    reads_envs = True  # the rollout passes each live episode's environment

    def __init__(self, chat: ChatFormat):
        self.chat = chat
        self.stop = chat.assistant_close_ids[0] if chat.assistant_close_ids else chat.tokenizer.eos_token_id

    def text_for(self, env: Env) -> str:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: SamplingParams, envs: list[Env]) -> list[Generation]:
        generations = []
        for env in envs:
            ids = self.chat.tokenizer(self.text_for(env), add_special_tokens=False)["input_ids"]
            ids = ids[: params.max_new_tokens - 1] + [self.stop]
            generations.append(Generation(ids, [0.0] * len(ids), stopped=True))
        return generations


class ExpertBackend(_TextActor):
    """Writes what the environment's expert would write now."""

    def text_for(self, env: Env) -> str:
        return env.expert()


class RandomBackend(_TextActor):
    """Writes a uniformly random valid action (a baseline)."""

    def __init__(self, chat: ChatFormat, seed: int = 0):
        super().__init__(chat)
        self.rng = random.Random(seed)

    def text_for(self, env: Env) -> str:
        return env.random_action(self.rng)
