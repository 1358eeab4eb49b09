"""The contrail command: one-line errors with exit code 2, listing, dry runs, and eval on a tiny model."""

from __future__ import annotations

import json

import pytest

from contrail.cli import main
from contrail.testing import tiny_model, tiny_tokenizer


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse errors exit
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--env", "nowhere:easy"], "unknown environment 'nowhere'; valid: alfworld, babyai"),
    (["eval", "--env", "textcraft:medium"], "unknown difficulty 'medium' for textcraft; valid: easy, hard"),
    (["eval", "--env", "textcraft:easy", "-k", "0"], "argument -k: must be >= 1, got 0"),
    (["eval", "--env", "textcraft:easy", "--model", "/no/such/model"], "model '/no/such/model' not found: tried"),
    (["sft", "--env", "nowhere", "--out", "x"], "unknown environment 'nowhere'"),
    (["run", "experiments/quickstart.yaml", "strategy=nonsense"], "nonsense"),
])
def test_bad_input_is_one_line_with_exit_code_2(capsys, argv, expected):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err


def test_envs_lists_every_environment_with_counts(capsys):
    code, out, _ = run_cli(capsys, "envs")
    assert code == 0
    for name in ("babyai", "textcraft", "webshop", "searchqa"):
        assert name in out
    assert "easy" in out and "hard" in out


def test_dry_run_prints_the_plan_without_a_model(capsys):
    code, out, _ = run_cli(capsys, "run", "experiments/quickstart.yaml", "--dry-run")
    assert code == 0
    assert "stage 1 babyai:easy" in out and "stage 2 textcraft:easy" in out


def test_eval_writes_results_and_readable_trajectories(capsys, tmp_path):
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    code, out, _ = run_cli(capsys, "eval", "--model", str(tmp_path / "model"), "--env", "magic:easy",
                           "--tasks", "3", "-k", "2", "--max-new-tokens", "3", "--out", str(tmp_path / "ev"))
    assert code == 0 and "magic:easy" in out
    summary = json.loads((tmp_path / "ev" / "results.json").read_text())
    result = summary["results"]["magic:easy"]
    assert result["tasks"] == 3 and result["k"] == 2
    lines = (tmp_path / "ev" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 6
    record = json.loads(lines[0])
    assert record["messages"][0]["role"] == "user" and "success" in record
