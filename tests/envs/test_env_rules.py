"""One set of lifecycle rules in every environment, kept by the base class.

Before the redesign, a step after the end raised in three environments and
returned an observation in two, and ``step(b"...")`` raised in three.
"""

from __future__ import annotations

import pytest

from contrail.envs import EpisodeOver

NAMES = ["babyai", "textcraft", "alfworld", "webshop", "searchqa"]

@pytest.fixture(params=NAMES)
def fresh(request, make_env):
    """``fresh()`` -> (a new environment, its first test task), for the parametrized name."""

    def build():
        env = make_env(request.param)
        return env, env.tasks("test")[0]

    return build

def test_step_before_reset_is_a_runtime_error(fresh):
    env, _ = fresh()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Action: inventory")

def test_the_turn_limit_ends_the_episode_then_step_and_expert_raise_episode_over(fresh):
    env, task = fresh()
    env.reset(task, turn_limit=2)
    first, last = env.step("not an action"), env.step("not an action")
    assert not first.done and last.done and last.info["turn_limit"] and env.done and env.turns == 2
    with pytest.raises(EpisodeOver):
        env.step("not an action")
    with pytest.raises(EpisodeOver):
        env.expert()

def test_a_finished_episode_refuses_further_steps(fresh):
    env, task = fresh()
    env.reset(task)
    step = None
    while step is None or not step.done:
        step = env.step(env.expert())
    with pytest.raises(EpisodeOver):
        env.step(env.acknowledgement)
    env.reset(task)  # a new episode plays again
    assert env.turns == 0 and not env.done and not env.step("not an action").done

def test_bytes_are_the_same_text_and_other_types_a_type_error(fresh):
    (one, task), (other, _) = fresh(), fresh()
    one.reset(task)
    other.reset(task)
    for value in (None, 3, ["Action: look"]):
        with pytest.raises(TypeError):
            other.step(value)
    # Undecodable bytes are replaced (U+FFFD): garbage, not an error.
    garbage_bytes, garbage_text = other.step(b"\xff\xfe\x00 garbage"), one.step("\ufffd\ufffd\x00 garbage")
    assert not garbage_bytes.valid and garbage_bytes.observation == garbage_text.observation
    text = one.expert()
    as_text, as_bytes = one.step(text), other.step(text.encode("utf-8"))
    assert (as_bytes.observation, as_bytes.reward, as_bytes.valid) == (
        as_text.observation, as_text.reward, as_text.valid)
