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

Failures are loud and never corrupt a checkpoint: an optimizer step whose loss
or gradient is not finite is skipped (and logged), ``max_nonfinite_steps`` of
them in a row raise `NonFiniteError`, and weights that are not finite are never
saved. Checkpoints hold tensors (safetensors, ``torch.load(weights_only=True)``)
and JSON only: loading one never runs code.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import pickle
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType

from contrail.allocator import hand_back_freed_memory
from contrail.precision import resolve_precision
from contrail.seeds import check_seed, derive_seed
from contrail.train import checkpointed_prefix, row_attention
from contrail.train.config import TrainConfig

log = logging.getLogger("contrail.train")

STATE_TENSORS = "trainer_state.pt"   # optimizer, scheduler, RNG and any tensor extras (weights_only)
STATE_JSON = "trainer_state.json"    # step counts and every other extra


class NonFiniteError(RuntimeError):
    """Training stopped: updates kept producing non-finite losses, gradients or weights."""


class CheckpointError(ValueError):
    """A checkpoint file that is not tensors-only or JSON (it is refused, never unpickled)."""


@dataclass
class Sample:
    """One training sequence: ids and the mask of learned tokens.

    Trainers that need more per sample subclass it with typed fields (GRPO's
    `contrail.grpo.samples.GRPOSample` adds the advantage and log-probs).
    ``extras`` is free-form metadata for people and caches (which task a
    demonstration came from); no loss reads it.
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
    shared_prefix: int = 0  # leading ids every row shares, forwarded once (``sequence_logprobs(shared_prefix=)``)
    packed: bool = False  # rows after the shared prefix forwarded without padding (``sequence_logprobs(packed=)``)

    @property
    def start(self) -> int:
        """The earliest position any row trains on (at least 1: position 0 has no predecessor).

        Pass it as ``sequence_logprobs(..., start=batch.start)`` to skip the
        prompt's logits, which no loss reads.
        """
        columns = torch.nonzero(self.loss_mask.any(dim=0))
        return max(int(columns[0]) if len(columns) else 1, 1)


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


# Below this many shared ids, a separate batch-1 forward of the shared prefix costs more than it saves.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(samples: list[Sample]) -> int:
    """How many leading ids all ``samples`` share before the first trained token (0 below `MIN_SHARED_PREFIX`).

    The last shared id is left out: the first trained token's log-prob comes
    from the logits at the position before it, which must be in the rows'
    own forward.
    """
    if len(samples) < 2:
        return 0
    first = samples[0].ids
    shared = min(_first_trained(s) for s in samples) - 1
    for sample in samples[1:]:
        shared = _common_length(first, sample.ids, shared)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def _first_trained(sample: Sample) -> int:
    return next((i for i, m in enumerate(sample.mask) if m), len(sample.mask))


def _common_length(a: list[int], b: list[int], limit: int) -> int:
    for position in range(min(limit, len(a), len(b))):
        if a[position] != b[position]:
            return position
    return max(0, min(limit, len(a), len(b)))


def pack_by_prompt(samples: list[Sample], budget: int, packed: bool = False) -> list[list[int]]:
    """Micro-batches that keep samples with the same prompt together, within ``budget`` forwarded tokens.

    Samples are ordered by their prompt (the ids before their first trained
    token: a GRPO group's episodes share one; an environment's prompts share
    its instructions), then by length, and packed in that order. A
    micro-batch's cost counts its shared prefix once
    (`shared_prefix_length`), so memory stays bounded as with
    `pack_by_tokens`. A sample starts a new micro-batch when joining would
    forward more tokens than keeping it apart (its prompt shares little with
    the micro-batch's: a demonstration of another environment).

    ``packed``: the rows after the shared prefix are forwarded without
    padding (`contrail.train.packed_rows`), so a row costs its own tokens,
    not the micro-batch's widest. The samples that share more with the next
    one than with the micro-batch (its group, its environment's other
    demonstrations) then join or stay apart together: one at a time, the
    first would join (it costs its own tokens either way), and the rest
    would forward what they share with it once per row.
    """
    prompts = [tuple(s.ids[:_first_trained(s)]) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: (prompts[i], len(samples[i].ids)))
    groups: list[list[int]] = []
    current: list[int] = []
    shared = 0  # the current micro-batch's shared ids (before the MIN_SHARED_PREFIX cut)
    for position, index in enumerate(order):
        sample = samples[index]
        if current:
            first = samples[current[0]]
            grown_shared = _common_length(first.ids, sample.ids, min(shared, _first_trained(sample) - 1))
            members = [samples[i] for i in current]
            coming = _coming(samples, order[position:], grown_shared) if packed else [sample]
            joined = _forwarded(grown_shared, [*members, *coming], packed)
            apart = _forwarded(shared, members, packed) + _forwarded(shared_prefix_length(coming), coming, packed)
            if _forwarded(grown_shared, [*members, sample], packed) <= budget and joined <= apart:
                current.append(index)
                shared = grown_shared
                continue
            groups.append(current)
        current, shared = [index], _first_trained(sample) - 1
    if current:
        groups.append(current)
    return groups


def _coming(samples: list[Sample], order: list[int], shared: int) -> list[Sample]:
    """``samples[order[0]]`` and the samples after it in ``order`` that share more than ``shared`` ids with it."""
    first = samples[order[0]]
    coming = [first]
    for index in order[1:]:
        if _common_length(first.ids, samples[index].ids, _first_trained(first) - 1) <= shared:
            break
        coming.append(samples[index])
    return coming


def _forwarded(shared: int, rows: list[Sample], packed: bool = False) -> int:
    """Tokens a micro-batch of ``rows`` forwards, its shared prefix counted once: padded to its widest row, or
    each row's own tokens when ``packed``."""
    kept = shared if shared >= MIN_SHARED_PREFIX else 0
    if packed and kept:
        return kept + sum(len(row.ids) - kept for row in rows)
    return kept + len(rows) * (max(len(row.ids) for row in rows) - kept)


def collate(samples: list[Sample], pad_id: int, device: torch.device, share_prefix: bool = False,
            packed: bool = False) -> Batch:
    """Right-padded tensors of ``samples``; with ``share_prefix``, the rows' shared prefix is marked (and with
    ``packed``, forwarding the rows after it without padding asked for)."""
    width = max(len(s.ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.ids)
        input_ids[row, :n] = torch.tensor(sample.ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.mask, dtype=torch.float32)
    shared = shared_prefix_length(samples) if share_prefix else 0
    return Batch(input_ids.to(device), attention.to(device), loss_mask.to(device), samples, shared_prefix=shared,
                 packed=packed and shared > 0)


def _stat_weights(samples: list[Sample], groups: list[list[int]]) -> list[float]:
    """Each micro-batch's weight in the step's stats: its share of the masked tokens.

    A loss's stats are means over its micro-batch's masked tokens (a per-token
    NLL, clip fraction, entropy), or values that do not depend on the batch
    (a penalty on the weights); weighted by tokens, both come out as the
    whole batch's, however it was split. (By rows, a micro-batch of short
    episodes would count as much per row as one of long ones.)
    """
    tokens = [sum(sum(samples[i].mask) for i in group) for group in groups]
    total = sum(tokens)
    if total == 0:  # nothing masked anywhere: every stat is a mean over nothing; keep them finite
        return [len(group) / len(samples) for group in groups]
    return [count / total for count in tokens]


def _apply_lora(model, config: TrainConfig):
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel):  # a saved adapter being resumed: train the adapter it has
        for name, parameter in model.named_parameters():
            parameter.requires_grad = "lora_" in name
        return model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=config.lora_target_modules, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated ``is_gradient_checkpointing``: a warning users cannot act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, lora)


