"""Reports from run directories (full and partial) and comparisons over seeds."""

import csv
import json
import math

import pytest
import yaml

from contrail.report import compare, load_run, write_report
from contrail.results import RunDir

TEST = ["a:easy", "b:easy", "c:easy"]  # c is held out
TRAINED_AT = [1, 2, None]
# avg@k; row 0 untouched, then after stages 1 and 2
R = [[0.1, 0.2, 0.3], [0.8, 0.3, 0.3], [0.6, 0.9, 0.5]]


def ev(avg):
    return {"tasks": 4, "k": 2, "avg_at_k": avg, "pass_at_k": min(1.0, avg + 0.1), "reward": avg / 2,
            "turns": 3.0, "generated_tokens": 20.0, "invalid_rate": 0.25, "truncated_rate": 0.0, "errors": 0}


def make_run(path, matrix=R, seed=0, label=None, stages=2, finished=True, warm=True, strategy="sequential"):
    config = {"name": "demo", "seed": seed, "model": {"name": "smollm2-135m"},
              "strategy": {"name": strategy, "options": {}}, "stream": {"train": TEST[:2]}}
    if label:
        config["label"] = label
    run = RunDir(path)
    run.start(config)
    warmstart = {"envs": ["a:easy"], "episodes": 60, "epochs": 2, "lr": 1e-4} if warm else None
    plan = {"test": TEST, "trained_at": TRAINED_AT, "start_model": "smollm2-135m", "warmstart": warmstart,
            "stages": [{"index": i, "name": TEST[i - 1], "experiences": [TEST[i - 1]], "steps": 3,
                        "weights": {TEST[i - 1]: 1.0}} for i in (1, 2)]}
    (path / "plan.json").write_text(json.dumps(plan))
    for s, values in enumerate(matrix[: stages + 1]):
        run.append_row({"stage": s, "name": "warm-start" if s == 0 and warm else ("untouched" if s == 0 else TEST[s - 1]),
                        "trained": [] if s == 0 else [TEST[s - 1]],
                        "results": {n: ev(v) for n, v in zip(TEST, values)}, "train": {}, "wall_seconds": 90.0})
    if finished:
        run.mark_finished()
    return path


