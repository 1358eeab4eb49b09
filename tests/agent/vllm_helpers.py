"""What the vLLM engine and server tests share: the environment, its tasks, and the trainer-side log-probs."""

from __future__ import annotations

import torch

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
