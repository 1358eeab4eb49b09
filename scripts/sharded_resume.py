"""Checkpoint and resume through an accelerate config: train, save, resume, and compare with no interruption.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 \
        scripts/sharded_resume.py --out /tmp/sharded

It trains a tiny random-init Llama (`contrail.testing`) with the masked-token
trainer for ``2 * steps`` optimizer steps without stopping, then again for
``steps``, saves a checkpoint, builds a *new* trainer from the saved
``model/`` plus ``load_state`` and trains the remaining ``steps``. The
resumed weights and losses must equal the uninterrupted ones. The main
process prints one JSON line (``"ok": true`` when they match) and the exit
code says the same, so tests and cluster smoke checks can launch it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from contrail.models import load_model
from contrail.testing import tiny_model, tiny_tokenizer
from contrail.train.config import TrainConfig
from contrail.train.trainer import MaskedTokenTrainer, Sample, cross_entropy_loss


def samples(tokenizer, process: int, step: int) -> list[Sample]:
    """This process's share of a step: a few chat lines, different per process and step."""
    words = ["apple", "berry", "cherry", "grape", "lemon", "mango"]
    texts = [f"<|im_start|>user\nsay {words[(process + step + i) % 6]} <|im_end|>\n<|im_start|>assistant\n"
             f"{words[(process * 3 + step + i) % 6]} {words[(i + 1) % 6]} <|im_end|>" for i in range(3)]
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        out.append(Sample(ids=ids, mask=[0] * 6 + [1] * (len(ids) - 6)))
    return out


def train(trainer: MaskedTokenTrainer, tokenizer, first: int, count: int) -> list[float]:
    process = trainer.accelerator.process_index
    steps = range(first, first + count)
    return [trainer.step(samples(tokenizer, process, s), cross_entropy_loss)["loss"] for s in steps]


def full_weights(trainer: MaskedTokenTrainer) -> dict[str, torch.Tensor]:
    """Every weight, gathered (a collective under FSDP: every process calls it)."""
    return {k: v.float().cpu() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}


def force_fsdp(state) -> None:
    """Make the (shared) accelerate state FSDP with the plugin the launch config describes (``FSDP_*`` variables).

    accelerate decides FSDP only for GPU-like distributed types; FSDP2 itself
    runs on CPU with gloo, so this lets the real FSDP code path (sharding,
    gathering for saves, sharded optimizer state) be exercised on a CPU machine.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if state.distributed_type != DistributedType.MULTI_CPU:
        raise SystemExit(f"--force-fsdp is for CPU launches (got {state.distributed_type}); "
                         "set ACCELERATE_USE_CPU=true and launch with the FSDP config")
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = DistributedType.FSDP
    # Every later Accelerator() copies the process state over its own: change it there too.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="scratch directory for the start model and the checkpoint")
    parser.add_argument("--steps", type=int, default=2, help="steps before and after the checkpoint")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--force-fsdp", action="store_true",
                        help="on CPU: turn accelerate's MULTI_CPU state into FSDP (accelerate 1.15 only enables FSDP "
                             "on accelerators and silently falls back to DDP on CPU)")
    args = parser.parse_args(argv)
    state = Accelerator().state  # before any PartialState(): reads ACCELERATE_USE_CPU (gloo on CPU)
    if args.force_fsdp:
        force_fsdp(state)
    out = Path(args.out)
    tokenizer = tiny_tokenizer()
    if state.is_main_process:  # one start model on disk, as a run's start model would be
        model = tiny_model(tokenizer, hidden_size=32, layers=2, seed=0)
        model.save_pretrained(out / "start", safe_serialization=True)
        tokenizer.save_pretrained(out / "start")
    state.wait_for_everyone()
    config = TrainConfig(lr=args.lr, warmup_steps=3, max_grad_norm=1.0)

    def trainer_from(path: Path) -> MaskedTokenTrainer:
        model, _ = load_model(str(path), dtype="float32", device=None)
        return MaskedTokenTrainer(model, tokenizer, config, seed=0)

    straight = trainer_from(out / "start")
    straight_losses = train(straight, tokenizer, 0, 2 * args.steps)
    expected = full_weights(straight)
    del straight

    first = trainer_from(out / "start")
    losses = train(first, tokenizer, 0, args.steps)
    first.save(out / "checkpoint", extra={"note": "sharded_resume"})
    del first
    resumed = trainer_from(out / "checkpoint" / "model")
    extra = resumed.load_state(out / "checkpoint")
    losses += train(resumed, tokenizer, args.steps, args.steps)
    weights = full_weights(resumed)
    model_class = type(resumed.model).__name__
    resumed.accelerator.wait_for_everyone()
    resumed.end()  # lets the DDP wrapper go, then ends the process group
    wrappers_left = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if not state.is_main_process:
        return 0
    difference = max(float((weights[k] - expected[k]).abs().max()) for k in expected)
    loss_difference = max(abs(a - b) for a, b in zip(losses, straight_losses, strict=True))
    report = {
        "distributed_type": str(resumed.accelerator.distributed_type),
        "fsdp_version": getattr(resumed.accelerator.state.__dict__.get("fsdp_plugin"), "fsdp_version", None),
        "model_class": model_class,
        "processes": state.num_processes,
        "backend": state.backend,
        "global_step": resumed.global_step,
        "extra": extra.get("note"),
        "max_weight_difference": difference,
        "max_loss_difference": loss_difference,
        "losses": losses,
        "process_group_left": torch.distributed.is_initialized(),
        "wrappers_left": wrappers_left,
        "ok": difference <= 1e-5 and loss_difference <= 1e-5 and resumed.global_step == 2 * args.steps,
    }
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
