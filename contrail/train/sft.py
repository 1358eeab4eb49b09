"""Behaviour cloning on expert demonstrations: the warm-start before RL.

A small model cannot yet write the environments' formats, and RL needs some
successes to learn from; AgentGym trains agents this way first. `train_sft`
renders demonstrations through the rollout path (`contrail.train.demos`) and
learns them with the masked-token trainer, saving a model that ``contrail
eval`` and the GRPO trainer load. `warmstart` caches the result under
``$CONTRAIL_CACHE/warmstart/<key>`` so every run asking for the same
warm-start reuses it.

Both read the experiment's one warm-start type, `contrail.experiment.WarmStart`
(``envs, episodes, epochs, lr, max_episode_tokens, batch_size, precision``),
directly: there is no second settings type to keep in step with it.

>>> spec = WarmStart(envs=["babyai:easy"], episodes=60)
>>> path = warmstart("smollm2-135m", spec, seed=derive_seed(0, "warmstart"))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import PartialState

from contrail import __version__
from contrail.models import cache_dir, load_model
from contrail.paths import cache_lock
from contrail.precision import describe_precision, resolve_precision
from contrail.progress import StepProgress, console
from contrail.results import truncate_log
from contrail.seeds import derive_seed
from contrail.train.config import TrainConfig
from contrail.train.demos import demonstrations
from contrail.train.trainer import MaskedTokenTrainer, cross_entropy_loss

if TYPE_CHECKING:
    from contrail.experiment import WarmStart

__all__ = ["SFT_WARMUP_STEPS", "sft_config", "train_sft", "warmstart", "warmstart_key"]

SFT_WARMUP_STEPS = 5  # a short linear warm-up: the first steps' gradients on fresh formats are large


def sft_config(spec: WarmStart) -> TrainConfig:
    """The masked-token trainer's settings for ``spec`` (its lr and precision, a short warm-up)."""
    return TrainConfig(lr=spec.lr, precision=spec.precision, warmup_steps=SFT_WARMUP_STEPS)


def train_sft(model_name: str, spec: WarmStart, out: str | Path, *, seed: int = 0, dtype: str = "float32",
              resume: bool = True, show_progress: bool = True) -> Path:
    """Train ``model_name`` on the demonstrations ``spec`` describes; return the saved model's directory.

    Args:
        model_name: the model to start from (HF id, local path or the embedded alias).
        spec: what to demonstrate and how to train (``spec.epochs`` passes of
            ``spec.batch_size`` demonstrations per step at ``spec.lr``).
        out: writes ``out/model`` (final weights + tokenizer), ``out/log.jsonl`` and
            ``out/summary.json``; ``out/checkpoint`` (model and optimizer state) after each
            epoch but the last, for resuming, deleted once the model is written.
        seed: draws the demonstration tasks, seeds the trainer and the epochs' shuffles.
        dtype: the dtype the model is loaded in.
        resume: continue from ``out/checkpoint`` when a previous call was interrupted between
            epochs, and return ``out/model`` untouched when a call with these settings finished.
        show_progress: show progress bars.
    """
    out = Path(out)
    identity = {"model": model_name, "warmstart": dataclasses.asdict(spec), "seed": seed, "dtype": dtype}
    if resume and _finished(out, identity):
        return out / "model"
    out.mkdir(parents=True, exist_ok=True)
    if PartialState().is_main_process:
        (out / "summary.json").unlink(missing_ok=True)  # until this call's model is whole, none is finished here
    checkpoint = out / "checkpoint"
    resuming = resume and (checkpoint / "trainer_state.pt").exists()
    model, tokenizer = load_model(str(checkpoint / "model") if resuming else model_name, dtype=dtype)
    samples, made = demonstrations(spec, tokenizer, seed=seed, show_progress=show_progress)
    if not samples:
        raise RuntimeError(f"the experts solved none of the {made['episodes']} demonstration episodes")
    trainer = MaskedTokenTrainer(model, tokenizer, sft_config(spec), log_dir=out, seed=seed)
    first_epoch = trainer.load_state(checkpoint)["epoch"] + 1 if resuming else 0
    truncate_log(out / "log.jsonl",  # an epoch cut short is logged again in full
                 lambda entry: isinstance(entry.get("epoch"), int) and entry["epoch"] < first_epoch)
    start = time.perf_counter()
    _train_epochs(trainer, samples, spec, seed, first_epoch, out, show_progress)
    model_dir = trainer.save_model(out / "model")
    summary = {**identity, "demonstrations": made, "steps": trainer.global_step,
               "wall_seconds": time.perf_counter() - start}
    if trainer.accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        shutil.rmtree(checkpoint, ignore_errors=True)  # an earlier epoch's: the model supersedes it
    trainer.end()
    return model_dir


