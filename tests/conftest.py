"""Shared fixtures: the tiny tokenizer and model, and stand-in environments.

A stand-in environment is registered for one test and removed after it (the
registry refuses a second class under a taken name, so tests that registered
at import time would collide); `stand_in_env` gives each test its own name.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import contrail.envs as envs
from contrail.testing import MagicWordEnv, tiny_model, tiny_tokenizer

_NAMES = itertools.count()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run faster on one thread than on a shared machine's contended cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    """The word-level chatML tokenizer of `contrail.testing` (built once per session)."""
    return tiny_tokenizer()


@pytest.fixture
def model(tokenizer):
    """A fresh random-init two-layer Llama sized to `tokenizer` (seed 0)."""
    return tiny_model(tokenizer)


@pytest.fixture
def stand_in_env():
    """A subclass of `MagicWordEnv` registered under a fresh name for this test only.

    Yields the class; ``cls.name`` is its registered name, so
    ``envs.make(cls.name)`` and tasks of it work, and it is unregistered after.
    """
    name = f"stand-in-{next(_NAMES)}"
    cls = type("StandInEnv", (MagicWordEnv,), {"__module__": __name__})
    with envs.registered(name, cls):
        yield cls


# --- built-in environments -------------------------------------------------------------

OWN_ENVS = ("textcraft", "alfworld", "webshop", "searchqa")


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory):
    """One disk cache for the whole session (generated games, catalogues, indices are built once)."""
    return tmp_path_factory.mktemp("env-cache")


@pytest.fixture(scope="session")
def make_env(env_cache):
    """``make_env(name)``: a built-in environment whose disk cache (if it has one) is `env_cache`."""

    def build(name: str, **options):
        if "cache_dir" in envs.options(name):
            options.setdefault("cache_dir", str(env_cache / name))
        return envs.make(name, **options)

    return build


@pytest.fixture
def row_attention_calls(monkeypatch) -> list[tuple[int, int]]:
    """Each `contrail.train.row_attention.row_attention` call's ``(heads, queries)`` (still computed), on a CPU
    taken to have no AMX tiles, so that it applies."""
    from contrail.train import row_attention

    calls, original = [], row_attention.row_attention

    def counted(query, *args):
        calls.append(tuple(query.shape[:2]))
        return original(query, *args)

    monkeypatch.setattr(row_attention, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(row_attention, "row_attention", counted)
    return calls
