"""The masked-token trainer on Accelerate: the optimisation loop SFT and GRPO share.

It trains on `Sample`s, token ids with a mask that is 1 on the tokens to
learn (the assistant's), in optimizer steps over micro-batches packed by a
token budget, with gradient accumulation, clipping, fp32/bf16, gradient
checkpointing and optional LoRA. What the loss *is* comes from the caller
(cross-entropy for SFT, the clipped policy loss for GRPO): the trainer only
knows how to run a loss function over micro-batches so that their gradients
add up to the gradient of the whole batch.

Data parallel: under ``accelerate launch`` each process trains on its own
share of samples; the loss normalizer is summed over processes so the
averaged gradient equals the single-process gradient of the whole batch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from accelerate import Accelerator

from contrail.train.config import TrainConfig


@dataclass
class Sample:
    """One training sequence: ids, the mask of learned tokens, and per-sample extras.

    ``extras`` holds per-token lists aligned with ``ids`` (e.g. old log-probs)
    and per-sample scalars (e.g. the advantage), read by the loss function.
    """

    ids: list[int]
    mask: list[int]
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError(f"ids ({len(self.ids)}) and mask ({len(self.mask)}) differ in length")


@dataclass
class Batch:
    """Right-padded tensors of one micro-batch, plus its samples."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    samples: list[Sample]

    def token_extra(self, key: str) -> torch.Tensor:
        """A per-token extra as a padded ``(batch, length)`` float tensor."""
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32)
        for row, sample in enumerate(self.samples):
            values = sample.extras[key]
            out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out.to(self.input_ids.device)

    def sample_extra(self, key: str) -> torch.Tensor:
        """A per-sample scalar extra as a ``(batch,)`` float tensor."""
        return torch.tensor([s.extras[key] for s in self.samples], dtype=torch.float32, device=self.input_ids.device)


LossFn = Callable[[torch.nn.Module, Batch, float], tuple[torch.Tensor, dict[str, float]]]


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size stays within ``budget``.

    Sorting by length keeps padding small; a sample longer than the budget
    gets a micro-batch of its own (it must still be trained on).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = max([lengths[i] for i in current] + [lengths[index]])
        if current and longest * (len(current) + 1) > budget:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def collate(samples: list[Sample], pad_id: int, device: torch.device) -> Batch:
    width = max(len(s.ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.ids)
        input_ids[row, :n] = torch.tensor(sample.ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.mask, dtype=torch.float32)
    return Batch(input_ids.to(device), attention.to(device), loss_mask.to(device), samples)


def _apply_lora(model, config: TrainConfig):
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel):  # a saved adapter being resumed: train the adapter it has
        for name, parameter in model.named_parameters():
            parameter.requires_grad = "lora_" in name
        return model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=config.lora_target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


