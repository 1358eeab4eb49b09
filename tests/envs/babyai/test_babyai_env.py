"""BabyAI: AgentGym's text interface over minigrid, its tasks, errors, reward and expert."""

from __future__ import annotations

import json
import random

import pytest

from contrail.envs import EpisodeOver, Step, Task, make
from contrail.envs.babyai import BabyAIEnv
from contrail.envs.babyai.actions import NOT_RECOGNIZED as NOT_RECOGNIZED_MESSAGE
from contrail.envs.babyai.levels import (
    LEVELS,
    TRAIN_SEED_START,
    level_difficulty,
    level_number,
    level_seed,
)


def task(task_id: int, split: str = "test") -> Task:
    return Task("babyai", task_id, split, level_difficulty(level_number(task_id)))


def listed_actions(observation: str) -> list[str]:
    line = next(line for line in observation.splitlines() if line.startswith("Available actions: "))
    return json.loads(line[len("Available actions: "):])


def play_expert(env: BabyAIEnv, task_id: int) -> Step:
    env.reset(task(task_id))
    for _ in range(env.max_turns):
        result = env.step(env.expert())
        assert result.valid
        if result.done:
            return result
    return result


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Keep the solvable-task cache of these tests out of the user's home."""
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path))


@pytest.fixture
def env() -> BabyAIEnv:
    return make("babyai")


# --- the conversation and observations ----------------------------------------------------


def test_registered_with_agentgym_settings(env):
    assert isinstance(env, BabyAIEnv)
    assert env.difficulties == ("easy", "hard")
    assert env.max_turns == 20
    assert len(LEVELS) == 40 and LEVELS[0] == "GoToRedBallGrey" and LEVELS[-1] == "BossLevelNoUnlock"


def test_instruction_states_the_actions_and_the_format(env):
    text = env.instruction()
    assert text.startswith("You are an exploration master that wants to finish every goal you are given.")
    for action in ("turn left", "move forward", "go to <obj> <id>", "pick up <obj> <id>", "toggle and go through"):
        assert action in text
    assert "Thought:" in text and "Action:" in text


def test_first_observation_has_goal_description_and_actions(env):
    first = env.reset(task(0))  # level 1, GoToRedBallGrey, seed 0
    assert first.startswith("Your goal: go to the red ball\n")
    assert "There is a red ball 1 " in first
    assert "You are not carrying anything." in first
    actions = listed_actions(first)
    assert actions[:2] == ["turn left", "turn right"]
    assert "check available actions" in actions
    assert any(action.startswith("go to red ball 1") for action in actions)


def test_later_observations_list_actions_but_not_the_goal(env):
    env.reset(task(1))
    for text in ("Thought: look around.\nAction: turn left", "Thought: again.\nAction: turn right"):
        result = env.step(text)
        assert result.valid and not result.done and result.reward == 0.0
        assert "Your goal:" not in result.observation
        assert listed_actions(result.observation)


def test_same_id_gives_the_same_first_observation():
    assert make("babyai").reset(task(93)) == make("babyai").reset(task(93))


def test_check_available_actions_lists_them(env):
    first = env.reset(task(4))
    result = env.step("Action: check available actions")
    assert result.valid and result.observation.startswith("You can take the following actions: turn left, turn right")
    assert listed_actions(result.observation) == listed_actions(first)


def test_pick_up_spelling_of_the_instruction_is_accepted(env):
    first = env.reset(task(16))  # level 17, Pickup
    pickups = [action for action in listed_actions(first) if action.startswith("pickup ")]
    if not pickups:
        pytest.skip("no object in view on this seed")
    result = env.step("Thought: take it.\nAction: pick up " + pickups[0][len("pickup "):])
    assert result.valid and result.info["action"] == pickups[0]


# --- bad output never raises ---------------------------------------------------------------


@pytest.mark.parametrize(
    "output",
    [
        "",
        "asdf qwer zxcv",
        "Thought: I will turn left.",
        "Thought: both.\nAction: turn left\nAction: turn right",
        "Action: " + "x" * 10_000,
        "x" * 10_000,
        "Action: fly to the moon",
        "Action: go to purple ball 9",
        "Action:",
    ],
)
def test_malformed_output_returns_the_error_observation(env, output):
    first = env.reset(task(2))
    result = env.step(output)
    assert result.valid is False and result.reward == 0.0 and not result.done and not result.success
    assert listed_actions(result.observation) == listed_actions(first)
    assert len(result.observation) < 2_000  # the model's text is never echoed back
    assert env.step("Action: turn left").valid  # the episode goes on


def test_actions_are_read_as_agentgym_reads_them(env):
    env.reset(task(0))
    result = env.step("Thought:\nThe ball.\n\nAction:\n**Go to  red ball 1**.")
    assert result.valid and result.info["action"] == "go to red ball 1"


def test_unknown_action_gets_agentgyms_message(env):
    env.reset(task(2))
    assert env.step("Action: fly").observation.startswith(NOT_RECOGNIZED_MESSAGE)


def test_blocked_move_gets_a_specific_message(env):
    env.reset(task(0))
    for _ in range(12):  # walk until the way ahead is blocked
        result = env.step("Action: move forward")
        if not result.valid:
            assert result.observation.startswith("There is a barrier in front of you")
            return
    pytest.fail("the agent never reached a wall")


def test_step_before_reset_or_after_done_raises(env):
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Action: turn left")
    with pytest.raises(RuntimeError, match="reset"):
        env.expert()
    result = play_expert(env, 0)
    assert result.done
    with pytest.raises(EpisodeOver):
        env.step("Action: turn left")
    with pytest.raises(EpisodeOver):
        env.expert()


