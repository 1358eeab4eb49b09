"""Soak test (issue #15): many GRPO steps over all five environments in one process, looking for leaks.

The tiny model trains on a mixture of babyai, textcraft, alfworld, webshop
and searchqa (easy train tasks, `TaskSampler` pools of equal weight) for
``CONTRAIL_SOAK_STEPS`` steps (default 300), two tasks a step, two episodes
a task, a few tokens a turn. Each pool holds the first ``CONTRAIL_SOAK_POOL``
(default 12) tasks of its environment, so by the warm-up every task has been
played once and every per-task cache (a generated ALFWorld game, a BabyAI
level) is filled: memory that still grows after it is a leak, not a cache
(``CONTRAIL_SOAK_POOL=0`` uses every task, for the long-run picture). It
reports, and bounds:

- the peak RSS growth after warm-up (step `WARMUP`: every environment has
  been built, its caches filled, the optimizer state allocated);
- open file descriptors at the end against the start and the warm-up;
- child processes at the end (none may be left);
- every environment built was closed (a wrapping ``make_env`` counts both).

A leak of one descriptor, one child process or one unclosed environment per
episode, or of a quarter of a megabyte per step, breaks a bound. Outside the
default suite (marked ``slow`` and ``soak``)::

    python -m pytest -m soak -s tests/test_soak.py
    CONTRAIL_SOAK_STEPS=60 CONTRAIL_SOAK_POOL=0 python -m pytest -m soak -s tests/test_soak.py
"""

from __future__ import annotations

import gc
import os
import time

import psutil
import pytest
import torch

from contrail.agent.rollout import RolloutConfig
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.strategies.sampler import TaskSampler
from contrail.testing import tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.soak]

ENVS = ("babyai", "textcraft", "alfworld", "webshop", "searchqa")
STEPS = int(os.environ.get("CONTRAIL_SOAK_STEPS", "300"))
POOL = int(os.environ.get("CONTRAIL_SOAK_POOL", "12")) or None  # 0: every task
WARMUP = min(30, STEPS // 3)  # 30 steps x 2 tasks = 12 per environment: each pool played through once
# After warm-up a pool's caches are full (7.5 MB growth measured over 270 steps); with every task new
# games keep being cached (79 MB measured), so that run gets the looser bound.
RSS_GROWTH_LIMIT_MB = 64.0 if POOL else 200.0
FD_SLACK = 4  # a lazily opened log or cache file is fine; one per episode is not


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


class CountingFactory:
    """``make_env`` that counts the environments it builds, those closed at least once, and ``close()`` calls.

    An environment may close itself too (an engine released when its episode
    ends), so calls can outnumber environments; every one must be closed.
    """

    def __init__(self, make_env) -> None:
        self.make_env, self.built, self.closed, self.close_calls = make_env, 0, 0, 0
        # id -> (env name, env): holding the env keeps its id from going to a later env until it is closed
        self.open: dict[int, tuple[str, object]] = {}

    def __call__(self, task):
        env = self.make_env(task.env)
        self.built += 1
        key, real_close = id(env), env.close
        self.open[key] = (task.env, env)

        def close() -> None:
            self.close_calls += 1
            if self.open.pop(key, None) is not None:
                self.closed += 1
            real_close()

        env.close = close
        return env


def test_soak_all_five_environments(make_env):  # make_env: tests/conftest.py (one disk cache per session)
    if STEPS < 3:
        pytest.fail(f"CONTRAIL_SOAK_STEPS must be >= 3 (a warm-up and steps after it), got {STEPS}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = soak(make_env)
    finally:
        torch.set_num_threads(threads)
    print("\nsoak:", "  ".join(f"{k} {v}" for k, v in figures.items()))
    assert figures["envs_closed"] == figures["envs_built"] > 0, figures["unclosed_by_env"]
    assert figures["rss_growth_after_warmup_mb"] < RSS_GROWTH_LIMIT_MB
    assert figures["fds_end"] - figures["fds_warmup"] <= FD_SLACK
    assert abs(figures["fds_end"] - figures["fds_start"]) <= 2 * FD_SLACK
    assert figures["children_end"] == 0, figures["children"]
    assert figures["episode_errors"] == 0


def soak(make_env) -> dict:
    process = psutil.Process()
    gc.collect()
    fds_start, rss_start = open_fds(), rss_mb()
    tokenizer = tiny_tokenizer()
    pools = {name: make_env(name).tasks("train", "easy")[:POOL] for name in ENVS}  # tasks() starts no engine
    factory = CountingFactory(make_env)
    trainer = GRPOTrainer(
        tiny_model(tokenizer, seed=0), tokenizer,
        GRPOConfig(lr=1e-3, group_size=2, tasks_per_step=2, skip_zero_advantage=False),
        RolloutConfig(max_new_tokens=4, max_episode_tokens=1024, max_turns=4),
        factory, seed=0, show_progress=False,
    )
    sampler = TaskSampler(pools, seed=0)
    rss: list[float] = []
    errors = 0.0
    marks: dict[str, float] = {}
    started = time.perf_counter()

    def on_step(stats: dict) -> None:
        nonlocal errors
        errors += stats.get("episode_errors", 0.0)
        if len(rss) + 1 == WARMUP:
            gc.collect()
            marks["fds_warmup"] = open_fds()
        rss.append(rss_mb())

    trainer.train(sampler, STEPS, on_step=on_step)
    seconds = time.perf_counter() - started
    drawn = sampler.state_dict()
    del trainer
    gc.collect()
    children = process.children(recursive=True)
    after = rss[WARMUP - 1:]
    return {
        "steps": STEPS,
        "pool": POOL or "all",
        "seconds": round(seconds, 1),
        "rss_start_mb": round(rss_start, 1),
        "rss_warmup_mb": round(after[0], 1),
        "rss_peak_mb": round(max(rss), 1),
        "rss_end_mb": round(rss[-1], 1),
        "rss_by_step_mb": {step: round(rss[step - 1], 1) for step in sorted({WARMUP, STEPS // 2, STEPS})},
        "rss_growth_after_warmup_mb": round(max(after) - after[0], 1),
        "fds_start": fds_start,
        "fds_warmup": int(marks["fds_warmup"]),
        "fds_end": open_fds(),
        "children_end": len(children),
        "children": [c.name() for c in children],
        "envs_built": factory.built,
        "envs_closed": factory.closed,
        "close_calls": factory.close_calls,
        "unclosed_by_env": sorted(name for name, _ in factory.open.values()),
        "episode_errors": errors,
        "tasks_drawn": drawn["counts"],
    }
