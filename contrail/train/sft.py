"""Behaviour cloning on expert demonstrations: the warm-start before RL.

A small model cannot yet write the environments' formats, and RL needs some
successes to learn from; AgentGym trains agents this way first. `train_sft`
renders demonstrations through the rollout path (`contrail.train.demos`) and
learns them with the masked-token trainer, saving a checkpoint that
``contrail eval`` and the GRPO trainer load. `warmstart` caches the result so
every run asking for the same warm-start reuses it.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from contrail.models import cache_dir, load_model
from contrail.progress import StepProgress, console
from contrail.train.config import TrainConfig
from contrail.train.demos import DemoSpec, demonstrations
from contrail.train.trainer import MaskedTokenTrainer, cross_entropy_loss


@dataclass
class SFTConfig(TrainConfig):
    """Supervised warm-start settings (defaults: the embedded model on a CPU in minutes)."""

    lr: float = 1e-4
    epochs: int = 2
    batch_size: int = 8          # demonstrations per optimizer step
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


def train_sft(model_name: str, demos: DemoSpec, out: str | Path, config: SFTConfig = SFTConfig(),
              dtype: str = "float32", resume: bool = True, show_progress: bool = True) -> Path:
    """Train ``model_name`` on ``demos``; return the directory of the saved model.

    Writes ``out/model`` (final weights + tokenizer), ``out/checkpoint`` (after
    each epoch, for resuming), ``out/log.jsonl`` and ``out/summary.json``. With
    ``resume`` a run interrupted between epochs continues from its checkpoint.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "checkpoint"
    resuming = resume and (checkpoint / "trainer_state.pt").exists()
    model, tokenizer = load_model(str(checkpoint / "model") if resuming else model_name, dtype=dtype)
    samples, made = demonstrations(demos, tokenizer, show_progress=show_progress)
    if not samples:
        raise RuntimeError(f"the experts solved none of the {made['episodes']} demonstration episodes")
    trainer = MaskedTokenTrainer(model, tokenizer, config, log_dir=out)
    first_epoch = trainer.load_state(checkpoint)["epoch"] + 1 if resuming else 0
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    steps_per_epoch = -(-len(samples) // config.batch_size)
    start = time.perf_counter()
    with open(out / "log.jsonl", "a", encoding="utf-8") as log, StepProgress(
        steps_per_epoch * config.epochs, "behaviour cloning", show_progress and trainer.accelerator.is_main_process,
        start=first_epoch * steps_per_epoch,
    ) as progress:
        for epoch in range(first_epoch, config.epochs):
            order = list(range(len(samples)))
            random.Random(config.seed + epoch).shuffle(order)
            for begin in range(0, len(order), config.batch_size):
                batch = [samples[i] for i in order[begin:begin + config.batch_size]]
                stats = trainer.step(batch[rank::world] or batch[:1], cross_entropy_loss)
                if trainer.accelerator.is_main_process:
                    log.write(json.dumps({"epoch": epoch, "step": trainer.global_step, **stats}) + "\n")
                    log.flush()
                trainer.accelerator.log(stats, step=trainer.global_step)
                progress.step_done(f"loss/token {stats['nll_per_token']:.3f}")
            trainer.save(checkpoint, extra={"epoch": epoch})
    model_dir = trainer.save_model(out / "model")
    summary = {"model": model_name, "demonstrations": made, "config": asdict(config),
               "steps": trainer.global_step, "wall_seconds": time.perf_counter() - start}
    if trainer.accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    trainer.accelerator.end_training()
    return model_dir


def warmstart_key(model_name: str, demos: DemoSpec, config: SFTConfig) -> str:
    identity = {"model": model_name, "demos": asdict(demos), "config": asdict(config)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warmstart(model_name: str, demos: DemoSpec, config: SFTConfig = SFTConfig(), dtype: str = "float32",
              show_progress: bool = True) -> Path:
    """The warm-started model for these settings, trained once and then reused from the cache."""
    directory = cache_dir() / "warmstart" / warmstart_key(model_name, demos, config)
    if (directory / "model" / "config.json").exists() or (directory / "model" / "adapter_config.json").exists():
        console.print(f"warm-start: reusing {directory / 'model'}")
        return directory / "model"
    console.print(f"warm-start: training {model_name} on {demos.episodes} expert episodes of {', '.join(demos.envs)}")
    return train_sft(model_name, demos, directory, config, dtype=dtype, show_progress=show_progress)