def _finished(out: Path, identity: dict) -> bool:
    """Whether ``out`` holds a model a call with these settings wrote (its summary comes last)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    same = {key: summary.get(key) for key in identity} == json.loads(json.dumps(identity, default=str))
    return same and _has_model(out / "model")


def _train_epochs(trainer: MaskedTokenTrainer, samples, spec: WarmStart, seed: int, first_epoch: int, out: Path,
                  show_progress: bool) -> None:
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    steps_per_epoch = -(-len(samples) // spec.batch_size)
    enabled = show_progress and trainer.accelerator.is_main_process
    with open(out / "log.jsonl", "a", encoding="utf-8") as log, StepProgress(
        steps_per_epoch * spec.epochs, "behaviour cloning", enabled, start=first_epoch * steps_per_epoch,
    ) as progress:
        for epoch in range(first_epoch, spec.epochs):
            order = list(range(len(samples)))
            random.Random(derive_seed(seed, "epoch", epoch)).shuffle(order)
            for begin in range(0, len(order), spec.batch_size):
                batch = [samples[i] for i in order[begin:begin + spec.batch_size]]
                stats = trainer.step(batch[rank::world] or batch[:1], cross_entropy_loss)
                if trainer.accelerator.is_main_process:
                    log.write(json.dumps({"epoch": epoch, "step": trainer.global_step, **stats}) + "\n")
                    log.flush()
                trainer.accelerator.log(stats, step=trainer.global_step)
                progress.step_done(f"loss/token {stats['nll_per_token']:.3f}")
            if epoch < spec.epochs - 1:  # the last epoch's would only be deleted: the model written next supersedes it
                trainer.save(out / "checkpoint", extra={"epoch": epoch})


def warmstart_key(model_name: str, spec: WarmStart, *, seed: int, dtype: str) -> str:
    """The cache key: every input that changes the warm-started weights."""
    identity = {"model": model_name, "warmstart": dataclasses.asdict(spec), "seed": seed, "dtype": dtype,
                "warmup_steps": SFT_WARMUP_STEPS, "version": __version__}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warmstart(model_name: str, spec: WarmStart, *, seed: int = 0, dtype: str = "float32",
              show_progress: bool = True) -> Path:
    """The warm-started model for these settings: trained once, then reused from the cache.

    Training happens in ``<key>.partial`` (an interrupted warm-start resumes
    from its last epoch) and the finished directory is renamed into place
    holding the model weights and tokenizer, the log and a summary; no
    optimizer state (gigabytes for a real model) is kept, as nothing
    resumes a finished warm-start.

    Args:
        model_name: the model to warm-start.
        spec: the experiment's warm-start section.
        seed: the warm-start's seed (``derive_seed(root, "warmstart")`` in a run).
        dtype: the dtype the model is loaded in.
        show_progress: show progress bars.
    """
    processes = PartialState()
    # The precision trained in, resolved for this device: "auto" and what it means here share one cache entry.
    requested = spec.precision
    spec = dataclasses.replace(spec, precision=resolve_precision(requested, processes.device))
    key = warmstart_key(model_name, spec, seed=seed, dtype=dtype)
    directory = cache_dir() / "warmstart" / key
    if _has_model(directory / "model"):
        console.print(f"warm-start: reusing {directory / 'model'}")
        return directory / "model"
    # One run trains it; others sharing the cache wait, then reuse it. Only the main process takes
    # the lock: the others of its launch wait at the barrier, as they would otherwise deadlock in
    # the training's collectives with a main process still waiting for the lock.
    with cache_lock(f"warmstart-{key}") if processes.is_main_process else contextlib.nullcontext():
        processes.wait_for_everyone()
        if _has_model(directory / "model"):
            console.print(f"warm-start: reusing {directory / 'model'} (trained meanwhile by another run)")
            return directory / "model"
        console.print(f"warm-start: training {model_name} on {spec.episodes} expert episodes of "
                      f"{', '.join(spec.envs)} in {describe_precision(requested, processes.device)}")
        staging = directory.with_name(directory.name + ".partial")
        train_sft(model_name, spec, staging, seed=seed, dtype=dtype, resume=True, show_progress=show_progress)
        if processes.is_main_process:
            shutil.rmtree(directory, ignore_errors=True)  # a directory without a model: an older partial copy
            staging.replace(directory)
        processes.wait_for_everyone()
    return directory / "model"


def _has_model(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()
