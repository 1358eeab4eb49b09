"""What the vLLM engine and server tests share: the environment, its tasks, and the trainer-side log-probs."""

from __future__ import annotations

import torch

from contrail.agent import SamplingParams
from contrail.testing import MagicWordEnv
from contrail.train.logprobs import sequence_logprobs


def make_env(task):
    return MagicWordEnv()


def tasks(n):
    return (MagicWordEnv().tasks("train", "easy") * n)[:n]


def trainer_logprobs(model, ids):
    """The trainer's log-prob of every id of ``ids`` after the first."""
    with torch.no_grad():
        return sequence_logprobs(model, torch.tensor([ids]))[0, 1:].tolist()


def max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def check_per_prompt_seeds(policy):
    """A prompt's sample depends on its seed, not on its neighbours; the backend's own stream is untouched."""
    backend, chat = policy.backend, policy.chat
    prompts = [chat.prompt_ids([{"role": "user", "content": f"say fruit {i}"}]) for i in range(4)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    together = [g.ids for g in backend.generate(prompts, params, seeds=[40, 41, 42, 43])]
    assert [g.ids for g in backend.generate(prompts[2:0:-1], params, seeds=[42, 41])] == together[2:0:-1]
    state = backend.generator_state()
    backend.generate(prompts[:1], params, seeds=[40])
    assert backend.generator_state().tolist() == state.tolist()
