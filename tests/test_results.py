"""Run directories: start/resume/force rules, atomic rows, checkpoints, the results matrix."""

import json
import math
import os

import numpy as np
import pytest

from contrail import results
from contrail.results import RunDir, RunExistsError, config_differences, read_jsonl, result_matrix

CONFIG = {"name": "t", "out": "runs/t", "seed": 0, "grpo": {"lr": 1e-6, "micro_batch_tokens": 4096},
          "model": {"name": "m", "device": "cpu"}, "stream": {"train": ["a:easy", "b:easy"]}}


def ev(avg, pass_=None):
    return {"tasks": 2, "k": 2, "avg_at_k": avg, "pass_at_k": avg if pass_ is None else pass_, "reward": avg,
            "turns": 3.0, "generated_tokens": 10.0, "invalid_rate": 0.1, "truncated_rate": 0.0, "errors": 0}


def row(stage, a, b, name=None):
    return {"stage": stage, "name": name or ("untouched" if stage == 0 else f"s{stage}"),
            "trained": [] if stage == 0 else [f"s{stage}"], "results": {"a:easy": ev(a), "b:easy": ev(b)},
            "train": {}, "wall_seconds": 1.5}


def test_config_text_is_written_as_it_is(tmp_path):
    text = "# the experiment\nname: t\nseed: 0\n"
    RunDir(tmp_path).start(text)
    assert (tmp_path / "config.yaml").read_text() == text
    RunDir(tmp_path).start("name: t\nseed: 0\n", resume=True)  # same values, other formatting
    with pytest.raises(RunExistsError, match=r"differs in seed \(seed: saved 0, now 2\)"):
        RunDir(tmp_path).start("name: t\nseed: 2\n", resume=True)


def test_new_run_writes_config_and_rows(tmp_path):
    run = RunDir(tmp_path / "run")
    run.start(CONFIG)
    assert run.config() == CONFIG
    assert run.rows() == [] and run.completed_stages() == -1
    run.append_row(row(0, 0.1, 0.2))
    assert run.completed_stages() == 0
    run.append_row(row(1, 0.5, 0.3))
    assert [r["stage"] for r in run.rows()] == [0, 1]
    assert run.rows()[1] == row(1, 0.5, 0.3)
    assert run.completed_stages() == 1
    lines = (run.path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["name"] == "untouched"


def test_rows_must_come_in_stage_order(tmp_path):
    run = RunDir(tmp_path)
    run.start(CONFIG)
    with pytest.raises(ValueError, match="stage 0"):
        run.append_row(row(1, 0.1, 0.1))
    run.append_row(row(0, 0.1, 0.1))
    with pytest.raises(ValueError, match="stage 1, got 0"):
        run.append_row(row(0, 0.1, 0.1))


def test_append_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    run.start(CONFIG)
    run.append_row(row(0, 0.1, 0.2))
    before = (tmp_path / "results.jsonl").read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        run.append_row(row(1, 0.5, 0.3))
    monkeypatch.undo()
    assert (tmp_path / "results.jsonl").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "results.jsonl"]  # no temp file left behind
    run.append_row(row(1, 0.5, 0.3))
    assert run.completed_stages() == 1


def test_finished_run_is_not_overwritten_without_force(tmp_path):
    run = RunDir(tmp_path)
    run.start(CONFIG)
    run.append_row(row(0, 0.1, 0.2))
    run.mark_finished()
    assert run.finished()
    with pytest.raises(RunExistsError, match="finished run.*--force"):
        RunDir(tmp_path).start(CONFIG)
    # resuming a finished run of the same experiment keeps it (the runner rebuilds a missing report) ...
    RunDir(tmp_path).start(CONFIG, resume=True)
    assert run.finished() and run.completed_stages() == 0
    # ... but not of another experiment
    with pytest.raises(RunExistsError, match="different experiment; the config differs in seed"):
        RunDir(tmp_path).start({**CONFIG, "seed": 1}, resume=True)
    RunDir(tmp_path).start({**CONFIG, "seed": 1}, force=True)
    assert run.rows() == [] and not run.finished() and run.config()["seed"] == 1


