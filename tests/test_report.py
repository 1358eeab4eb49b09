"""Reports from run directories (full, partial, with trajectories) and comparisons over seeds."""

import csv
import json
import math

import pytest

from contrail.agent.rollout import Trajectory
from contrail.envs.base import Task
from contrail.evaluation import summarize
from contrail.report import analyse, compare, load_run, write_report
from contrail.results import RunDir

TEST = ["a:easy", "b:easy", "c:easy"]  # c is held out
TRAINED_AT = [1, 2, None]
# avg@k; row 0 untouched, then after stages 1 and 2
R = [[0.1, 0.2, 0.3], [0.8, 0.3, 0.3], [0.6, 0.9, 0.5]]


def ev(avg):
    return {"tasks": 4, "k": 2, "avg_at_k": avg, "pass_at_k": min(1.0, avg + 0.1), "reward": avg / 2,
            "turns": 3.0, "generated_tokens": 20.0, "invalid_rate": 0.25, "truncated_rate": 0.0, "errors": 0}


def make_run(path, matrix=R, seed=0, label=None, stages=2, finished=True, warm=True, with_plan_meta=True, epochs=2):
    run = RunDir(path)
    run.start({"name": "ignored: the report reads plan.json, not config.yaml"})
    warmstart = {"envs": ["a:easy"], "episodes": 60, "epochs": epochs, "lr": 1e-4} if warm else None
    plan = {"test": TEST, "trained_at": TRAINED_AT, "start_model": "smollm2-135m", "warmstart": warmstart,
            "stages": [{"index": i, "name": TEST[i - 1], "new": [TEST[i - 1]], "steps": 3,
                        "weights": {TEST[i - 1]: 1.0}, "seed": 11} for i in (1, 2)]}
    if with_plan_meta:
        plan.update(label=label or "sequential: a:easy → b:easy", seed=seed)
    (path / "plan.json").write_text(json.dumps(plan))
    for s, values in enumerate(matrix[: stages + 1]):
        name = "warm-start" if s == 0 and warm else ("untouched" if s == 0 else TEST[s - 1])
        run.append_row({"stage": s, "name": name,
                        "trained": [] if s == 0 else [TEST[s - 1]],
                        "results": {n: ev(v) for n, v in zip(TEST, values)}, "train": {}, "wall_seconds": 90.0})
    if finished:
        run.mark_finished()
    return path


def test_a_one_epoch_warm_start_reads_in_the_singular(tmp_path):
    md = write_report(make_run(tmp_path / "run", epochs=1))[0].read_text()
    assert "(60 episodes in all, 1 epoch, lr" in md


