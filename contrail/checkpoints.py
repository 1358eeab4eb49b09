"""A run's checkpoints: written whole or not at all, taken up by ``--resume``, pruned as rows are written.

Every stage ends with a checkpoint in ``checkpoints/stage-XX/`` (weights,
optimizer, scheduler, RNGs, the task sampler, a strategy's own state); the
optimizer and strategy state are kept only for the last recorded stage.
Within a stage, `StepCheckpoints` saves to ``checkpoints/in-progress/`` every
``checkpoint_minutes``; that one is kept until the stage's row is written, so a
kill during the stage's evaluation loses no more training than one during the
stage. Each is written to a ``.partial`` directory and
renamed into place, so a kill at any moment leaves a checkpoint whole or
absent, and `resume` takes the run up from the last one to the same result
as the uninterrupted run (`contrail.runner` says how).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contrail.models import load_model
from contrail.progress import console

if TYPE_CHECKING:
    from accelerate import PartialState

    from contrail.experiment import Experiment
    from contrail.grpo.trainer import GRPOTrainer
    from contrail.results import RunDir
    from contrail.strategies import Stage, Strategy

__all__ = ["StepCheckpoints", "drop_stale", "resume", "save_checkpoint", "within_stage"]

TRAINER_STATE = "trainer_state.pt"
STRATEGY_STATE = "strategy_state.safetensors"


def resume(run_dir: RunDir, done: int, stages: list[Stage], trainer: GRPOTrainer, strategy: Strategy,
           experiment: Experiment, start_model: str) -> dict[str, Any] | None:
    """Take up the checkpoint of stage ``done`` (none after row 0 alone) and say where the run goes on.

    A stage cut short goes on from the checkpoint taken within it (`StepCheckpoints`, which loads it once
    the stage's ``before_stage`` has run), or trains again from its start; either way to the same result.
    Returns what that checkpoint within the next stage says of itself (`within_stage`), or None.
    """
    if done >= 1:
        _continue_from(run_dir, done, trainer, strategy, experiment, start_model)
    following = stages[done]  # resuming a run with every stage recorded finishes it before this
    within = within_stage(run_dir, following.index) if trainer.masked_trainer.loads_weights_in_place else None
    where = (f"goes on after its step {len(within['extra']['history'])} of {following.steps}" if within
             else "trains from its start")
    console.print(f"resuming {run_dir.path} after stage {done} of {len(stages)}: stage {following.index} {where}")
    return within


def _continue_from(run_dir: RunDir, done: int, trainer: GRPOTrainer, strategy: Strategy, experiment: Experiment,
                   start_model: str) -> None:
    """Restore what training carries past stage ``done``: optimizer, RNGs, step count, strategy state, KL reference.

    The weights themselves were loaded from the checkpoint before the trainer was built (`contrail.runner`).
    """
    checkpoint = run_dir.checkpoint_dir(done)
    trainer.load_state(checkpoint)
    _load_strategy_state(strategy, checkpoint)
    _restore_reference(trainer, experiment, start_model)


def _restore_reference(trainer: GRPOTrainer, experiment: Experiment, start_model: str) -> None:
    """Give a resumed trainer the run's start model as its KL reference (``grpo.beta > 0``).

    The trainer freezes a copy of the model it is built with; after a resume
    that is the checkpoint's, so the start model's weights are loaded into it.
    With LoRA the reference is the (unchanged) base model under the adapter.
    """
    if trainer.reference is None or experiment.grpo.lora:
        return
    start, _ = load_model(start_model, dtype=experiment.model.dtype)
    trainer.reference.load_state_dict(start.state_dict())
    del start


class StepCheckpoints:
    """Checkpoints within a stage, so that a killed run loses at most ``minutes`` of its training.

    After a step that is not the stage's last (the stage's own checkpoint
    follows that one), once ``minutes`` have passed since the stage began
    or since the last such checkpoint, the whole run state is saved to
    `RunDir.progress_dir`: weights, optimizer, RNGs, the sampler, the
    strategy's state and the stage's step history. A resumed stage takes it
    up after ``before_stage`` (which sees the stage's starting weights, as
    the first time) and runs only the steps after it. DeepSpeed runs are
    checkpointed at stage ends only (`MaskedTokenTrainer.loads_weights_in_place`).
    """

    def __init__(self, run_dir: RunDir, stage: Stage, trainer: GRPOTrainer, strategy: Strategy, sampler,
                 minutes: float, processes: PartialState):
        self.run_dir, self.stage, self.trainer, self.strategy = run_dir, stage, trainer, strategy
        self.sampler, self.seconds, self.processes = sampler, 60.0 * minutes, processes
        self.enabled = trainer.masked_trainer.loads_weights_in_place
        self.history = self._take_up() if self.enabled else []  # the stage's steps so far, with their stats
        self.last = time.monotonic()

    def _take_up(self) -> list[dict[str, float]]:
        """Load the checkpoint taken within this stage, if a killed run left one; return its steps' stats."""
        directory = self.run_dir.progress_dir()
        within = within_stage(self.run_dir, self.stage.index)
        if within is None:
            return []
        self.trainer.load_weights(directory)
        self.trainer.load_state(directory, sampler=self.sampler)
        _load_strategy_state(self.strategy, directory)
        return list(within["extra"]["history"])

    def after_step(self, stats: dict[str, float]) -> None:
        self.history.append(stats)
        if not self.enabled or len(self.history) >= self.stage.steps or not self._due():
            return
        save_checkpoint(self.trainer, self.strategy, self.run_dir.progress_dir(), self.sampler, self.processes,
                        extra={"stage": self.stage.index, "history": self.history})
        self.last = time.monotonic()

    def _due(self) -> bool:
        due = time.monotonic() - self.last >= self.seconds
        if self.processes.num_processes == 1:
            return due
        # Saving is a collective: every process must decide alike, whatever its own clock says.
        return self.trainer.masked_trainer.sum_over_processes(float(due)) > 0