def test_unfinished_run_needs_resume_or_force(tmp_path):
    run = RunDir(tmp_path)
    run.start(CONFIG)
    run.append_row(row(0, 0.1, 0.2))
    with pytest.raises(RunExistsError, match="unfinished run.*--resume.*--force"):
        RunDir(tmp_path).start(CONFIG)
    RunDir(tmp_path).start(CONFIG, resume=True)
    assert run.completed_stages() == 0  # resuming keeps the rows


def test_resume_with_changed_config_names_the_keys(tmp_path):
    RunDir(tmp_path).start(CONFIG)
    changed = {**CONFIG, "grpo": {"lr": 1e-5, "micro_batch_tokens": 4096}, "seed": 3}
    with pytest.raises(RunExistsError, match=r"differs in grpo.lr, seed \(grpo.lr: saved 1e-06, now 1e-05"):
        RunDir(tmp_path).start(changed, resume=True)
    # keys that do not change results may differ
    neutral = {**CONFIG, "out": "elsewhere", "model": {"name": "m", "device": "cuda"},
               "grpo": {"lr": 1e-6, "micro_batch_tokens": 999}}
    RunDir(tmp_path).start(neutral, resume=True)
    # a removed key is a difference too
    without = {k: v for k, v in CONFIG.items() if k != "stream"}
    with pytest.raises(RunExistsError, match="stream.train"):
        RunDir(tmp_path).start(without, resume=True)


def test_a_foreign_directory_is_never_wiped(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for kwargs in ({}, {"force": True}, {"resume": True}):
        with pytest.raises(RunExistsError, match="not empty and holds no contrail run"):
            RunDir(tmp_path).start(CONFIG, **kwargs)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    RunDir(empty).start(CONFIG)  # an empty directory is fine
    assert (empty / "config.yaml").is_file()


def test_checkpoints_and_trajectories(tmp_path):
    run = RunDir(tmp_path)
    run.start(CONFIG)
    assert run.latest_checkpoint() is None
    for stage in (0, 1, 2):
        run.append_row(row(stage, 0.1, 0.1))
    assert run.checkpoint_dir(2).name == "stage-02"
    for stage in (1, 3):  # stage 3 saved but never recorded
        run.checkpoint_dir(stage).mkdir(parents=True)
        (run.checkpoint_dir(stage) / "model.safetensors").write_text("x")
    run.checkpoint_dir(2).mkdir(parents=True)  # empty: an interrupted save
    assert run.latest_checkpoint() == run.checkpoint_dir(1)
    path = run.trajectories_path(2)
    assert path.parent.is_dir() and path.name == "stage-02.jsonl"


def test_result_matrix(tmp_path):
    rows = [row(0, 0.1, 0.2), row(1, 0.5, 0.25)]
    rows[1]["results"]["b:easy"]["avg_at_k"] = float("nan")
    R = result_matrix(rows, ["b:easy", "a:easy", "c:easy"])
    assert R.shape == (2, 3)
    assert R[0, :2].tolist() == [0.2, 0.1] and R[1, 1] == 0.5
    assert math.isnan(R[1, 0]) and np.isnan(R[:, 2]).all()
    assert result_matrix(rows, ["a:easy"], "invalid_rate").tolist() == [[0.1], [0.1]]
    with pytest.raises(ValueError, match="unknown measure 'success'.*avg_at_k"):
        result_matrix(rows, ["a:easy"], "success")
    # A measure added since an older row was written is nan in that row, not an error.
    rows[1]["results"]["a:easy"]["cut_rate"] = 0.25
    assert np.isnan(result_matrix(rows, ["a:easy"], "cut_rate")[0, 0])
    assert result_matrix(rows, ["a:easy"], "cut_rate")[1, 0] == 0.25
    # NaN survives a round trip through results.jsonl
    run = RunDir(tmp_path)
    run.start(CONFIG)
    for r in rows:
        run.append_row(r)
    assert math.isnan(result_matrix(run.rows(), ["b:easy"])[1, 0])


def test_config_differences():
    assert config_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == ["a.c", "d"]
    assert config_differences(CONFIG, json.loads(json.dumps(CONFIG))) == []


def test_a_corrupt_line_names_its_file_and_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"stage": 0}\n\n{"stage": 1\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"log\.jsonl:3: not a JSON row"):
        read_jsonl(path, "row")
    path.write_text('{"stage": 0}\n\n{"stage": 1}\n', encoding="utf-8")
    assert read_jsonl(path, "row") == [{"stage": 0}, {"stage": 1}]