def test_full_report_without_trajectories(tmp_path):
    paths = write_report(make_run(tmp_path / "run"))
    assert [p.name for p in paths] == ["report.md", "matrix.csv", "metrics.csv", "heatmap.png", "success_by_stage.png"]
    for p in paths[3:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    md = paths[0].read_text()
    assert "# run" in md and "stages recorded: 2 of 2 (finished)" in md
    assert "- run: sequential: a:easy → b:easy; seed: 0" in md
    assert "uncertainty: no intervals: the evaluation trajectories of some rows are missing" in md
    assert "warm-start: behaviour cloning on expert episodes of a:easy (60 episodes in all, 2 epochs" in md
    for title in ("avg@k", "pass@k", "reward", "turns", "generated tokens", "invalid-action rate"):
        assert f"## {title} after each stage" in md
    assert "| after stage | a:easy (trained s1) | b:easy (trained s2) | c:easy (held out) |" in md
    assert "| 0 warm-start | 0.100 | 0.200 | 0.300 |" in md
    assert "| 1 a:easy | **0.800** | 0.300 | 0.300 |" in md  # bold where first trained
    assert "| 2 b:easy | 0.600 | **0.900** | 0.500 |" in md
    assert "| 2 b:easy | 0.250 | **0.250** | 0.250 |" in md  # the invalid-action rate table
    assert "| 2 b:easy | 20.0 | **20.0** | 20.0 |" in md  # generated tokens
    # metrics: ACC (0.6+0.9)/2, BWT 0.6-0.8, forgetting 0.8-0.6, FWT R[1,b]-R[0,b], held-out gain 0.5-0.3
    assert "| ACC | 0.750 | – | – |" in md and "| BWT | -0.200 |" in md and "| forgetting | 0.200 |" in md
    assert "| FWT | 0.100 |" in md and "| held-out gain | 0.200 |" in md
    # ΔHeld-In: (0.5 + 0.7) / 2; ΔOverall: (0.5 + 0.7 + 0.2) / 3
    assert "| ΔHeld-In | 0.600 |" in md and "| ΔHeld-Out | 0.200 |" in md and "| ΔOverall | 0.467 |" in md
    assert "| 1 a:easy | 0.700 | 0.000 | 0.267 |" in md  # the per-row Δ table: a trained by row 1 only
    assert "| c:easy | held out | 0.300 | 0.500 | – | – | – | 0.200 |" in md
    assert "| 1 | a:easy | a:easy | a:easy 1.00 | 3 | 1.5 min |" in md
    assert "No failure tags: the evaluation trajectories are missing." in md
    with open(paths[1]) as f:
        rows = list(csv.reader(f))
    assert rows[0][:6] == ["measure", "stage", "stage_name", *TEST]
    assert rows[0][6:9] == ["a:easy se", "a:easy ci_low", "a:easy ci_high"]
    assert rows[1] == ["avg_at_k", "0", "warm-start", "0.1", "0.2", "0.3"] + [""] * 9
    assert ["reward", "2", "b:easy", "0.3", "0.45", "0.25"] + [""] * 9 in rows
    assert len(rows) == 1 + 6 * 3
    with open(paths[2]) as f:
        metric_rows = {r[0]: r[1:] for r in csv.reader(f)}
    assert metric_rows["delta_held_in"] == ["0.6", "", "", ""]


def test_the_cut_turn_table_appears_once_a_row_records_it_and_an_older_row_shows_a_dash(tmp_path):
    path = make_run(tmp_path / "old")  # rows written before turns were marked cut
    assert "cut at max_new_tokens" not in write_report(path)[0].read_text()
    rows = [json.loads(line) for line in (path / "results.jsonl").read_text().splitlines()]
    for row, cut in zip(rows[1:], (0.125, 0.5)):  # row 0 read back from an older cache
        for cell in row["results"].values():
            cell["cut_rate"] = cut
    (path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = write_report(path)
    md = paths[0].read_text()
    table = md.split("## share of turns cut at max_new_tokens after each stage")[1]
    assert "| 0 warm-start | – | – | – |" in table and "| 2 b:easy | 0.500 | **0.500** | 0.500 |" in table
    with open(paths[1]) as f:
        assert ["cut_rate", "1", "a:easy", "0.125", "0.125", "0.125"] + [""] * 9 in list(csv.reader(f))


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
    assert data.label == "run" and data.seed == "?"  # an old run: no label or seed in a plan
    assert "| ACC | 0.800 |" in write_report(path)[0].read_text()


def test_report_needs_rows(tmp_path):
    RunDir(tmp_path / "run").start({"name": "x"})
    (tmp_path / "run" / "results.jsonl").write_text("")
    with pytest.raises(ValueError, match="no results yet"):
        write_report(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="not a contrail run"):
        write_report(tmp_path / "nothing")


# --- a run with its evaluation trajectories ---------------------------------------------

MENU = 'Available actions: ["turn left", "move forward"]'


def episode(env, task_id, success, sample, invalid_streak=False):
    task = Task(env, task_id, "test", "easy")
    messages = [{"role": "user", "content": "instruction"}, {"role": "assistant", "content": "OK."},
                {"role": "user", "content": f"start\n{MENU}"}]
    turns = 3 if invalid_streak else 1
    for t in range(turns):
        messages.append({"role": "assistant", "content": "Action: fly" if invalid_streak else "Action: turn left"})
        if t < turns - 1:
            messages.append({"role": "user", "content": f"The action is not recognized.\n{MENU}"})
    return Trajectory(task=task, ids=[], mask=[], logprobs=[], messages=messages, reward=float(success),
                      success=success, turns=turns, generated_tokens=5 * turns,
                      invalid_actions=turns if invalid_streak else 0, sample=sample)


def make_run_with_trajectories(path, seed=0):
    """babyai:easy trained in stage 1 (every task goes from failing with invalid streaks to solved);
    textcraft:easy held out, every task solved by one of its two samples at both rows (a cell that
    differs from 0, with no change from row 0)."""
    test = ["babyai:easy", "textcraft:easy"]
    run = RunDir(path)
    run.start({"name": "t"})
    plan = {"test": test, "trained_at": [1, None], "start_model": "tiny", "warmstart": None, "label": "seq",
            "seed": seed,
            "stages": [{"index": 1, "name": "babyai:easy", "new": ["babyai:easy"], "steps": 2,
                        "weights": {"babyai:easy": 1.0}, "seed": 3}]}
    (path / "plan.json").write_text(json.dumps(plan))
    for stage in (0, 1):
        trajs = {"babyai:easy": [episode("babyai", t, stage == 1, s, invalid_streak=stage == 0)
                                 for t in range(4) for s in range(2)],
                 "textcraft:easy": [episode("textcraft", t, s == 0, s) for t in range(4) for s in range(2)]}
        with open(run.trajectories_path(stage), "w") as f:
            for name in test:
                f.writelines(json.dumps(traj.to_record()) + "\n" for traj in trajs[name])
        run.append_row({"stage": stage, "name": "untouched" if stage == 0 else "babyai:easy",
                        "trained": [] if stage == 0 else ["babyai:easy"],
                        "results": {n: summarize(trajs[n], 2).to_dict() for n in test}, "train": {},
                        "wall_seconds": 1.0})
    run.mark_finished()
    return path


def test_report_with_intervals_failures_and_turnover(tmp_path):
    path = make_run_with_trajectories(tmp_path / "run")
    paths = write_report(path, resamples=500)
    md = paths[0].read_text()
    assert "500 bootstrap resamples of the test tasks" in md
    # babyai: every task 0 -> 1, a significant change; textcraft: every task 0.5 at both rows, so its cell
    # excludes 0 but its change from row 0 does not: no mark
    assert "| 0 untouched | 0.000 ± 0.000 | 0.500 ± 0.000 |" in md
    assert "| 1 babyai:easy | **1.000 ± 0.000*** | 0.500 ± 0.000 |" in md
    assert "| ΔHeld-In | 1.000 | 0.000 | [1.000, 1.000] |" in md
    assert "| ΔHeld-Out | 0.000 | 0.000 | [0.000, 0.000] |" in md
    assert "| 1 babyai:easy | 1.000 ± 0.000* | 0.000 ± 0.000 | 0.500 ± 0.000* |" in md
    # the invalid-action streaks of row 0, counted per cell and linked
    assert "| 0 untouched | babyai:easy | 8 | 8 |" in md and "| 1 babyai:easy | babyai:easy | 8 | 0 |" in md
    link = "[row 0, line 1](trajectories/stage-00.jsonl) (babyai task 0, sample 0)"
    assert f"| invalid_streak | >= 3 invalid actions in a row | {link} |" in md
    assert "| 1 babyai:easy | 0 / 4 of 4 | 0 / 0 of 4 |" in md  # turnover: babyai gains 4 tasks
    with open(paths[1]) as f:
        rows = list(csv.reader(f))
    header = rows[0]
    avg1 = next(r for r in rows if r[:2] == ["avg_at_k", "1"])
    assert avg1[header.index("babyai:easy ci_low")] == "1" and avg1[header.index("textcraft:easy ci_low")] == "0.5"
    # deterministic: the same seed writes the same report (test_intervals: another seed moves the intervals)
    assert write_report(path, resamples=500)[0].read_text() == md
    reseeded = write_report(path, resamples=500, seed=1)[0].read_text()
    assert "(a task's k samples kept together; the same resample for every row), seed 1" in reseeded


def test_rows_that_trajectories_do_not_reproduce_get_no_intervals(tmp_path):
    path = make_run_with_trajectories(tmp_path / "run")
    rows = RunDir(path).rows()
    rows[1]["results"]["babyai:easy"]["avg_at_k"] = 0.25
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    analysis = analyse(path, resamples=50)
    assert analysis.bootstrap is None and "do not reproduce" in analysis.note
    assert analysis.failures is not None  # the tags still read the episodes


def test_drift_section_shows_a_rows_drift_entry(tmp_path):
    path = make_run(tmp_path / "run")
    rows = RunDir(path).rows()
    rows[1]["drift"] = {"kl": {"a:easy": {"k3": 0.0123, "se_k3": 0.002}},
                        "params": {"changed": 5, "total": 100, "fraction": 0.05}}
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(path)[0].read_text()
    assert "## Forgetting beyond success" in md
    assert "| 1 a:easy | 0.0123 ± 0.0020 | – | – | 5.00% |" in md


def test_compare_groups_by_label_with_mean_std_and_t_interval(tmp_path):
    shift = [[v + 0.1 for v in row] for row in R]
    runs = [
        make_run(tmp_path / "x0", R, seed=0, label="seq: a → b"),
        make_run(tmp_path / "x1", shift, seed=1, label="seq: a → b"),
        make_run(tmp_path / "y0", R, seed=0, label="replay: a:easy → b:easy"),
        make_run(tmp_path / "z0", R, seed=0, label="partial", stages=1, finished=False),
    ]
    table = compare(runs)
    lines = table.splitlines()
    assert lines[0] == ("| runs | seeds | ACC | BWT | forgetting | FWT | held-out gain | ΔHeld-In | ΔHeld-Out | "
                        "ΔOverall | final a:easy | final b:easy | final c:easy |")
    seq = next(line for line in lines if line.startswith("| seq: a → b"))
    std = math.sqrt(2 * 0.05**2)  # two values 0.1 apart
    half = 12.7062 * std / math.sqrt(2)  # t_{0.975, 1} × se
    assert seq.startswith("| seq: a → b (n=2) | 0, 1 | ")
    assert f"0.800 ± {std:.3f} [{0.8 - half:.3f}, {0.8 + half:.3f}]" in seq  # ACC 0.75 and 0.85
    assert "| -0.200 ± 0.000 [-0.200, -0.200] |" in seq  # BWT unchanged by a constant shift
    assert f"| 0.650 ± {std:.3f}" in seq and f"| 0.950 ± {std:.3f}" in seq
    assert any(line.startswith("| replay: a:easy → b:easy (n=1) | 0 | 0.750 |") for line in lines)
    partial = next(line for line in lines if line.startswith("| partial"))
    assert "(n=1, 1 unfinished)" in partial and "| 0.800 |" in partial
    assert "mean ± sample std over the runs of a group, then [the 95% Student-t interval" in table
    with pytest.raises(ValueError, match="at least one run"):
        compare([])


def test_old_runs_group_by_directory(tmp_path):
    a = make_run(tmp_path / "order1" / "seed0", with_plan_meta=False)
    b = make_run(tmp_path / "order1" / "seed3", with_plan_meta=False)
    assert load_run(a).label == "order1" and load_run(b).seed == 3
    assert "| order1 (n=2) | 0, 3 |" in compare([a, b])


def test_stages_table_shows_the_setup_and_each_evaluations_share_of_the_wall_time(tmp_path):
    path = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (path / "results.jsonl").read_text().splitlines()]
    for row, (wall, evaluation) in zip(rows, [(480.0, 300.0), (996.0, 294.0), (480.0, 282.0)]):
        row.update(wall_seconds=wall, eval_seconds=evaluation)
    (path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    md = write_report(path)[0].read_text()
    assert "| 0 | warm-start | – | – | – | 8.0 min (evaluation 5.0) |" in md
    assert "| 1 | a:easy | a:easy | a:easy 1.00 | 3 | 16.6 min (evaluation 4.9) |" in md
    assert "| 2 | b:easy | b:easy | b:easy 1.00 | 3 | 8.0 min (evaluation 4.7) |" in md


def test_stages_table_shows_each_rows_system_time_and_peak_memory_where_recorded(tmp_path):
    path = make_run(tmp_path / "run")
    rows = [json.loads(line) for line in (path / "results.jsonl").read_text().splitlines()]
    rows[0].update(wall_seconds=480.0, eval_seconds=300.0, system_seconds=90.0, peak_memory_gb=11.24)
    rows[1].update(wall_seconds=996.0, eval_seconds=294.0, system_seconds=6.0, peak_memory_gb=11.5)
    rows[2].update(wall_seconds=480.0, peak_memory_gb=11.5)  # parts a row lacks are left out
    (path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    md = write_report(path)[0].read_text()
    assert "| 0 | warm-start | – | – | – | 8.0 min (evaluation 5.0, system 1.5; peak 11.2 GB) |" in md
    assert "| 1 | a:easy | a:easy | a:easy 1.00 | 3 | 16.6 min (evaluation 4.9, system 0.1; peak 11.5 GB) |" in md
    assert "| 2 | b:easy | b:easy | b:easy 1.00 | 3 | 8.0 min (peak 11.5 GB) |" in md


def test_rows_recorded_without_evaluation_times_keep_the_old_stages_table(tmp_path):
    md = write_report(make_run(tmp_path / "run"))[0].read_text()  # rows with wall_seconds only
    assert "| 1 | a:easy | a:easy | a:easy 1.00 | 3 | 1.5 min |" in md
    assert "| 0 | warm-start |" not in md
