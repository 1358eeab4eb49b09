"""Evaluating a policy on test experiences: avg@k, pass@k, reward, turns, tokens, invalid actions.

Every experience's tasks are played ``k`` times each, in batched rollouts of
that experience's episodes with similar opening prompts, and summarised per
experience.
``avg@k`` (the paper's metric) is the mean over tasks of the success rate of
the ``k`` samples; ``pass@k`` is the share of tasks solved at least once.
An episode whose environment raised (in its constructor, ``reset`` or
``step``) fails and is counted in `EvalResult.errors`; the evaluation goes on.

>>> evaluator = Evaluator(tasks, make_env, experiment.eval_rollout, k=4, seed=derive_seed(0, "eval"))
>>> results = evaluator(model, tokenizer)        # {experience: EvalResult}
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from contrail.agent.backend import Backend
from contrail.agent.chat import ChatFormat
from contrail.agent.rollout import (
    Episode,
    RolloutConfig,
    Trajectory,
    close_unfinished,
    per_turn_rate,
    play,
    start_episodes,
)
from contrail.envs.base import Env, Task
from contrail.policy import Policy
from contrail.progress import EpisodeProgress
from contrail.seeds import derive_seed


@dataclass(frozen=True)
class EvalResult:
    """Summary of one experience's evaluation.

    Rates and means are over all ``tasks * k`` episodes (``nan`` when there
    are none); ``errors`` counts the episodes whose environment raised.
    ``cut_rate`` is the share of turns cut off at ``max_new_tokens`` before the
    model ended them (``nan`` in results written before it was recorded).
    """

    tasks: int
    k: int
    avg_at_k: float
    pass_at_k: float
    reward: float
    turns: float
    generated_tokens: float
    invalid_rate: float
    truncated_rate: float
    errors: int
    cut_rate: float = math.nan

    def to_dict(self) -> dict:
        return asdict(self)


def select_tasks(tasks: list[Task], count: int | None, seed: int = 0) -> list[Task]:
    """A deterministic sample of ``count`` tasks spread over the whole list (all when None)."""
    if count is None or count >= len(tasks):
        return list(tasks)
    if count < 1:
        raise ValueError(f"the number of tasks must be >= 1, got {count}")
    chosen = random.Random(seed).sample(range(len(tasks)), count)
    return [tasks[i] for i in sorted(chosen)]


def summarize(trajectories: list[Trajectory], k: int) -> EvalResult:
    """Aggregate the ``k`` samples of each task into one `EvalResult`."""
    by_task: dict[tuple[str, int], list[Trajectory]] = {}
    for traj in trajectories:
        by_task.setdefault((traj.task.env, traj.task.id), []).append(traj)
    success_rates = [np.mean([t.success for t in group]) for group in by_task.values()]
    solved = [any(t.success for t in group) for group in by_task.values()]
    return EvalResult(
        tasks=len(by_task), k=k,
        avg_at_k=float(np.mean(success_rates)) if success_rates else float("nan"),
        pass_at_k=float(np.mean(solved)) if solved else float("nan"),
        reward=float(np.mean([t.reward for t in trajectories])) if trajectories else float("nan"),
        turns=float(np.mean([t.turns for t in trajectories])) if trajectories else float("nan"),
        generated_tokens=float(np.mean([t.generated_tokens for t in trajectories])) if trajectories else float("nan"),
        invalid_rate=per_turn_rate(trajectories, "invalid_actions", empty=float("nan")),
        truncated_rate=float(np.mean([t.truncated for t in trajectories])) if trajectories else float("nan"),
        errors=sum(t.error is not None for t in trajectories),
        cut_rate=per_turn_rate(trajectories, "cut_turns", empty=float("nan")),
    )


def episode_seed(seed: int, task: Task, sample: int) -> int:
    """The sampling seed of sample ``sample`` of ``task`` in an evaluation seeded ``seed``."""
    return derive_seed(seed, task.env, task.id, sample)


# Episodes are started up to this many batches at a time and batched by opening length within them
# (`evaluate`): more gives closer lengths in each batch, at the cost of that many live environments.
START_BATCHES = 4


def _interleave(experiences: dict[str, list[Task]], k: int) -> list[tuple[str, Task, int]]:
    """Every (experience, task, sample), round-robin over experiences, first samples first."""
    jobs = [(sample, position, order, name, task)
            for order, (name, tasks) in enumerate(experiences.items())
            for position, task in enumerate(tasks) for sample in range(k)]
    return [(name, task, sample) for sample, _, _, name, task in sorted(jobs, key=lambda job: job[:3])]


def _batch_groups(experiences: dict[str, list[Task]], k: int, mixed: bool) -> list[list[tuple[str, Task, int]]]:
    """The jobs in groups whose episodes may share a batch: one group per experience, or one for all.

    Apart, an experience's row depends on the model and its own tasks only:
    in bf16 a product's rounding depends on the batch's shape and padding, and
    one rounding that flips a sampled token changes the rest of an episode, so
    batched beside another experience's episodes (whose lengths follow the
    model too) the same model scored 0.320 on the quickstart's BabyAI tests
    and 0.266 tested alone (session 31). It costs at most one part-filled
    batch per experience: the quickstart's row took as long either way
    (``bench/rollout.py --experience-batches``).
    """
    if mixed:
        return [_interleave(experiences, k)]
    return [jobs for name, tasks in experiences.items() if (jobs := _interleave({name: tasks}, k))]


def _batches(episodes: list[Episode], batch_episodes: int, by_opening_length: bool) -> list[list[Episode]]:
    """``episodes`` in batches of ``batch_episodes``: shortest opening prompts first, or in their order.

    A batch is left-padded to its longest prompt, and every decode step of
    every turn reads that padding in the KV cache; BabyAI's openings alone
    run from about 380 to 780 tokens. Ties keep their order.
    """
    if by_opening_length:
        episodes = sorted(episodes, key=lambda episode: len(episode.trajectory.ids))
    return [episodes[start:start + batch_episodes] for start in range(0, len(episodes), batch_episodes)]


def evaluate(
    backend: Backend,
    chat: ChatFormat,
    experiences: dict[str, list[Task]],
    make_env: Callable[[Task], Env],
    k: int = 1,
    config: RolloutConfig = RolloutConfig(),
    batch_episodes: int = 64,
    trajectories_path: str | Path | None = None,
    description: str = "evaluating",
    show_progress: bool = True,
    episodes: dict[str, list[Trajectory]] | None = None,
    seed: int | None = None,
    by_opening_length: bool = True,
    mixed_batches: bool = False,
) -> dict[str, EvalResult]:
    """Play every task of every experience ``k`` times; return results keyed by experience name.

    With ``seed``, sample ``j`` of a task samples from its own streams,
    seeded by ``derive_seed(seed, task.env, task.id, j)`` (`episode_seed`):
    its random numbers do not depend on what shares its batch, and two
    models evaluated with one seed see the same ones, token by token, so
    their difference on a task is the models' (common random numbers), up
    to rounding, which in bf16 follows a batch's shape. Without ``seed``,
    the backend's own generator.

    Each experience's episodes are started (environments built and reset)
    ``START_BATCHES`` batches at a time and played in batches of
    ``batch_episodes`` with similar opening lengths (`_batches`), apart from
    other experiences' (`_batch_groups`: in bf16 a row would otherwise
    depend on what else the stream tests); environments that are not
    `Env.cheap_to_hold` (ALFWorld) are started a batch at a time. For
    comparison (``bench/rollout.py``), ``mixed_batches=True`` batches all
    experiences together, interleaved, and ``by_opening_length=False`` plays
    batches in task order. When ``trajectories_path`` is given, every
    episode is appended there as one readable JSON line (the conversation
    and its outcome, and the ``"experience"`` it was played for: a task may
    belong to two test experiences, ``babyai`` and ``babyai:easy``), a
    window of started episodes at a time. When ``episodes`` is given, it
    receives the `Trajectory` objects themselves, keyed by experience (the
    start model's samples for `contrail.drift`).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    groups = _batch_groups(experiences, k, mixed_batches)
    results: dict[str, list[Trajectory]] = {name: [] for name in experiences}
    sink = open(trajectories_path, "a", encoding="utf-8") if trajectories_path else None
    try:
        with EpisodeProgress(sum(map(len, groups)), description, enabled=show_progress) as progress:
            for jobs in groups:
                for window in _play_windows(jobs, backend, chat, make_env, config, batch_episodes, seed,
                                            progress, by_opening_length):
                    for name, episode in window:
                        results[name].append(episode.trajectory)
                        if sink:
                            sink.write(json.dumps({**episode.trajectory.to_record(), "experience": name}) + "\n")
                    if sink:
                        sink.flush()
    finally:
        if sink:
            sink.close()
    if episodes is not None:
        episodes.update(results)
    return {name: summarize(trajs, k) for name, trajs in results.items()}


def _play_windows(jobs: list[tuple[str, Task, int]], backend: Backend, chat: ChatFormat,
                  make_env: Callable[[Task], Env], config: RolloutConfig, batch_episodes: int, seed: int | None,
                  progress: EpisodeProgress, by_opening_length: bool) -> Iterator[list[tuple[str, Episode]]]:
    """Play ``jobs`` a window of started episodes at a time (`_start_ahead`); yield each window's
    (experience, episode) pairs in job order."""
    window = batch_episodes * START_BATCHES
    start = 0
    while start < len(jobs):
        started = _start_ahead(jobs[start:start + window], batch_episodes, make_env, chat, config, seed)
        _play_in_batches(backend, chat, started, batch_episodes, config, progress, by_opening_length)
        # Paired by job: only the job knows which experience an episode is for.
        yield [(name, episode) for (name, _, _), episode in zip(jobs[start:start + len(started)], started, strict=True)]
        start += len(started)


def _play_in_batches(backend: Backend, chat: ChatFormat, started: list[Episode], batch_episodes: int,
                     config: RolloutConfig, progress: EpisodeProgress, by_opening_length: bool) -> None:
    """Play ``started`` in batches (of similar opening length, or in order); after an error, close all still open."""
    try:
        for batch in _batches(started, batch_episodes, by_opening_length):
            play(backend, chat, batch, config, on_turn=progress.turn_done,
                 on_episode=lambda traj: progress.episode_done(traj.success))
    finally:
        close_unfinished(started)


def _start_ahead(jobs: list[tuple[str, Task, int]], batch_episodes: int, make_env: Callable[[Task], Env],
                 chat: ChatFormat, config: RolloutConfig, seed: int | None) -> list[Episode]:
    """Start the episodes of ``jobs`` (up to ``START_BATCHES`` batches), or of its first batch only.

    The first batch's environments decide (with mixed batches, experiences
    are interleaved, so it holds each of them): when any is not
    `Env.cheap_to_hold`, nothing is started ahead of its batch.
    """
    started = _start(jobs[:batch_episodes], make_env, chat, config, seed)
    if all(getattr(episode.env, "cheap_to_hold", True) for episode in started):
        try:
            started += _start(jobs[batch_episodes:], make_env, chat, config, seed)
        except BaseException:  # an interrupt while starting the rest: the first batch is not left open
            close_unfinished(started)
            raise
    return started


def _start(jobs: list[tuple[str, Task, int]], make_env: Callable[[Task], Env], chat: ChatFormat,
           config: RolloutConfig, seed: int | None) -> list[Episode]:
    """Start one episode per job (`start_episodes`), each with its `episode_seed` when ``seed`` is given."""
    seeds = [episode_seed(seed, task, sample) for _, task, sample in jobs] if seed is not None else None
    return start_episodes([task for _, task, _ in jobs], make_env, chat, config,
                          samples=[sample for _, _, sample in jobs], seeds=seeds)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global random state on exit.

    Evaluation between stages must not move the training's random streams:
    a run resumed from a checkpoint (saved before the evaluation) then
    continues exactly as the uninterrupted run did.
    """
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


class Evaluator:
    """Evaluates a model on fixed tasks per experience, sampling from the same seed on every call.

    Every call plays the same episodes (``tasks`` x ``k``), each sampling
    from its own streams seeded from ``seed`` (`episode_seed`): two rows see
    the same random numbers, token by token, so they differ because the
    model changed, not because the sampling did, and an experience's row
    does not depend on the other experiences tested (`evaluate`). The global
    random state is left as it was (`preserved_rng`).

    Args:
        tasks: test tasks keyed by experience name.
        make_env: builds a fresh environment for a task.
        rollout: limits and sampling of evaluation episodes (``Experiment.eval_rollout``).
        k: samples per task.
        batch_episodes: episodes per batched rollout.
        seed: the sampling seed (``derive_seed(root, "eval")`` in a run).
        show_progress: show a progress bar.
    """

    def __init__(self, tasks: dict[str, list[Task]], make_env: Callable[[Task], Env], rollout: RolloutConfig,
                 *, k: int, batch_episodes: int = 64, seed: int = 0, show_progress: bool = True) -> None:
        self.tasks, self.make_env, self.rollout = tasks, make_env, rollout
        self.k, self.batch_episodes, self.seed, self.show_progress = k, batch_episodes, seed, show_progress

    def __call__(self, model, tokenizer, *, trajectories_path: str | Path | None = None,
                 description: str = "evaluating", autocast_bf16: bool = False,
                 episodes: dict[str, list[Trajectory]] | None = None) -> dict[str, EvalResult]:
        """Evaluate ``model``; with ``trajectories_path``, (re)write the episodes there as JSON lines.

        ``episodes``, when given, receives every experience's `Trajectory`
        objects (token ids, masks and the sampler's log-probs included).
        """
        if trajectories_path is not None:
            Path(trajectories_path).unlink(missing_ok=True)  # a rerun replaces, never appends
        was_training = model.training
        model.eval()
        try:
            with preserved_rng():
                # One backend batch holds a whole evaluation batch: a smaller one would split it into chunks
                # that re-prefill every episode's history each turn.
                policy = Policy.from_model(model, tokenizer, seed=self.seed, autocast_bf16=autocast_bf16,
                                           rollout=self.rollout, max_batch_size=self.batch_episodes)
                return evaluate(policy.backend, policy.chat, self.tasks, self.make_env, k=self.k,
                                config=self.rollout, batch_episodes=self.batch_episodes,
                                trajectories_path=trajectories_path, description=description,
                                show_progress=self.show_progress, episodes=episodes, seed=self.seed)
        finally:
            model.train(was_training)