def test_the_turn_limit_ends_the_episode():
    env = make("babyai", max_turns=2)
    env.reset(task(1))
    assert not env.step("Action: turn left").done
    last = env.step("Action: turn left")
    assert last.done and not last.success and last.info["turn_limit"]


def test_options_are_declared_and_checked():
    with pytest.raises(ValueError, match="unknown option 'bogus' for babyai; valid: max_turns, test_seeds"):
        make("babyai", bogus=1)
    with pytest.raises(ValueError, match="option test_seeds of babyai: expected int"):
        make("babyai", test_seeds="ten")
    with pytest.raises(ValueError, match="test_seeds of babyai"):
        make("babyai", test_seeds=0)


def test_two_actions_in_one_output_get_agentgyms_message(env):
    env.reset(task(2))
    result = env.step("Action: turn left\nAction: turn right")
    assert not result.valid and result.observation.startswith("Error: Only one 'Action' is allowed per response.")


def test_go_to_what_is_already_faced_changes_nothing(env):
    env.reset(task(6))  # GoToObjMazeS7 seed 0
    for action in ("turn left", "turn right", "move forward", "turn right"):
        env.step(f"Action: {action}")
    first = env.step("Action: go to green box 1")
    assert first.valid and first.info["primitive_steps"] > 4
    again = env.step("Action: go to green box 1")
    assert again.valid and again.observation.startswith("No change in state.\nAvailable actions: ")
    assert again.info["primitive_steps"] == first.info["primitive_steps"]


def test_no_action_opens_a_box_so_key_in_box_is_never_a_test_task():
    """AgentGym offers "toggle" only for doors: a KeyInBox key stays in its box."""
    env = make("babyai", test_seeds=1)
    env.reset(task(65))  # KeyInBox, seed 1
    boxes = [a for a in listed_actions(env.step("Action: check available actions").observation) if "box" in a]
    if boxes:
        go = next(a for a in boxes if a.startswith("go to "))
        assert "toggle" not in listed_actions(env.step(f"Action: {go}").observation)
    assert all(level_number(t.id) != LEVELS.index("KeyInBox") + 1 for t in env.tasks("test"))


def test_reset_rejects_foreign_or_mislabelled_tasks(env):
    with pytest.raises(ValueError, match="textcraft"):
        env.reset(Task("textcraft", 0, "test", "easy"))
    with pytest.raises(ValueError, match="hard"):
        env.reset(Task("babyai", 30, "test", "easy"))  # level 31 is hard


# --- tasks ---------------------------------------------------------------------------------


def test_ids_follow_agentgym():
    assert (level_number(0), level_seed(0)) == (1, 0)
    assert (level_number(39), level_seed(39)) == (40, 0)
    assert (level_number(81), level_seed(81)) == (2, 2)
    assert level_difficulty(22) == "easy" and level_difficulty(23) == "hard"


def test_tasks_are_deterministic_disjoint_and_labelled():
    env = make("babyai", test_seeds=1, train_seeds=3)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 3 * 40 and train == make("babyai", test_seeds=1, train_seeds=3).tasks("train")
    assert {t.id for t in train}.isdisjoint({t.id for t in test})
    assert all(level_seed(t.id) >= TRAIN_SEED_START for t in train)
    assert all(t.split == "test" and level_seed(t.id) == 0 for t in test)
    for difficulty in env.difficulties:
        chosen = env.tasks("test", difficulty)
        assert chosen and all(t.difficulty == difficulty == level_difficulty(level_number(t.id)) for t in chosen)
    assert {level_number(t.id) for t in env.tasks("train", "easy")} == set(range(1, 23))
    # The test split keeps what the expert solves: most of each difficulty.
    assert len(env.tasks("test", "easy")) >= 18 and len(env.tasks("test", "hard")) >= 12


def test_unknown_split_or_difficulty_is_a_clear_error(env):
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")
    with pytest.raises(ValueError, match="difficulty"):
        env.tasks("test", "medium")


# --- reward and the expert ----------------------------------------------------------------


@pytest.mark.parametrize(
    "task_id",
    [
        7,  # GoToSeqS5R2
        11,  # Open
        21,  # PutNextLocalS6N4
        22,  # PutNextS7N4Carrying: starts carrying the object to move
        23,  # Unlock: fetch the key, open the locked door
        31,  # KeyCorridorS6R3
        79,  # BossLevelNoUnlock
    ],
)
def test_expert_solves_through_step_with_the_step_scaled_reward(env, task_id):
    result = play_expert(env, task_id)
    assert result.done and result.success
    steps, max_steps = result.info["primitive_steps"], result.info["max_steps"]
    assert 0 < steps < max_steps
    assert result.reward == pytest.approx(1 - 0.9 * steps / max_steps)
    assert "The task is completed." in result.observation


def test_expert_writes_a_short_thought_and_a_listed_action(env):
    first = env.reset(task(3))
    text = env.expert()
    thought, action = text.split("\nAction: ")
    assert thought.startswith("Thought: ") and len(thought) < 200
    assert action in listed_actions(first)


def test_random_action_is_a_listed_valid_action(env):
    observation = env.reset(task(12))
    rng = random.Random(0)
    for _ in range(10):
        text = env.random_action(rng)
        assert text.split("Action: ")[1] in listed_actions(observation)
        result = env.step(text)
        assert result.valid
        if result.done:
            break
        observation = result.observation
