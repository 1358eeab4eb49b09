"""Trackers from YAML: validation, the matrix table, and a tiny run's TensorBoard events."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from contrail.agent.rollout import RolloutConfig
from contrail.experiment import ConfigError, EvalSpec, Experiment, ModelSpec, StreamSpec
from contrail.grpo.config import GRPOConfig
from contrail.integrations.trackers import (
    TrackerUnavailableError,
    TrackingSpec,
    markdown_table,
    matrix_table,
    row_scalars,
)
from contrail.runner import run
from contrail.testing import tiny_model, tiny_tokenizer

ROWS = [
    {"stage": 0, "name": "untouched", "results": {"a": {"avg_at_k": 0.25, "pass_at_k": 0.5}, "b": {"avg_at_k": 0.0}}},
    {"stage": 1, "name": "a", "results": {"a": {"avg_at_k": 0.75}, "b": {"avg_at_k": 0.5}}},
]


def test_spec_names_known_installed_trackers():
    assert TrackingSpec(log_with=["tensorboard"]).log_with == ["tensorboard"]
    with pytest.raises(ValueError, match="unknown tracker 'tensorbored'; valid: tensorboard, wandb"):
        TrackingSpec(log_with=["tensorbored"])
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(TrackerUnavailableError, match="wandb is not installed here; pip install wandb"):
            TrackingSpec(log_with=["wandb"])


def test_yaml_section_is_checked_with_its_key():
    text = "name: x\nstream: {train: [magic:easy]}\ntracking: {log_with: [nope]}\n"
    with pytest.raises(ConfigError, match="tracking.log_with"):
        Experiment.from_yaml(text)
    loaded = Experiment.from_yaml("name: x\nstream: {train: [magic:easy]}\ntracking: {log_with: [tensorboard]}\n")
    assert loaded.tracking.log_with == ["tensorboard"]
    assert Experiment.from_yaml(loaded.to_yaml()) == loaded


def test_matrix_table_and_scalars():
    columns, data = matrix_table(ROWS)
    assert columns == ["stage", "name", "a", "b"]
    assert data == [[0, "untouched", 0.25, 0.0], [1, "a", 0.75, 0.5]]
    assert markdown_table(columns, data).splitlines()[-1] == "| 1 | a | 0.750 | 0.500 |"
    assert row_scalars(ROWS[0]) == {"matrix/a/avg@k": 0.25, "matrix/a/pass@k": 0.5, "matrix/b/avg@k": 0.0}


def test_a_run_logs_each_stage_matrix_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    exp = Experiment(
        name="tracked",
        stream=StreamSpec(train=["magic:easy", "magic-berry:easy"], train_tasks=4, test_tasks=2,
                          steps_per_experience=1),
        model=ModelSpec(name=str(tmp_path / "tiny"), dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=1e-2, group_size=2, tasks_per_step=2),
        eval=EvalSpec(k=1), out=str(tmp_path / "run"), seed=1,  # its rollouts give stage 1 an update to log
    )
    run(replace(exp, tracking=TrackingSpec(log_with=["tensorboard"])), show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))  # (hparams sit one below)
    assert len(events) == 1  # one writer: the trainer's own TensorBoard tracker is reused, not doubled
    found = EventAccumulator(str(events[0].parent), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    for experience in ("magic:easy", "magic-berry:easy"):
        logged = [(e.step, e.value) for e in found.Scalars(f"matrix/{experience}/avg@k")]
        assert logged == [(row["stage"], pytest.approx(row["results"][experience]["avg_at_k"])) for row in rows]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in found.Tensors("matrix/text_summary")}
    assert sorted(tables) == [0, 1, 2]
    assert tables[2] == markdown_table(*matrix_table(rows))  # the whole matrix after the last stage
    assert {"loss", "reward_mean"} <= set(found.Tags()["scalars"])  # the training steps' statistics too
