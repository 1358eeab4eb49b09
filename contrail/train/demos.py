"""Expert demonstrations: experts' episodes rendered through the rollout path.

The expert's text goes through the same rollout as a model's (`ExpertBackend`),
so demonstrations carry the same chat rendering and token bookkeeping: ids,
and a mask that is 1 exactly on the assistant's tokens. Supervised and
reinforcement training therefore see identical tokens.

Demonstrations come only from *training* tasks, are deterministic from a
seed, and are cached on disk keyed by everything that shapes them. What to
demonstrate is read from the experiment's one warm-start type,
`contrail.experiment.WarmStart` (``envs``, ``episodes``, ``max_episode_tokens``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

from contrail import __version__
from contrail.agent.chat import ChatFormat
from contrail.agent.rollout import RolloutConfig, Trajectory, rollout
from contrail.agent.scripted import ExpertBackend
from contrail.envs.base import Task
from contrail.models import cache_dir
from contrail.stream import Experience, env_factory
from contrail.train.trainer import Sample

if TYPE_CHECKING:
    from contrail.experiment import WarmStart

# An expert's turn is a few dozen tokens; this bound only stops a runaway expert.
EXPERT_MAX_NEW_TOKENS = 512


def expert_rollout_config(spec: WarmStart) -> RolloutConfig:
    """The rollout limits of demonstrations: ``spec.max_episode_tokens`` per episode, a generous turn.

    The rollout stops an episode whose next turn might overflow the episode,
    so the turn's bound is kept to a quarter of it.
    """
    turn = max(1, min(EXPERT_MAX_NEW_TOKENS, spec.max_episode_tokens // 4))
    return RolloutConfig(max_new_tokens=turn, max_episode_tokens=spec.max_episode_tokens)


def plan_tasks(experiences: list[Experience], episodes: int, seed: int) -> list[Task]:
    """``episodes`` training tasks split evenly over experiences, drawn without repeats while possible."""
    rng = random.Random(seed)
    tasks: list[Task] = []
    for index, experience in enumerate(experiences):
        share = episodes // len(experiences) + (1 if index < episodes % len(experiences) else 0)
        pool = list(experience.train_tasks)
        drawn: list[Task] = []
        while len(drawn) < share:
            rng.shuffle(pool)
            drawn.extend(pool[: share - len(drawn)])
        tasks.extend(drawn)
    return tasks


def expert_trajectories(spec: WarmStart, chat: ChatFormat, *, seed: int = 0,
                        show_progress: bool = False) -> list[Trajectory]:
    """Play the experts on ``spec.episodes`` training tasks (drawn with ``seed``) through the rollout path."""
    from contrail.progress import EpisodeProgress

    experiences = [Experience.from_spec(s) for s in spec.envs]
    tasks = plan_tasks(experiences, spec.episodes, seed)
    config = expert_rollout_config(spec)
    with EpisodeProgress(len(tasks), "expert demonstrations", enabled=show_progress) as progress:
        return rollout(ExpertBackend(chat), chat, tasks, env_factory(experiences), config,
                       on_episode=lambda t: progress.episode_done(t.success))


def _cache_key(spec: WarmStart, seed: int, tokenizer) -> str:
    # Only what shapes the demonstrations: the training settings (lr, epochs, ...) do not.
    identity = {
        "envs": list(spec.envs), "episodes": spec.episodes, "max_episode_tokens": spec.max_episode_tokens,
        "max_new_tokens": expert_rollout_config(spec).max_new_tokens, "seed": seed, "version": __version__,
        "tokenizer": getattr(tokenizer, "name_or_path", ""), "vocab": len(tokenizer),
        "template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def demonstrations(spec: WarmStart, tokenizer, *, seed: int = 0, use_cache: bool = True,
                   show_progress: bool = False) -> tuple[list[Sample], dict]:
    """Successful expert episodes of ``spec`` as training samples, plus a summary of how they were made.

    ``seed`` draws the training tasks (``derive_seed(root, "warmstart")`` in a
    run). Failed expert episodes are dropped (they would teach failure); the
    summary says how many there were.
    """
    path = cache_dir() / "demos" / f"{_cache_key(spec, seed, tokenizer)}.jsonl"
    if use_cache and path.exists():
        return _read(path)
    chat = ChatFormat.from_tokenizer(tokenizer)
    trajectories = expert_trajectories(spec, chat, seed=seed, show_progress=show_progress)
    kept = [t for t in trajectories if t.success and not t.truncated]
    summary = {
        "envs": list(spec.envs), "episodes": len(trajectories), "kept": len(kept), "seed": seed,
        "assistant_tokens": sum(sum(t.mask) for t in kept), "tokens": sum(len(t.ids) for t in kept),
        "splits": sorted({t.task.split for t in trajectories}),
    }
    samples = [Sample(t.ids, t.mask, {"env": t.task.env, "task": t.task.id}) for t in kept]
    if use_cache:
        _write(path, samples, summary)
    return samples, summary


def _write(path: Path, samples: list[Sample], summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # runs sharing the cache may write it at once
    with open(partial, "w", encoding="utf-8") as sink:
        sink.write(json.dumps({"summary": summary}) + "\n")
        for sample in samples:
            sink.write(json.dumps({"ids": sample.ids, "mask": sample.mask, "extras": sample.extras}) + "\n")
    partial.replace(path)


def _read(path: Path) -> tuple[list[Sample], dict]:
    with open(path, encoding="utf-8") as source:
        summary = json.loads(source.readline())["summary"]
        samples = [Sample(**json.loads(line)) for line in source]
    return samples, summary
