"""The base `Env` lifecycle, the registry and declared options (contrail.envs.base)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import contrail.envs as envs
from contrail.envs import (
    Env,
    EnvOptionError,
    EpisodeOver,
    Step,
    Task,
    UnknownNameError,
    base,
)
from contrail.testing import MagicWordEnv


def easy_task(env: Env) -> Task:
    return env.tasks("test", "easy")[0]


# --- Step --------------------------------------------------------------------------------


def test_step_is_keyword_only():
    with pytest.raises(TypeError):
        Step("ok", 1.0, True)  # positional fields are how a reward lands in `done`
    step = Step(observation="ok")
    assert (step.reward, step.done, step.success, step.valid, step.info) == (0.0, False, False, True, {})


# --- the lifecycle -----------------------------------------------------------------------


def test_step_before_reset_is_a_runtime_error_that_says_reset():
    with pytest.raises(RuntimeError, match=r"reset\(task\)") as raised:
        MagicWordEnv().step("apple")
    assert not isinstance(raised.value, EpisodeOver)


def test_the_base_counts_turns_and_ends_the_episode_at_the_turn_limit():
    env = MagicWordEnv()  # 3 turns on easy tasks
    env.reset(easy_task(env))
    steps = [env.step(word) for word in ("grape", "lemon", "mango")]
    assert [s.done for s in steps] == [False, False, True] and env.turns == 3 and env.done
    assert steps[-1].info == {"turn_limit": True} and not steps[-1].success
    with pytest.raises(EpisodeOver, match="over after 3 turns"):
        env.step("apple")


def test_a_done_step_ends_the_episode_and_reset_starts_a_new_one():
    env = MagicWordEnv()
    task = easy_task(env)
    env.reset(task)
    assert env.step("apple").success and env.done
    with pytest.raises(EpisodeOver):
        env.step("apple")
    assert env.reset(task) == "what is your word ?" and env.turns == 0 and not env.done
    assert env.step("apple").success


def test_reset_can_set_the_turn_limit_of_one_episode():
    env = MagicWordEnv()
    task = env.tasks("test", "hard")[0]  # its own limit: 1 turn
    env.reset(task, turn_limit=2)
    assert env.episode_turn_limit == 2 and not env.step("grape").done and env.step("grape").done
    env.reset(task)
    assert env.episode_turn_limit == 1 and env.step("grape").done
    with pytest.raises(ValueError, match="turn_limit"):
        env.reset(task, turn_limit=0)


def test_bytes_are_decoded_and_other_types_refused():
    env = MagicWordEnv()
    env.reset(easy_task(env))
    assert env.step(b"apple").success
    env.reset(easy_task(env))
    assert not env.step(b"\xff\xfe grape").done  # undecodable bytes are replaced, never raised
    for value in (None, 42, ["apple"]):
        with pytest.raises(TypeError, match="str or bytes"):
            env.step(value)
    assert env.turns == 1  # a refused value is not a turn


def test_reset_checks_the_task():
    env = MagicWordEnv()
    with pytest.raises(TypeError):
        env.reset({"env": "magic", "id": 0})
    with pytest.raises(ValueError, match="textcraft"):
        env.reset(Task(env="textcraft", id=0, split="test", difficulty="easy"))


def test_a_failed_reset_leaves_no_episode_to_step():
    class Broken(MagicWordEnv):
        def on_reset(self, task):
            raise OSError("no game file")

    env = Broken()
    with pytest.raises(OSError):
        env.reset(easy_task(env))
    with pytest.raises(RuntimeError, match="reset"):
        env.step("apple")


def test_on_step_must_return_a_step():
    class Wrong(MagicWordEnv):
        def on_step(self, text):
            return "right"

    env = Wrong()
    env.reset(easy_task(env))
    with pytest.raises(TypeError, match="not a Step"):
        env.step("apple")


def test_max_turns_must_be_a_positive_int():
    with pytest.raises(EnvOptionError, match="max_turns"):
        MagicWordEnv(max_turns=0)


# --- the registry ----------------------------------------------------------------------------


def test_register_sets_the_name_and_make_builds_it(stand_in_env):
    assert stand_in_env.name.startswith("stand-in-") and stand_in_env.name in envs.names()
    env = envs.make(stand_in_env.name, max_turns=5)
    assert isinstance(env, stand_in_env) and env.max_turns == 5
    assert env.tasks("test")[0].env == stand_in_env.name


def test_register_refuses_a_taken_name(stand_in_env):
    other = type("Other", (MagicWordEnv,), {})
    with pytest.raises(ValueError, match=f"'{stand_in_env.name}' is already registered"):
        envs.register(stand_in_env.name)(other)
    envs.register(stand_in_env.name)(stand_in_env)  # the same class again is no conflict
    assert envs.env_class(stand_in_env.name) is stand_in_env


def test_register_refuses_built_in_names_and_a_second_name_for_one_class(stand_in_env):
    with pytest.raises(ValueError, match="reserved for the built-in"):
        envs.register("textcraft")(type("Fake", (MagicWordEnv,), {}))
    with pytest.raises(ValueError, match="already registered as"):
        envs.register("another-name")(stand_in_env)
    for bad in ("", "a:b", " padded"):
        with pytest.raises(ValueError, match="environment name"):
            envs.register(bad)


def test_unregister_and_registered_remove_the_name():
    cls = type("Temporary", (MagicWordEnv,), {})
    with envs.registered("temporary-env", cls):
        assert envs.env_class("temporary-env") is cls
    assert "temporary-env" not in envs.names()
    with pytest.raises(UnknownNameError, match="not registered"):
        envs.unregister("temporary-env")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(UnknownNameError, match=r"unknown environment 'bogus'; valid: .*babyai.*textcraft"):
        envs.make("bogus")
    with pytest.raises(UnknownNameError, match="unknown difficulty 'medium' for textcraft; valid: easy, hard"):
        envs.parse_spec("textcraft:medium")


@pytest.fixture
def user_module(monkeypatch):
    """A user's module ``my_pkg.envs`` holding an unregistered environment class."""
    module = types.ModuleType("my_pkg.envs")

    class EchoEnv(MagicWordEnv):
        pass

    EchoEnv.__module__ = "my_pkg.envs"
    module.EchoEnv = EchoEnv
    module.NotAnEnv = dict
    monkeypatch.setitem(sys.modules, "my_pkg.envs", module)
    yield EchoEnv
    if "my_pkg.envs:EchoEnv" in base._REGISTRY:
        envs.unregister("my_pkg.envs:EchoEnv")