class MaskedTokenTrainer:
    """Optimizer steps of a caller-defined loss over masked-token samples.

    >>> trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=1e-4))
    >>> stats = trainer.step(samples, cross_entropy_loss)
    >>> trainer.save(Path("out/checkpoint"))
    """

    def __init__(self, model, tokenizer, config: TrainConfig, accelerator: Accelerator | None = None,
                 log_dir: str | Path | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.accelerator = accelerator or make_accelerator(config, log_dir)
        _seed_everything(config.seed + self.accelerator.process_index)
        if config.lora:
            model = _apply_lora(model, config)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
        warmup = max(1, config.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.global_step = 0

    # --- the one operation -----------------------------------------------------
    def step(self, samples: list[Sample], loss_fn: LossFn, normalizer: float | None = None) -> dict[str, float]:
        """One optimizer step over ``samples`` (this process's share).

        ``loss_fn(model, batch, normalizer)`` returns a loss whose sum over
        micro-batches is the batch loss; ``normalizer`` defaults to the number
        of masked tokens in the whole batch, summed over processes.
        """
        if not samples:
            raise ValueError("a training step needs at least one sample")
        local_tokens = float(sum(sum(s.mask) for s in samples))
        if normalizer is None:
            normalizer = max(self.sum_over_processes(local_tokens), 1.0)
        # DDP averages gradients over processes; undo that so they sum, as in one process.
        scale = float(self.accelerator.num_processes)
        groups = pack_by_tokens([len(s.ids) for s in samples], self.config.micro_batch_tokens)
        self.model.train()
        totals: dict[str, float] = {}
        for number, group in enumerate(groups):
            batch = collate([samples[i] for i in group], self.tokenizer.pad_token_id, self.accelerator.device)
            last = number == len(groups) - 1
            with self._sync_gradients(last), self.autocast():
                loss, stats = loss_fn(self.model, batch, normalizer)
            self.accelerator.backward(loss * scale)
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value) * len(group) / len(samples)
        grad_norm = self._clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        totals.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], micro_batches=len(groups),
                      tokens=local_tokens)
        return totals

    def autocast(self):
        """bf16 compute with fp32 master weights when ``precision == "bf16"`` (CPU and GPU).

        Done here rather than through Accelerate's ``mixed_precision``, which is
        fixed once per process: warm-start and GRPO may use different precisions.
        """
        return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16,
                              enabled=self.config.precision == "bf16")

    def _sync_gradients(self, last: bool):
        """Skip the gradient all-reduce on every micro-batch but the last (one sync per step)."""
        import contextlib

        if last or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)

    def _clip(self) -> float:
        if self.config.max_grad_norm is None:
            norms = [p.grad.detach().norm() for p in self.model.parameters() if p.grad is not None]
            return float(torch.norm(torch.stack(norms))) if norms else 0.0
        return float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))

    def sum_over_processes(self, value: float) -> float:
        """``value`` summed over data-parallel processes (itself when there is one)."""
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return float(self.accelerator.reduce(tensor, reduction="sum").item())

    # --- models and checkpoints -------------------------------------------------
    @property
    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def save_model(self, directory: Path) -> Path:
        """Save weights (or the LoRA adapter) and tokenizer, loadable by `contrail.models.load_model`."""
        directory = Path(directory)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            staging = directory.with_name(directory.name + ".tmp")
            self.unwrapped.save_pretrained(staging, safe_serialization=True)
            self.tokenizer.save_pretrained(staging)
            _replace_dir(staging, directory)
        self.accelerator.wait_for_everyone()
        return directory

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> Path:
        """A resumable checkpoint: ``model/`` plus optimizer, scheduler, RNG, step and ``extra``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.save_model(directory / "model")
        if self.accelerator.is_main_process:
            state = {
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "global_step": self.global_step, "rng": _rng_state(), "extra": extra or {},
            }
            torch.save(state, directory / "trainer_state.pt.tmp")
            (directory / "trainer_state.pt.tmp").replace(directory / "trainer_state.pt")
            (directory / "train_config.json").write_text(json.dumps(self.config.__dict__, indent=2, default=str))
        self.accelerator.wait_for_everyone()
        return directory

    def load_state(self, directory: Path) -> dict[str, Any]:
        """Restore optimizer, scheduler, RNG and step from `save`; return its ``extra``.

        The model weights are loaded by the caller (``load_model(directory / "model")``)
        before the trainer is built, so LoRA and full models resume alike.
        """
        state = torch.load(Path(directory) / "trainer_state.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = state["global_step"]
        _set_rng_state(state["rng"])
        return state["extra"]


def make_accelerator(config: TrainConfig, log_dir: str | Path | None = None) -> Accelerator:
    """An Accelerator logging to TensorBoard when installed (precision is the trainer's autocast)."""
    import importlib.util

    trackers = []
    if log_dir is not None and importlib.util.find_spec("tensorboard") is not None:
        trackers = ["tensorboard"]
    accelerator = Accelerator(log_with=trackers or None,
                              project_dir=str(log_dir) if log_dir else None)
    if trackers:
        accelerator.init_trackers("tensorboard", config={k: str(v) for k, v in config.__dict__.items()})
    return accelerator


def cross_entropy_loss(model, batch: Batch, normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised loss: summed negative log-likelihood of masked tokens / ``normalizer``."""
    from contrail.train.logprobs import sequence_logprobs

    logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    mask = batch.loss_mask
    nll = -(torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))).sum()
    tokens = float(mask.sum())
    return nll / normalizer, {"nll_per_token": float(nll.detach()) / max(tokens, 1.0)}


# --- helpers -------------------------------------------------------------------------


def _replace_dir(staging: Path, target: Path) -> None:
    import shutil

    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        target.replace(old)
        staging.replace(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.replace(target)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["Batch", "MaskedTokenTrainer", "Sample", "collate", "cross_entropy_loss", "make_accelerator",
           "pack_by_tokens"]
