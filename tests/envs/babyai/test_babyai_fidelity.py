"""BabyAI's observations are AgentGym's, byte for byte.

``agentgym_observations.json`` holds what AgentGym's own BabyAI server
(``agentenv-babyai``) printed on this minigrid: the first observation of every
test id of seeds 0-9 (all 40 levels, 400 ids), and the observations after a
seeded script's actions (valid ones, ones the menu explains as impossible, an
unknown one) for every level on seeds 0-1 and wherever a rare message came up.
contrail replays the same actions and must print the same text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contrail.envs import Task, make
from contrail.envs.babyai.env import DONE_MESSAGE, FAILED_MESSAGE
from contrail.envs.babyai.levels import LEVELS, goal_text, task_difficulty

FIXTURE = json.loads((Path(__file__).parent / "agentgym_observations.json").read_text())
EPISODES = FIXTURE["episodes"]


def task(task_id: int) -> Task:
    return Task("babyai", task_id, "test", task_difficulty(task_id))


def expected_step(step: dict) -> str:
    """AgentGym's observation, or contrail's deliberate wording of a failed mission.

    AgentGym prints "The task is completed." when minigrid ends an episode
    with a failure (and plays on); contrail ends it with "The task has failed.".
    """
    if step["status"] == "failure":
        return step["observation"].replace(f"\n{DONE_MESSAGE}\n", f"\n{FAILED_MESSAGE}\n", 1)
    return step["observation"]


def first_line_difference(want: str, got: str) -> str:
    for want_line, got_line in zip(want.splitlines(), got.splitlines()):
        if want_line != got_line:
            return f"AgentGym: {want_line!r}\ncontrail: {got_line!r}"
    return f"AgentGym: {want!r}\ncontrail: {got!r}"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path))


def test_the_reference_covers_every_level_first_and_later():
    assert {episode["level"] for episode in EPISODES} == set(LEVELS)
    assert {episode["level"] for episode in EPISODES if episode["steps"]} == set(LEVELS)
    assert len(EPISODES) == 400 and sum(len(episode["steps"]) for episode in EPISODES) > 800


def test_first_observations_are_agentgyms():
    env = make("babyai")
    different = []
    for episode in EPISODES:
        got = env.reset(task(episode["id"]))
        if got != episode["first"]:
            different.append((episode["id"], first_line_difference(episode["first"], got)))
    identical = len(EPISODES) - len(different)
    print(f"BabyAI first observations identical to AgentGym's: {identical} of {len(EPISODES)}")
    assert not different, (
        f"{identical} of {len(EPISODES)} identical; first difference, id {different[0][0]}:\n{different[0][1]}"
    )


def test_first_macros_expand_to_agentgyms_primitive_moves():
    """Same text is not enough: a macro's route decides where a blocked path stops and the step count."""
    env = make("babyai")
    different = []
    for episode in EPISODES:
        env.reset(task(episode["id"]))
        want = {action: tuple(int(p) for p in moves.split()) for action, moves in episode["first_macros"].items()}
        if env.macros() != want:
            different.append(episode["id"])
    same = len(EPISODES) - len(different)
    assert not different, f"{same} of {len(EPISODES)} menus expand identically; differ: {different[:10]}"


def test_later_observations_are_agentgyms():
    env = make("babyai", max_turns=100)
    compared, different = 0, []
    for episode in EPISODES:
        if not episode["steps"]:
            continue
        env.reset(task(episode["id"]))
        for turn, step in enumerate(episode["steps"]):
            if step["status"] == "truncated":
                break  # contrail ends the episode with its own message (none in the reference)
            result = env.step(f"Thought: I act.\nAction: {step['action']}")
            compared += 1
            want = expected_step(step)
            if result.observation != want:
                different.append((episode["id"], turn, step["action"], first_line_difference(want, result.observation)))
                break  # the episodes part ways here
            # The same primitive moves, not just the same place: the reward counts them.
            assert result.info["primitive_steps"] == step["primitive_steps"], (episode["id"], turn, step["action"])
            assert result.done == (step["status"] != "ok"), (episode["id"], turn)
    identical = compared - len(different)
    print(f"BabyAI later observations identical to AgentGym's: {identical} of {compared}")
    assert not different, "{} of {} identical; first difference, id {} turn {} ({!r}):\n{}".format(
        identical, compared, *different[0]
    )


def test_a_solved_step_ends_with_agentgyms_message():
    solved = [step for episode in EPISODES for step in episode["steps"] if step["status"] == "success"]
    assert solved and all(f"\n{DONE_MESSAGE}\nAvailable actions: " in step["observation"] for step in solved)


# --- the rules, on hand-checked cases ------------------------------------------------------


def test_goal_reads_and_for_then_and_after_you():
    assert goal_text("open the red door, then open the blue door") == "open the red door, and open the blue door"
    assert goal_text("pick up a key after you open a door") == "pick up a key and open a door"
    first = make("babyai").reset(task(36))  # SynthSeq: minigrid says "... after you pick up a key ..."
    assert first.startswith("Your goal: put the red box next to a grey door and open a purple door and pick up a key")


def test_facing_sentence_names_a_wall_or_box_by_type_and_is_absent_behind_a_closed_door():
    env = make("babyai")
    box = env.reset(task(10))  # GoToObjDoor: a purple box two cells ahead
    assert "There is a purple box 1 right in front of you 2 steps away." in box
    assert "You are facing a box 2 steps away." in box
    door = env.reset(task(23))  # Unlock: a closed door two cells ahead hides the wall behind it
    assert "There is a grey closed door 1 right in front of you 2 steps away." in door
    assert "You are facing" not in door


def test_spacing_is_agentgyms():
    first = make("babyai").reset(task(10))
    assert "2 steps away.  There is a purple key 1" in first  # two spaces between objects
    assert "steps to your right.  The room has walls around you. " in first
    walls_only = make("babyai").reset(task(25))  # KeyInBox seed 0: only walls in view
    assert "several objects: The room has walls around you. You are facing a wall 4 steps away." in walls_only


def test_a_carried_start_object_still_shows_on_the_floor_at_first():
    """PutNextS7N4Carrying hands the agent its object after minigrid's first observation."""
    first = make("babyai").reset(task(22))
    assert "You are carrying a yellow box." in first
    assert "There is a yellow box 1 2 steps in front of you and 1 steps to your left." in first
    assert '"go to yellow box 1"' in first and '"drop"' in first