def test_full_report(tmp_path):
    paths = write_report(make_run(tmp_path / "run"))
    assert [p.name for p in paths] == ["report.md", "matrix.csv", "heatmap.png", "success_by_stage.png"]
    for p in paths[2:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    md = paths[0].read_text()
    assert "# demo" in md and "stages recorded: 2 of 2 (finished)" in md
    assert "warm-start: behaviour cloning on expert episodes of a:easy (60 episodes in all, 2 epochs" in md
    for title in ("avg@k", "pass@k", "reward", "invalid-action rate"):
        assert f"## {title} after each stage" in md
    assert "| after stage | a:easy (trained s1) | b:easy (trained s2) | c:easy (held out) |" in md
    assert "| 0 warm-start | 0.100 | 0.200 | 0.300 |" in md
    assert "| 1 a:easy | **0.800** | 0.300 | 0.300 |" in md  # bold where first trained
    assert "| 2 b:easy | 0.600 | **0.900** | 0.500 |" in md
    assert "| 2 b:easy | 0.250 | **0.250** | 0.250 |" in md  # the invalid-action rate table
    # metrics: ACC (0.6+0.9)/2, BWT 0.6-0.8, forgetting 0.8-0.6, FWT R[1,b]-R[0,b], held-out gain 0.5-0.3
    assert "| ACC | 0.750 |" in md and "| BWT | -0.200 |" in md and "| forgetting | 0.200 |" in md
    assert "| FWT | 0.100 |" in md and "| held-out gain | 0.200 |" in md
    assert "| c:easy | held out | 0.300 | 0.500 | – | – | – | 0.200 |" in md
    assert "| 1 | a:easy | a:easy | a:easy 1.00 | 3 | 1.5 min |" in md
    with open(paths[1]) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["measure", "stage", "stage_name", *TEST]
    assert rows[1] == ["avg_at_k", "0", "warm-start", "0.1", "0.2", "0.3"]
    assert ["reward", "2", "b:easy", "0.3", "0.45", "0.25"] in rows
    assert len(rows) == 1 + 4 * 3


def test_partial_run_report(tmp_path):
    path = make_run(tmp_path / "run", stages=1, finished=False, warm=False)
    md = write_report(path)[0].read_text()
    assert "stages recorded: 1 of 2 (in progress or interrupted)" in md
    assert "warm-start:" not in md and "| 0 untouched |" in md
    assert "Partial run: over stages 0..1" in md
    # b (planned for stage 2) is dropped from the metrics; a is trained last so far; c is held out
    assert "| ACC | 0.800 |" in md and "| BWT | – |" in md and "| held-out gain | 0.000 |" in md
    assert "| b:easy |" not in md.split("## Continual-learning metrics")[1]
    assert "| 2 | b:easy | b:easy | b:easy 1.00 | 3 | – |" in md


def test_report_with_only_row_zero_and_without_plan(tmp_path):
    path = make_run(tmp_path / "run", stages=0, finished=False)
    md = write_report(path)[0].read_text()
    assert "No stage recorded yet." in md
    (path / "plan.json").unlink()
    make_more = RunDir(path)
    make_more.append_row({"stage": 1, "name": "a:easy", "trained": ["a:easy"],
                          "results": {n: ev(v) for n, v in zip(TEST, R[1])}, "train": {}, "wall_seconds": 1.0})
    data = load_run(path)
    assert data.test == TEST and data.trained_at == [1, None, None]
    assert "| ACC | 0.800 |" in write_report(path)[0].read_text()


def test_report_needs_rows(tmp_path):
    RunDir(tmp_path / "run").start({"name": "x"})
    with pytest.raises(ValueError, match="no results yet"):
        write_report(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="not a contrail run"):
        write_report(tmp_path / "nothing")


def test_compare_groups_by_label_with_mean_and_std(tmp_path):
    shift = [[v + 0.1 for v in row] for row in R]
    runs = [
        make_run(tmp_path / "x0", R, seed=0, label="seq: a → b"),
        make_run(tmp_path / "x1", shift, seed=1, label="seq: a → b"),
        make_run(tmp_path / "y0", R, seed=0, strategy="replay"),  # no label: strategy and order
        make_run(tmp_path / "z0", R, seed=0, label="partial", stages=1, finished=False),
    ]
    table = compare(runs)
    lines = table.splitlines()
    assert lines[0] == ("| runs | seeds | ACC | BWT | forgetting | FWT | held-out gain | final a:easy | final b:easy "
                        "| final c:easy |")
    seq = next(line for line in lines if line.startswith("| seq: a → b"))
    std = math.sqrt(2 * 0.05**2)  # two values 0.1 apart
    assert seq.startswith("| seq: a → b (n=2) | 0, 1 | ")
    assert f"0.800 ± {std:.3f}" in seq  # ACC 0.75 and 0.85
    assert f"| -0.200 ± 0.000 |" in seq  # BWT unchanged by a constant shift
    assert f"| 0.650 ± {std:.3f} | 0.950 ± {std:.3f} | 0.550 ± {std:.3f} |" in seq
    assert any(line.startswith("| replay: a:easy → b:easy (n=1) | 0 | 0.750 |") for line in lines)
    partial = next(line for line in lines if line.startswith("| partial"))
    assert "(n=1, 1 unfinished)" in partial and "| 0.800 |" in partial
    assert "Metrics on avg@k; mean ± sample std" in table
    with pytest.raises(ValueError, match="at least one run"):
        compare([])


def test_report_reads_the_config_the_run_saved(tmp_path):
    path = make_run(tmp_path / "run")
    assert yaml.safe_load((path / "config.yaml").read_text())["name"] == "demo"
    assert load_run(path).label == "sequential: a:easy → b:easy"
