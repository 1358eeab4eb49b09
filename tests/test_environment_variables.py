"""contrail's environment variables: every one the package reads is in ``contrail --help``, and every cache
follows ``CONTRAIL_CACHE`` unless its own variable says otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contrail import cli
from contrail.envs.searchqa import retrieval
from contrail.envs.webshop import store

PACKAGE = Path(cli.__file__).resolve().parent


def variables_read_by_the_package() -> set[str]:
    found = set()
    for source in PACKAGE.rglob("*.py"):
        found.update(re.findall(r"[\"'](CONTRAIL_[A-Z_]+)[\"']", source.read_text()))
    return found


def test_contrail_help_lists_every_variable_the_package_reads():
    variables = variables_read_by_the_package()
    assert {"CONTRAIL_CACHE", "CONTRAIL_MALLOC"} <= variables  # the scan finds them at all
    epilog = cli.build_parser().format_help()
    assert [name for name in sorted(variables) if name not in epilog] == []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    for name in variables_read_by_the_package():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path))
    return tmp_path


def test_searchqa_s_indices_follow_contrail_s_cache_unless_told_otherwise(cache, monkeypatch, tmp_path):
    assert retrieval.cache_root() == cache / "searchqa"
    assert retrieval.cache_root(tmp_path / "given") == tmp_path / "given" / "searchqa"
    monkeypatch.setenv(retrieval.CACHE_ENV_VAR, str(tmp_path / "own"))
    assert retrieval.cache_root() == tmp_path / "own"


def test_webshop_s_data_follows_contrail_s_cache_unless_told_otherwise(cache, monkeypatch, tmp_path):
    assert store.default_cache_root() == cache / "webshop"
    monkeypatch.setenv(store.CACHE_ENV_VAR, str(tmp_path / "own"))
    assert store.default_cache_root() == tmp_path / "own"


def test_alfworld_s_games_follow_contrail_s_cache_unless_told_otherwise(cache, monkeypatch, tmp_path):
    pytest.importorskip("alfworld")
    from contrail.envs.alfworld import games

    assert games.default_cache_dir().parent == cache / "alfworld"
    monkeypatch.setenv(games.CACHE_ENV_VAR, str(tmp_path / "own"))
    assert games.default_cache_dir().parent == tmp_path / "own"
