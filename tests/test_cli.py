"""The contrail command: user errors are one line with exit code 2, bugs keep their traceback (exit 1);
dry runs of every shipped experiment; eval on a tiny model; report and compare on a hand-made run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contrail import cli
from contrail.agent.rollout import Trajectory
from contrail.cli import main
from contrail.envs.base import Task
from contrail.evaluation import EvalResult
from contrail.experiment import Experiment, StrategySpec, StreamSpec, run_label
from contrail.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse errors exit
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, expected):
    assert code == 2, err
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--env", "nowhere:easy"], "unknown environment 'nowhere'; valid: alfworld, babyai"),
    (["eval", "--env", "textcraft:medium"], "unknown difficulty 'medium' for textcraft; valid: easy, hard"),
    (["eval", "--env", "textcraft:easy", "-k", "0"], "argument -k: must be >= 1, got 0"),
    (["eval", "--env", "textcraft:easy", "--model", "/no/such/model"], "model '/no/such/model' not found: tried"),
    (["eval", "--env", "textcraft:easy", "--device", "banana"], "device 'banana' is not a device; valid: auto, cpu"),
    (["eval", "--env", "textcraft:easy", "--top-p", "1.5"], "--top-p: top_p must be in (0, 1], got 1.5"),
    (["sft", "--env", "nowhere", "--out", "{tmp}/x"], "unknown environment 'nowhere'"),
    (["train", "--env", "textcraft:easy", "--out", "{tmp}/x", "--group-size", "1"], "group_size must be >= 2"),
    (["train", "--env", "textcraft:easy", "--out", "{tmp}/x", "--device", "cuda:7"],
     "device 'cuda:7' is not available"),
    (["run", "experiments/quickstart.yaml", "strategy=nonsense"],
     "override 'strategy=nonsense': strategy: unknown strategy preset 'nonsense'"),
    (["run", "experiments/quickstart.yaml", "model.device=banana", "--dry-run"],
     "override 'model.device=banana': model.device: device 'banana' is not a device"),
    (["run", "experiments/quickstart.yaml", "rollout.max_new_tokens=0", "--dry-run"],
     "override 'rollout.max_new_tokens=0': rollout.max_new_tokens: must be an int >= 1, got 0"),
    (["run", "experiments/quickstart.yaml", "stream.env_options={textcraft: {bogus_option: 1}}", "--dry-run"],
     "stream.env_options.textcraft.bogus_option: unknown option 'bogus_option' for textcraft; valid: "),
    (["run", "no/such/experiment.yaml", "--dry-run"], "no/such/experiment.yaml: no such experiment file"),
    (["report", "/no/such/run"], "/no/such/run: no such run directory"),
    (["report", "{tmp}"], "not a contrail run with results (no results.jsonl)"),
    (["compare", "{tmp}", "{tmp}"], "not a contrail run with results (no results.jsonl)"),
    (["eval", "--env", "textcraft:easy", "--seed", "-1"], "argument --seed: seed must be an integer in [0, 2**63 - 1]"),
])
def test_bad_input_is_one_line_with_exit_code_2(capsys, tmp_path, argv, expected):
    code, _, err = run_cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert_one_line_error(code, err, expected)
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_eval_out_pointing_at_a_file_is_refused_before_anything_runs(capsys, tmp_path):
    existing = tmp_path / "taken.json"
    existing.write_text("{}")
    code, _, err = run_cli(capsys, "eval", "--env", "textcraft:easy", "--out", existing)
    assert_one_line_error(code, err, f"--out {existing} is an existing file, not a directory")
    assert existing.read_text() == "{}"


def test_cuda_on_a_cpu_machine_is_one_line_not_an_assertion(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = run_cli(capsys, "run", "experiments/quickstart.yaml", "model.device=cuda", "--dry-run")
    assert_one_line_error(code, err, "model.device: device 'cuda' is not available: torch sees no CUDA device here")


def test_a_binary_experiment_file_is_named(capsys, tmp_path):
    binary = tmp_path / "photo.yaml"
    binary.write_bytes(bytes(range(256)))
    code, _, err = run_cli(capsys, "run", binary, "--dry-run")
    assert_one_line_error(code, err, f"{binary}: not a UTF-8 text file")


@pytest.mark.parametrize("error", ["ConfigError", "UnknownNameError", "EnvOptionError", "RunExistsError",
                                   "ModelNotFoundError", "DeviceError"])
def test_each_user_error_type_exits_2_in_one_line(capsys, monkeypatch, error):
    classes = {cls.__name__: cls for cls in cli.user_errors()}

    def fails(args):
        raise classes[error]("the user's mistake\nsecond line")

    monkeypatch.setattr(cli, "cmd_envs", fails)
    code, _, err = run_cli(capsys, "envs")
    assert_one_line_error(code, err, "contrail envs: error: the user's mistake")


def test_a_bug_keeps_its_traceback_and_exits_1(tmp_path):
    """An internal error (here a ValueError that is not one of contrail's user errors) is not swallowed."""
    script = ("import sys; from contrail import cli\n"
              "def broken(args): raise ValueError('an internal bug')\n"
              "cli.cmd_envs = broken\n"
              "sys.exit(cli.main(['envs']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "ValueError: an internal bug" in done.stderr


def test_python_m_contrail_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "contrail", "run", "experiments/quickstart.yaml", "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "stage 1 babyai:easy" in done.stdout


def test_envs_lists_every_environment_with_counts(capsys):
    code, out, _ = run_cli(capsys, "envs")
    assert code == 0
    for name in ("babyai", "textcraft", "webshop", "searchqa"):
        assert name in out
    assert "easy" in out and "hard" in out


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_shipped_experiment_dry_runs(capsys, path):
    code, out, err = run_cli(capsys, "run", path.relative_to(ROOT), "--dry-run")
    assert code == 0, err
    assert f"experiment {path.stem}:" in out and "stage 1 " in out and "evaluation total" in out


def test_dry_run_prints_the_plan_and_writes_nothing(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "run", "experiments/quickstart.yaml", f"out={tmp_path / 'q'}", "--dry-run")
    assert code == 0
    assert "stage 1 babyai:easy" in out and "stage 2 textcraft:easy" in out
    assert not (tmp_path / "q").exists()



def test_overrides_may_follow_the_options(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "experiments/quickstart.yaml", "--dry-run", f"out={tmp_path / 'q'}",
                             "strategy=replay", "grpo.tasks_per_step=3")
    assert code == 0, err
    assert f"out {tmp_path / 'q'}, seed 0, strategy replay" in out
    assert "6 steps × 3 tasks × group 8" in out
    code, _, err = run_cli(capsys, "run", "experiments/quickstart.yaml", "--dry-run", "strategy=nonsense")
    assert_one_line_error(code, err, "override 'strategy=nonsense': strategy: unknown strategy preset 'nonsense'")


def test_words_after_the_options_that_are_not_overrides_are_refused(capsys):
    code, _, err = run_cli(capsys, "run", "experiments/quickstart.yaml", "--dry-run", "strategy=replay", "--forse")
    assert code == 2
    assert "unrecognized arguments: --forse" in err
    code, _, err = run_cli(capsys, "envs", "strategy=replay")
    assert code == 2
    assert "unrecognized arguments: strategy=replay" in err

def test_preset_dir_is_searched_first(capsys, tmp_path):
    (tmp_path / "presets" / "streams").mkdir(parents=True)
    (tmp_path / "presets" / "streams" / "quickstart.yaml").write_text("train: [textcraft:easy]\ntest_tasks: 3\n")
    code, out, err = run_cli(capsys, "run", "experiments/quickstart.yaml", "--dry-run",
                             "--preset-dir", tmp_path / "presets")
    assert code == 0, err
    assert "stage 1 textcraft:easy" in out and "babyai:easy 0" not in out


def test_train_builds_the_warm_start_run_builds(tmp_path):
    """``contrail train --warmstart-episodes N`` and ``model.warmstart: {envs, episodes: N}`` are one WarmStart."""
    args = cli.build_parser().parse_args(["train", "--env", "textcraft:easy", "--out", str(tmp_path / "t"),
                                          "--warmstart-episodes", "12", "--device", "cpu"])
    from_cli = cli.train_experiment(args).model.warmstart
    experiment = tmp_path / "w.yaml"
    experiment.write_text("stream: {train: [textcraft:easy]}\n"
                          "model: {warmstart: {envs: [textcraft:easy], episodes: 12}}\n")
    from contrail.experiment import load_experiment

    assert from_cli == load_experiment(experiment).model.warmstart
    assert from_cli.precision == "auto" and from_cli.epochs == 2


def test_train_spaces_its_checkpoints_within_training_by_checkpoint_minutes(capsys, tmp_path):
    argv = ["train", "--env", "textcraft:easy", "--out", str(tmp_path / "t"), "--device", "cpu"]
    assert cli.train_experiment(cli.build_parser().parse_args(argv)).checkpoint_minutes == 5.0
    every_step = cli.build_parser().parse_args([*argv, "--checkpoint-minutes", "0"])
    assert cli.train_experiment(every_step).checkpoint_minutes == 0.0
    code, _, err = run_cli(capsys, *argv, "--checkpoint-minutes", "-1")
    assert_one_line_error(code, err, "checkpoint_minutes must be a finite number >= 0, got -1.0")
    assert not (tmp_path / "t").exists()  # refused before anything is written


def test_eval_writes_results_and_readable_trajectories(capsys, tmp_path):
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    code, out, _ = run_cli(capsys, "eval", "--model", tmp_path / "model", "--env", "magic:easy", "--device", "cpu",
                           "--tasks", "3", "-k", "2", "--max-new-tokens", "3", "--out", tmp_path / "ev")
    assert code == 0 and "magic:easy" in out
    summary = json.loads((tmp_path / "ev" / "results.json").read_text())
    result = summary["results"]["magic:easy"]
    assert result["tasks"] == 3 and result["k"] == 2
    lines = (tmp_path / "ev" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 6
    record = json.loads(lines[0])
    assert record["messages"][0]["role"] == "user" and "success" in record


# --- report and compare on a run directory made by hand (issue #15, item 2) ----------------------------


def make_run(path: Path, strategy: StrategySpec, seed: int, matrix: list[list[int]]) -> Path:
    """A finished two-stage run over magic:easy and magic-berry:easy: successes out of 3 tasks × k=2 per cell."""
    tests = ["magic:easy", "magic-berry:easy"]
    experiment = Experiment(name=path.name, out=str(path), seed=seed, strategy=strategy,
                            stream=StreamSpec(train=tests, test_tasks=3))
    label = experiment.label = run_label(experiment)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(experiment.to_yaml())
    stages = [{"index": i, "name": name, "new": [name], "steps": 1, "weights": {name: 1.0}, "seed": i}
              for i, name in enumerate(tests, start=1)]
    plan = {"test": tests, "trained_at": [1, 2], "stages": stages, "start_model": "tiny", "warmstart": None,
            "base_success": None, "label": label, "seed": seed}
    (path / "plan.json").write_text(json.dumps(plan))
    (path / "trajectories").mkdir()
    rows = []
    for stage, successes in enumerate(matrix):
        results, records = {}, []
        for name, wins in zip(tests, successes, strict=True):
            env = name.partition(":")[0]
            for index in range(6):
                task = Task(env, index // 2, "test", "easy")
                records.append(Trajectory(task, [], [], [], [{"role": "user", "content": "go"}],
                                          reward=float(index < wins), success=index < wins, turns=1,
                                          sample=index % 2).to_record())
            solved = len({i // 2 for i in range(wins)})
            results[name] = EvalResult(tasks=3, k=2, avg_at_k=wins / 6, pass_at_k=solved / 3, reward=wins / 6,
                                       turns=1.0, generated_tokens=3.0, invalid_rate=0.0, truncated_rate=0.0,
                                       errors=0).to_dict()
        rows.append({"stage": stage, "name": "untouched" if stage == 0 else tests[stage - 1],
                     "trained": [] if stage == 0 else [tests[stage - 1]], "results": results, "train": {},
                     "wall_seconds": 1.0})
        (path / "trajectories" / f"stage-{stage:02d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "FINISHED").write_text("")
    return path


def test_report_and_compare_end_to_end(capsys, tmp_path):
    replay = StrategySpec(name="replay", options={"replay_share": 0.5})
    first = make_run(tmp_path / "a", replay, 0, [[0, 0], [6, 0], [3, 6]])
    second = make_run(tmp_path / "b", replay, 1, [[0, 0], [6, 0], [0, 6]])
    other = make_run(tmp_path / "c", StrategySpec(name="replay", options={"replay_share": 0.25}), 0,
                     [[0, 0], [6, 0], [6, 6]])

    code, out, err = run_cli(capsys, "report", first)
    assert code == 0, err
    report = (first / "report.md").read_text()
    assert "magic:easy" in report and (first / "matrix.csv").is_file() and "report.md" in out

    code, out, err = run_cli(capsys, "compare", first, second, other)
    assert code == 0, err
    table = [line for line in out.splitlines() if line.startswith("| replay")]
    assert len(table) == 2  # two replay_share settings: never averaged together
    assert any("n=2" in line for line in table) and any("n=1" in line for line in table)


def test_train_runs_one_experiment_whose_config_yaml_loads_back(capsys, tmp_path):
    """``contrail train`` goes through the runner with its Experiment; the run's config.yaml is that Experiment."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    argv = ["train", "--model", str(tmp_path / "model"), "--env", "magic:easy", "--steps", "1",
            "--out", str(tmp_path / "run"), "--device", "cpu", "--eval-tasks", "2", "-k", "1", "--group-size", "2",
            "--tasks-per-step", "1", "--max-new-tokens", "3", "--max-episode-tokens", "128", "--batch-episodes", "4"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    expected = cli.train_experiment(cli.build_parser().parse_args(argv))
    assert Experiment.from_yaml(tmp_path / "run" / "config.yaml") == expected
    code, out, err = run_cli(capsys, "run", tmp_path / "run" / "config.yaml", "--dry-run")
    assert code == 0, err
    assert "stage 1 mixture: 1 steps × 1 tasks × group 2" in out