def within_stage(run_dir: RunDir, stage: int) -> dict[str, Any] | None:
    """What the checkpoint within ``stage`` says of itself (``grpo_step``, ``extra``), or None if there is none."""
    path = run_dir.progress_dir() / "trainer_state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text(encoding="utf-8"))["extra"]
    return state if state["extra"].get("stage") == stage else None


def save_checkpoint(trainer: GRPOTrainer, strategy: Strategy, target: Path, sampler, processes: PartialState,
                    extra: dict[str, Any]) -> None:
    """Save into a staging directory and rename it into place, so a checkpoint is whole or absent."""
    staging = target.with_name(target.name + ".partial")
    if processes.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a kill during an earlier save
    processes.wait_for_everyone()
    trainer.save(staging, sampler=sampler, extra=extra)
    if processes.is_main_process:
        _save_strategy_state(strategy, staging)
        # A checkpoint left here by a run killed before its row (or the next one within the stage) is stale.
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
    processes.wait_for_everyone()


def _save_strategy_state(strategy: Strategy, directory: Path) -> None:
    """What a strategy carries from one stage to the next (an EWC Fisher, say), if it says so.

    A strategy with ``state_dict() -> dict[str, Tensor]`` and
    ``load_state_dict(state)`` gets that state saved beside the trainer's
    (safetensors: tensors only) and restored on resume, so a resumed stage
    sees what its predecessor's ``after_stage`` left.
    """
    state_dict = getattr(strategy, "state_dict", None)
    if callable(state_dict):
        from safetensors.torch import save_file

        state = {name: tensor.detach().cpu().contiguous() for name, tensor in state_dict().items()}
        save_file(state, str(directory / STRATEGY_STATE))


def _load_strategy_state(strategy: Strategy, directory: Path) -> None:
    path = directory / STRATEGY_STATE
    if path.is_file() and callable(getattr(strategy, "load_state_dict", None)):
        from safetensors.torch import load_file

        strategy.load_state_dict(load_file(str(path)))


def drop_stale(run_dir: RunDir, done: int) -> None:
    """Keep every recorded stage's weights, but optimizer (and strategy) state only for the last one.

    Checkpoints of stages after ``done`` were saved without their row being
    written (a kill before recording), and staging directories are partial
    saves: both are removed, since that stage is trained again. A checkpoint
    within a stage is kept only if it is stage ``done + 1``'s, the one that goes on.
    """
    root = run_dir.path / "checkpoints"
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)
    if within_stage(run_dir, done + 1) is None:  # a checkpoint within a stage that is recorded, or none
        shutil.rmtree(run_dir.progress_dir(), ignore_errors=True)
    for stage in range(1, done):
        for name in (TRAINER_STATE, STRATEGY_STATE):
            (run_dir.checkpoint_dir(stage) / name).unlink(missing_ok=True)
    stage = max(done, 0) + 1
    while run_dir.checkpoint_dir(stage).exists():
        shutil.rmtree(run_dir.checkpoint_dir(stage))
        stage += 1
