"""Sweeps over many machines: ``contrail run x.yaml --list`` and ``--shard i/n``.

The shares of an ablation must be disjoint, cover every run and be the same
on every machine (a SLURM array's tasks each compute their own share); none
of this loads a model. A sharded run must run only its share.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contrail import cli
from contrail.cli import main
from contrail.experiment import ShardError, expand_runs, load_experiment, parse_shard, shard

ROOT = Path(__file__).resolve().parent.parent
ABLATION = ROOT / "experiments" / "ordering_ablation.yaml"   # 6 orders x 3 seeds = 18 runs


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def listed(capsys, *argv) -> list[tuple[int, str, str]]:
    code, out, err = run_cli(capsys, "run", ABLATION, "--list", *argv)
    assert code == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert all(len(row) == 3 for row in rows), out
    return [(int(index), label, directory) for index, label, directory in rows]


def test_list_prints_every_run_with_its_index_label_and_directory(capsys):
    runs = expand_runs(load_experiment(ABLATION))
    rows = listed(capsys)
    assert len(rows) == len(runs) == 18
    assert [index for index, _, _ in rows] == list(range(18))
    assert [directory for _, _, directory in rows] == [r.out for r in runs]
    assert len({directory for _, _, directory in rows}) == 18          # every run writes its own directory
    assert rows[0][1] == f"{runs[0].label} (seed 0)"
    assert "babyai:easy → textcraft:easy → webshop:easy" in rows[0][1]


@pytest.mark.parametrize("count", [1, 4, 5, 18, 25])
def test_shards_are_disjoint_cover_the_sweep_and_follow_j_mod_n(capsys, count):
    everything = listed(capsys)
    shares = [listed(capsys, "--shard", f"{i}/{count}") for i in range(count)]
    seen = [row for share in shares for row in share]
    assert sorted(seen) == sorted(everything)                          # covering, nothing twice
    assert len({index for index, _, _ in seen}) == len(seen)            # disjoint
    for i, share in enumerate(shares):
        assert all(index % count == i for index, _, _ in share)
        sizes = {len(s) for s in shares}
        assert max(sizes) - min(sizes) <= 1                              # balanced


def test_shards_are_deterministic(capsys):
    assert listed(capsys, "--shard", "2/4") == listed(capsys, "--shard", "2/4")
    assert [index for index, _, _ in listed(capsys, "--shard", "2/4")] == [2, 6, 10, 14]


def test_shard_helper_keeps_positions():
    assert shard(list("abcde"), 1, 2) == [(1, "b"), (3, "d")]
    assert shard(list("ab"), 2, 3) == []
    with pytest.raises(ShardError):
        shard(list("ab"), 3, 3)


@pytest.mark.parametrize("text, expected", [
    ("0/1", (0, 1)), ("3/4", (3, 4)), (" 2 / 8 ", (2, 8)),
])
def test_parse_shard(text, expected):
    assert parse_shard(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("4/4", "the share i must be in 0..3"),
    ("0/0", "n must be >= 1"),
    ("1", "expected i/n"),
    ("-1/4", "expected i/n"),
    ("a/b", "expected i/n"),
    ("1/2/3", "expected i/n"),
])
def test_bad_shard_is_one_line_with_exit_2(capsys, text, expected):
    code, out, err = run_cli(capsys, "run", ABLATION, "--list", f"--shard={text}")
    assert code == 2, err
    assert expected in err and "--shard" in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""


def test_a_sharded_run_runs_only_its_share(capsys, monkeypatch):
    """``--shard`` without ``--list`` hands exactly its share to the runner (and compares nothing)."""
    ran, compared = [], []
    monkeypatch.setattr("contrail.runner.run", lambda one, **kw: ran.append(one.out))
    monkeypatch.setattr(cli, "print_run", lambda result: None)
    monkeypatch.setattr("contrail.report.compare", lambda dirs: compared.append(dirs) or "")
    code, _, err = run_cli(capsys, "run", ABLATION, "--shard", "1/8")
    assert code == 0, err
    runs = expand_runs(load_experiment(ABLATION))
    assert ran == [runs[1].out, runs[9].out, runs[17].out]
    assert compared == []   # one share cannot compare the sweep: `contrail compare` gathers it afterwards