class MaskedTokenTrainer:
    """Optimizer steps of a caller-defined loss over masked-token samples.

    >>> trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lr=1e-4), seed=0)
    >>> stats = trainer.step(samples, cross_entropy_loss)
    >>> trainer.save(Path("out/checkpoint"))

    ``seed`` seeds the process-wide RNGs (dropout, LoRA's initialisation) with
    ``derive_seed(seed, "train", process_index)``.
    """

    def __init__(self, model, tokenizer, config: TrainConfig, accelerator: Accelerator | None = None,
                 log_dir: str | Path | None = None, *, seed: int = 0):
        self.config = config
        self.tokenizer = tokenizer
        self.seed = check_seed(seed)
        self.accelerator = accelerator or make_accelerator(config, log_dir)
        self.precision = resolve_precision(config.precision, self.accelerator.device)  # "auto" decided here, once
        _seed_everything(derive_seed(seed, "train", self.accelerator.process_index))
        if config.lora:
            model = _apply_lora(model, config)
        if config.gradient_checkpointing:
            checkpointed_prefix.enable_checkpointing(model)
            model.config.use_cache = False
        parameters = [p for p in model.parameters() if p.requires_grad]
        fused = _fused_adamw(parameters, self.sharded)
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay, fused=fused)
        if fused:
            # The fused kernel writes the weights without bumping their version counters, which say
            # "the weights moved" to the vLLM backend's sync (`contrail.agent.vllm.fingerprint`).
            optimizer.register_step_post_hook(lambda *_: _bump_versions(parameters))
        warmup = max(1, config.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.global_step = 0          # optimizer steps taken (skipped ones not counted)
        self.nonfinite_streak = 0     # skipped steps in a row
        self._sampling_depth = 0      # nesting of `full_weights` (only the outermost unshards and merges)

    # --- the one operation -----------------------------------------------------
    def step(self, samples: list[Sample], loss_fn: LossFn, normalizer: float | None = None) -> dict[str, float]:
        """One optimizer step over ``samples`` (this process's share).

        ``loss_fn(model, batch, normalizer)`` returns a loss whose sum over
        micro-batches is the batch loss; ``normalizer`` defaults to the number
        of masked tokens in the whole batch, summed over processes.

        When the loss or the gradient is not finite the step is skipped (no
        weight, optimizer or scheduler change; ``nonfinite_skipped`` is 1 in
        the stats); ``config.max_nonfinite_steps`` in a row raise
        `NonFiniteError`. An update that makes the weights non-finite raises
        at once (they cannot be restored).
        """
        if not samples:
            raise ValueError("a training step needs at least one sample")
        local_tokens = float(sum(sum(s.mask) for s in samples))
        if normalizer is None:
            normalizer = max(self.sum_over_processes(local_tokens), 1.0)
        totals, micro_batches = self._accumulate(samples, loss_fn, normalizer)
        grad_norm = self._clip()
        totals.update(grad_norm=grad_norm, micro_batches=micro_batches, tokens=local_tokens)
        if not self._all_finite(totals["loss"], grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self._skip_nonfinite(totals)
            return {**totals, "nonfinite_skipped": 1.0, "lr": self.scheduler.get_last_lr()[0]}
        self.nonfinite_streak = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if not self.weights_finite(trainable_only=True):
            raise NonFiniteError(
                f"optimizer step {self.global_step} made the weights non-finite from a finite gradient "
                f"(lr={self.config.lr:g}); nothing was saved. Lower the learning rate."
            )
        totals["lr"] = self.scheduler.get_last_lr()[0]
        return totals

    def _accumulate(self, samples: list[Sample], loss_fn: LossFn, normalizer: float) -> tuple[dict[str, float], int]:
        """Forward and backward over the micro-batches; gradients add up to the batch's."""
        # DDP averages gradients over processes; undo that so they sum, as in one process.
        scale = float(self.accelerator.num_processes)
        groups = self.micro_batches(samples)
        weights = _stat_weights(samples, groups)
        self.model.train()
        totals: dict[str, float] = {"loss": 0.0}
        for number, group in enumerate(groups):
            batch = self.collate([samples[i] for i in group])
            last = number == len(groups) - 1
            with self._sync_gradients(last), self.autocast(), row_attention.in_use(self.config.row_attention):
                loss, stats = loss_fn(self.model, batch, normalizer)
            self.accelerator.backward(loss * scale)
            totals["loss"] += float(loss.detach())
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value) * weights[number]
        return totals, len(groups)

    @property
    def share_prefix(self) -> bool:
        """Whether micro-batches forward their rows' shared prefix once (`sequence_logprobs(shared_prefix=)`).

        ``config.share_prefix``, in one process: the shared forward calls the
        model twice before one backward, which data-parallel wrappers do not
        allow. Under gradient checkpointing only where transformers can keep
        a checkpointed layer's (read-only) cache (`contrail.train.checkpointed_prefix`).
        """
        config = self.config
        checkpointing_ok = not config.gradient_checkpointing or checkpointed_prefix.supported()
        return config.share_prefix and self.accelerator.num_processes == 1 and checkpointing_ok

    @property
    def pack_rows(self) -> bool:
        """Whether the rows after a micro-batch's shared prefix are forwarded without padding
        (``config.pack_rows``, with `share_prefix`, on a model attending through SDPA on a CPU, not
        checkpointing: `contrail.train.packed_rows`)."""
        from contrail.train import packed_rows

        return (self.config.pack_rows and self.share_prefix and not self.config.gradient_checkpointing
                and packed_rows.supports(self.accelerator.unwrap_model(self.model)))

    def micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """``samples``' indices packed into micro-batches of at most ``micro_batch_tokens`` forwarded tokens."""
        if self.share_prefix:
            return pack_by_prompt(samples, self.config.micro_batch_tokens, packed=self.pack_rows)
        return pack_by_tokens([len(s.ids) for s in samples], self.config.micro_batch_tokens)

    def collate(self, samples: list[Sample]) -> Batch:
        """One micro-batch on the training device (its shared prefix marked when `share_prefix`)."""
        return collate(samples, self.tokenizer.pad_token_id, self.accelerator.device, share_prefix=self.share_prefix,
                       packed=self.pack_rows)

    def _all_finite(self, loss: float, grad_norm: float) -> bool:
        """Whether the loss and gradient are finite on every process (all skip together)."""
        bad = 0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0
        return self.sum_over_processes(bad) == 0.0

    def _skip_nonfinite(self, totals: dict[str, float]) -> None:
        self.nonfinite_streak += 1
        limit = self.config.max_nonfinite_steps
        log.warning("skipped an update with a non-finite loss or gradient (loss %s, grad norm %s); %d in a row of "
                    "at most %d", totals["loss"], totals["grad_norm"], self.nonfinite_streak, limit)
        if self.nonfinite_streak >= limit:
            raise NonFiniteError(
                f"training stopped: {self.nonfinite_streak} updates in a row had a non-finite loss or gradient "
                f"(last: loss {totals['loss']}, grad norm {totals['grad_norm']}; max_nonfinite_steps={limit}). "
                "Lower the learning rate or check the loss terms."
            )

    def weights_finite(self, trainable_only: bool = False) -> bool:
        """Whether every (trainable) weight is finite; one device synchronisation.

        Under FSDP each process checks its own shard and the answer is agreed
        over processes (a collective: every process calls this together).
        """
        params = [_local(p) for p in self.model.parameters() if p.requires_grad or not trainable_only]
        params = [p for p in params if p.numel()]
        finite = _every_element_finite(params) if params else True
        if self.sharded:
            return self.sum_over_processes(0.0 if finite else 1.0) == 0.0
        return finite

    @property
    def sharded(self) -> bool:
        """Whether weights are sharded over processes (FSDP, DeepSpeed): saving them is a collective."""
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    @contextlib.contextmanager
    def full_weights(self):
        """Inside, the model is ready to sample from: whole on every process, LoRA merged into its weights.

        Every process enters together. Sampling runs a different number of
        forwards on each process (its own episodes), or on the main process
        alone (evaluation). Under FSDP a forward gathers each block's shards
        from every process, so those forwards would wait forever for
        processes doing something else: under FSDP2 the blocks are unsharded
        on entry and kept whole until the exit reshards them. A LoRA adapter
        is merged into the base weights on entry and taken out on exit, so a
        sampled token costs one matrix product per layer, not three (PEFT's
        unmerged forward adds ``x @ A @ B`` beside every linear layer). With
        DDP or one process and no LoRA this does nothing. DeepSpeed ZeRO-3's
        parameters are not gathered here (that needs DeepSpeed's own API, not
        wired): there, sample with the vLLM backend, which is fed full weights.
        """
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED and _zero3(self.accelerator):
            log.warning("DeepSpeed ZeRO-3: the model stays sharded while sampling, so the HF backend's forwards "
                        "are collectives and may hang; use rollout.backend: vllm or configs/accelerate/fsdp.yaml")
        if self._sampling_depth:  # nested (a collect inside an evaluation): the outermost one restores
            self._sampling_depth += 1
            try:
                yield
            finally:
                self._sampling_depth -= 1
            return
        self._sampling_depth = 1
        try:
            with self._whole_and_merged():
                yield
        finally:
            self._sampling_depth = 0

    @contextlib.contextmanager
    def _whole_and_merged(self):
        blocks = _fsdp_modules(self.model)
        for block in blocks:  # the same order on every process: model.modules() is deterministic
            block.unshard()
            block.set_reshard_after_forward(False, recurse=False)
        lora = _lora_tuner(self.unwrapped)
        if lora is not None:
            with torch.no_grad():
                lora.merge_adapter()
        try:
            yield
        finally:
            if lora is not None:
                with torch.no_grad():
                    lora.unmerge_adapter()
            for block in blocks:
                block.reshard()
                # FSDP2 keeps the root unsharded after its forward (backward needs it at once).
                block.set_reshard_after_forward(block is not self.model, recurse=False)

    @contextlib.contextmanager
    def autocast(self):
        """bf16 compute with fp32 master weights when `precision` is ``"bf16"`` (CPU and GPU).

        Done here rather than through Accelerate's ``mixed_precision``, which is
        fixed once per process: warm-start and GRPO may use different precisions.
        Inside it LoRA adapters take their input as it comes: PEFT would cast a
        bf16 input up to the adapter's fp32, which autocast then casts straight
        back (the same values): a copy of every adapted layer's input and of its
        gradient, which made a LoRA update 1.10x as long (bench/README.md).
        """
        enabled = self.precision == "bf16"
        with torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, enabled=enabled), \
                _adapters_take_autocast_inputs(self.model, enabled and self.config.lora):
            yield

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

    def end(self) -> None:
        """Finish training: close the trackers and, under ``accelerate launch``, the process group.

        The distributed wrapper (DDP) is let go first, so nothing is left holding the ended group's
        backend until interpreter shutdown. The model stays usable, unwrapped, for evaluation.
        Call it once, last.
        """
        self.model = self.accelerator.unwrap_model(self.model)
        self.accelerator.free_memory()  # the accelerator's own references to the wrapper
        gc.collect()  # free_memory collects before it drops those references: what they held in cycles goes now
        hand_back_freed_memory()  # training's kept heap, for what follows (an evaluation's caches: their own pool)
        self.accelerator.end_training()

    # --- models and checkpoints -------------------------------------------------
    @property
    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def save_model(self, directory: Path) -> Path:
        """Save weights (or the LoRA adapter) and tokenizer, loadable by `contrail.models.load_model`.

        Refuses (`NonFiniteError`, nothing written) when a weight is not finite.
        """
        directory = Path(directory)
        if not self.weights_finite():
            raise NonFiniteError(f"refusing to save non-finite weights to {directory}")
        self.accelerator.wait_for_everyone()
        # Sharded weights are gathered into one full state dict on the main process (a collective).
        state_dict = self.accelerator.get_state_dict(self.model) if self.sharded else None
        if self.accelerator.is_main_process:
            staging = directory.with_name(directory.name + ".tmp")
            self.unwrapped.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(staging)
            _replace_dir(staging, directory)
        self.accelerator.wait_for_everyone()
        return directory

    def load_weights(self, directory: Path) -> None:
        """Copy the weights `save_model` wrote to ``directory`` into the live model, in place.

        With LoRA that is the adapter alone (the base model never changes).
        Loading in place keeps every reference to the parameters valid (the
        optimizer's, a strategy's anchor), which loading a new model would not.
        Under FSDP every process reads the whole file and keeps its own shard
        of it. Refused with `CheckpointError`, the model left as it was, when
        the weights do not fit it; `NotImplementedError` under DeepSpeed
        (see `loads_weights_in_place`).
        """
        if not self.loads_weights_in_place:
            raise NotImplementedError("load_weights: DeepSpeed's sharded weights load through the checkpoint of "
                                      "a stage, not in place")
        directory = Path(directory)
        live = self.unwrapped.state_dict()  # under FSDP2 its values are DTensors of the full shapes
        state, expected = self._saved_weights(directory, live)
        # Checked before anything is copied, so a refused checkpoint leaves the model as it was.
        unexpected = sorted(set(state) - set(live))
        missing = [name for name in expected if name not in state and not _tied_to(self.unwrapped, name, state)]
        reshaped = [name for name in state if name in live and state[name].shape != live[name].shape]
        if unexpected or missing or reshaped:
            raise CheckpointError(f"{directory}: weights that do not fit this model (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]}, of another shape {reshaped[:3]})")
        if self.accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # Each process copies its shard of every full tensor into its own (a tied head: one of the pair).
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            self.unwrapped.load_state_dict(state, strict=False)  # strict would count a tied head as missing

    @property
    def loads_weights_in_place(self) -> bool:
        """Whether `load_weights` can load into this model: one process, DDP or FSDP, not DeepSpeed."""
        return self.accelerator.distributed_type != DistributedType.DEEPSPEED

    def _saved_weights(self, directory: Path, live: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The weights `save_model` wrote, under the live model's names, and the names they must cover.

        A LoRA adapter is saved without its adapter's name (``lora_A.weight``,
        not ``lora_A.default.weight``) and covers only the adapter's weights.
        """
        from safetensors.torch import load_file

        if not self.config.lora:
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(directory.glob("*.safetensors")):
                state.update(load_file(shard))
            return state, list(live)
        adapter = self.unwrapped.active_adapter
        live_names = {name.replace(f".{adapter}.", "."): name for name in live if f".{adapter}." in name}
        saved = load_file(directory / "adapter_model.safetensors")
        return {live_names.get(name, name): tensor for name, tensor in saved.items()}, list(live_names.values())

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> Path:
        """A resumable checkpoint: ``model/``, ``trainer_state.pt`` and ``trainer_state.json``.

        ``trainer_state.pt`` holds only tensors and plain containers (optimizer,
        scheduler, RNG states, and the tensor values of ``extra``), so it loads
        with ``torch.load(weights_only=True)``; ``trainer_state.json`` holds the
        step counts and every other value of ``extra``, which must be JSON-able.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        extra = dict(extra or {})
        tensors = {k: v for k, v in extra.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in extra.items() if k not in tensors}
        meta = json.dumps({"global_step": self.global_step, "nonfinite_streak": self.nonfinite_streak,
                           "extra": plain, "tensor_extras": sorted(tensors)}, indent=2)  # fails early if not JSON
        self.save_model(directory / "model")
        optimizer = self._optimizer_state()
        if self.accelerator.is_main_process:
            state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                     "rng": _rng_state(), "extra": {k: v.detach().cpu() for k, v in tensors.items()}}
            _write_atomic(directory / STATE_TENSORS, lambda path: torch.save(state, path))
            _write_atomic(directory / STATE_JSON, lambda path: path.write_text(meta, encoding="utf-8"))
            (directory / "train_config.json").write_text(json.dumps(self.config.__dict__, indent=2, default=str))
        self.accelerator.wait_for_everyone()
        return directory

    def load_state(self, directory: Path) -> dict[str, Any]:
        """Restore optimizer, scheduler, RNG and step from `save`; return its ``extra``.

        The model weights are loaded by the caller (``load_model(directory / "model")``)
        before the trainer is built, so LoRA and full models resume alike. A
        ``trainer_state.pt`` that holds anything but tensors and plain
        containers is refused with `CheckpointError` (it is never unpickled).
        """
        directory = Path(directory)
        state = load_tensors_file(directory / STATE_TENSORS)
        meta = json.loads((directory / STATE_JSON).read_text(encoding="utf-8"))
        self._load_optimizer_state(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(meta["global_step"])
        self.nonfinite_streak = int(meta.get("nonfinite_streak", 0))
        _set_rng_state(state["rng"])
        return {**meta["extra"], **state["extra"]}

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state to save (on the main process; a collective under FSDP).

        Under FSDP each process holds the AdamW state of its own shard, so it
        is gathered into one *full* state dict keyed by parameter name, which
        loads back at any number of processes (`_load_optimizer_state`).
        """
        if self.accelerator.distributed_type != DistributedType.FSDP:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, _inner_optimizer(self.optimizer), options=options)

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load what `_optimizer_state` saved; under FSDP every process takes its shard of the full state."""
        if self.accelerator.distributed_type != DistributedType.FSDP:
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, _inner_optimizer(self.optimizer), optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


def _tied_to(model, name: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s parameter ``name`` is one of the ``loaded`` names' parameters (a tied LM head:
    `save_pretrained` writes one of the pair). The same object, not the same storage: FSDP2's DTensors have none."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return name in parameters and any(parameters[other] is parameters[name]
                                      for other in loaded if other in parameters and other != name)