def test_a_class_path_loads_a_user_class(user_module):
    assert envs.env_class("my_pkg.envs:EchoEnv") is user_module
    assert user_module.name == "my_pkg.envs:EchoEnv"  # so make(task.env) finds it again
    env = envs.make("my_pkg.envs:EchoEnv")
    assert envs.make(env.tasks("test")[0].env).__class__ is user_module
    assert envs.parse_spec("my_pkg.envs:EchoEnv:hard") == ("my_pkg.envs:EchoEnv", "hard")
    with pytest.raises(UnknownNameError, match="no Env subclass named 'NotAnEnv'"):
        envs.env_class("my_pkg.envs:NotAnEnv")
    with pytest.raises(UnknownNameError, match="cannot import module 'no_such_module.sub'"):
        envs.env_class("no_such_module.sub:Env")


def test_entry_points_register_under_their_name(monkeypatch):
    cls = type("Plugged", (MagicWordEnv,), {})

    class Entry:
        name = "plugged-env"

        def load(self):
            return cls

    monkeypatch.setattr(base.metadata, "entry_points", lambda group: [Entry()] if group == "contrail.envs" else [])
    try:
        assert "plugged-env" in envs.names() and envs.env_class("plugged-env") is cls
        assert cls.name == "plugged-env"
    finally:
        envs.unregister("plugged-env")


# --- declared options ------------------------------------------------------------------------


class OptionsEnv(MagicWordEnv):
    def __init__(
        self,
        max_turns: int | None = None,
        rate: float = 0.5,
        verbose: bool = False,
        label: str = "x",
        data_dir: str | Path | None = None,
        sizes: list[int] | None = None,
    ) -> None:
        super().__init__(max_turns)


@pytest.fixture
def options_env():
    with envs.registered("options-env", OptionsEnv):
        yield "options-env"


def test_options_are_the_constructor_keywords(options_env):
    assert envs.options(options_env) == ["max_turns", "rate", "verbose", "label", "data_dir", "sizes"]
    assert envs.options("textcraft") == ["max_turns", "data_dir", "max_distractors", "filter_train"]


@pytest.mark.parametrize("options", [
    {}, {"max_turns": 3}, {"max_turns": None}, {"rate": 1}, {"rate": 0.25}, {"verbose": True},
    {"label": "y"}, {"data_dir": "/tmp"}, {"data_dir": Path("/tmp")}, {"sizes": [1, 2]},
])
def test_valid_options_pass(options_env, options):
    assert envs.check_options(options_env, options) == options


def test_an_unknown_option_lists_the_valid_ones(options_env):
    with pytest.raises(EnvOptionError, match=(
        "^unknown option 'bogus' for options-env; valid: max_turns, rate, verbose, label, data_dir, sizes$"
    )):
        envs.check_options(options_env, {"bogus": 1})
    with pytest.raises(EnvOptionError, match="^unknown option 'bogus_option' for textcraft; valid: max_turns"):
        envs.make("textcraft", bogus_option=1)


@pytest.mark.parametrize("key, value, expected", [
    ("max_turns", "abc", "int or None"), ("max_turns", 2.5, "int or None"), ("max_turns", True, "int or None"),
    ("rate", "fast", "float"), ("verbose", 1, "bool"), ("label", 3, "str"),
    ("data_dir", 7, "path or None"), ("sizes", ["a"], "list or None"),
])
def test_a_mistyped_option_names_the_expected_type(options_env, key, value, expected):
    with pytest.raises(EnvOptionError, match=f"^option {key} of options-env: expected {expected}, got "):
        envs.check_options(options_env, {key: value})


def test_make_checks_options_before_building():
    with pytest.raises(EnvOptionError, match="^option max_turns of textcraft: expected int or None, got 'abc'$"):
        envs.make("textcraft", max_turns="abc")


BUILT_INS = ["textcraft", "alfworld", "webshop", "searchqa", "babyai"]


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_built_in_option_is_annotated(name):
    declared = envs.options(name)
    assert declared[0] == "max_turns"
    hints = base.declared_options(envs.env_class(name))
    assert all(hint is not base.Any for hint in hints.values()), hints
