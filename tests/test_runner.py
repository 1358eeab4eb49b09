"""The experiment loop end to end: a tiny model, two tiny environments, two sequential stages."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contrail.config import EvalConfig
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.results import RunExistsError
from contrail.runner import run
from contrail.strategies import Sequential
from contrail.stream import Stream
from contrail.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def base_model(tmp_path):
    tokenizer = tiny_tokenizer()
    path = tmp_path / "tiny"
    tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def small_run(base_model, out, **kwargs):
    stream = Stream.from_specs(["magic:easy", "magic-berry:easy"], train_tasks=8, test_tasks=4)
    return run(
        stream, Sequential(steps_per_experience=2), model=base_model, out=out,
        grpo=GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, max_new_tokens=3, max_episode_tokens=256),
        eval=EvalConfig(k=2, max_new_tokens=3, max_episode_tokens=256), show_progress=False, **kwargs,
    )


def test_sequential_run_writes_rows_checkpoints_and_reports(base_model, tmp_path):
    result = small_run(base_model, tmp_path / "run")
    rows = [json.loads(line) for line in open(tmp_path / "run" / "results.jsonl")]
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert [r["trained"] for r in rows] == [[], ["magic:easy"], ["magic-berry:easy"]]
    assert set(rows[1]["results"]) == {"magic:easy", "magic-berry:easy"}
    assert result.matrix().shape == (3, 2)
    assert result.trained_at == [1, 2]
    assert set(result.metrics) >= {"final_performance", "backward_transfer", "forgetting", "forward_transfer"}
    for name in ("report.md", "matrix.csv", "heatmap.png", "success_by_stage.png", "plan.json", "config.yaml"):
        assert (tmp_path / "run" / name).exists(), name
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "stage-01" / "model" / "config.json").exists()
    assert (checkpoints / "stage-02" / "trainer_state.pt").exists()
    assert not (checkpoints / "stage-01" / "trainer_state.pt").exists()  # optimizer state: latest only
    assert len((tmp_path / "run" / "trajectories" / "stage-02.jsonl").read_text().splitlines()) == 2 * 4 * 2
    with pytest.raises(RunExistsError, match="--force"):
        small_run(base_model, tmp_path / "run")


def test_interrupted_run_resumes_after_its_last_stage(base_model, tmp_path, monkeypatch):
    reference = small_run(base_model, tmp_path / "straight")

    original_train = GRPOTrainer.train
    calls = {"n": 0}

    def die_in_stage_two(self, sampler, steps, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original_train(self, sampler, steps, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "train", die_in_stage_two)
    with pytest.raises(KeyboardInterrupt):
        small_run(base_model, tmp_path / "resumed")
    assert len([line for line in open(tmp_path / "resumed" / "results.jsonl")]) == 2  # rows 0 and 1
    with pytest.raises(RunExistsError, match="--resume"):
        small_run(base_model, tmp_path / "resumed")

    monkeypatch.setattr(GRPOTrainer, "train", original_train)
    resumed = small_run(base_model, tmp_path / "resumed", resume=True)
    assert [r["stage"] for r in resumed.rows] == [0, 1, 2]
    # The same plan, replayed from the stage-1 checkpoint: the same numbers as the straight run.
    np.testing.assert_allclose(resumed.matrix(), reference.matrix(), atol=1e-9)