def _adapters_take_autocast_inputs(model, active: bool):
    """PEFT's switch that leaves a LoRA layer's input in its own dtype (``active``: under autocast only)."""
    if not active:
        return contextlib.nullcontext()
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model)


def _bump_versions(parameters: list[torch.Tensor]) -> None:
    for parameter in parameters:  # one at a time: torch < 2.5 takes no list
        torch.autograd.graph.increment_version(parameter)


def _fused_adamw(parameters: list[torch.Tensor], sharded: bool) -> bool:
    """Whether AdamW takes its fused kernel: one pass over each tensor instead of a dozen.

    On a 2-core CPU the per-op AdamW step over SmolLM2-135M's weights took
    350-600 ms (each op allocates a temporary as large as the embedding),
    the fused one 80 ms (bench/README.md). Sharded weights (FSDP,
    DeepSpeed) keep PyTorch's default: their engines wrap the optimizer.
    """
    return not sharded and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in parameters)


def _fsdp_modules(model) -> list:
    """The FSDP2-sharded modules of ``model`` (its blocks and the root), outermost first; [] if none."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _lora_tuner(model):
    """The PEFT LoRA tuner of ``model`` (what merges and unmerges its adapter), or None."""
    from peft import PeftModel

    return model.base_model if isinstance(model, PeftModel) else None


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a (possibly FSDP2-sharded, DTensor) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def load_tensors_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs more (code) raises `CheckpointError`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path}: refused to load: not a tensors-only checkpoint ({reason}); contrail loads checkpoints "
            "with weights_only=True and never runs code from a file"
        ) from None


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    staging = path.with_name(path.name + ".tmp")
    write(staging)
    staging.replace(path)


def process_state() -> PartialState:
    """accelerate's process state (rank, world size), the same one every Accelerator of the process shares.

    ``accelerate launch`` on CPU (``ACCELERATE_USE_CPU=true``) must reach the
    state first with ``cpu=True``: a bare ``PartialState()`` there ignores the
    variable and makes every process a single, main process (gloo is never
    initialised), so two processes would both write the run.
    """
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


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

    logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, start=batch.start,
                                 shared_prefix=batch.shared_prefix, positions=batch.loss_mask, packed=batch.packed)
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
    """Every process-wide RNG state as tensors (so it loads with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    _kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_meta": torch.tensor([version, math.nan if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_meta": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, gauss = state["python_meta"].tolist()
    random.setstate((int(version), tuple(state["python"].tolist()), None if math.isnan(gauss) else gauss))
    position, has_gauss, cached = state["numpy_meta"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(position), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _every_element_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one synchronisation when they are).

    A sum is finite only if every term is (a NaN or an infinity makes it NaN
    or infinite), so finite sums settle it with one fast pass per tensor,
    about 14x cheaper than ``isfinite(...).all()`` on a 135M-parameter model.
    Finite weights whose sum overflows fall through to the exact check.
    """
    with torch.no_grad():
        if bool(torch.stack([t.sum() for t in tensors]).isfinite().all()):
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


__all__ = ["STATE_JSON", "STATE_TENSORS", "Batch", "CheckpointError", "MaskedTokenTrainer", "NonFiniteError",
           "Sample", "collate", "cross_entropy_loss", "load_tensors_file", "make_accelerator", "pack_by_prompt",
           "pack_by_tokens", "shared_prefix_length",
           "process_state"]
