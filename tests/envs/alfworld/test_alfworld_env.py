"""ALFWorld on the real engine: generated games, AgentGym's presentation, the expert."""

import json
import random
import re

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("textworld")
pytest.importorskip("fast_downward")

from contrail.envs import make  # noqa: E402
from contrail.envs.alfworld import games  # noqa: E402
from contrail.envs.alfworld.engine import ENGINES  # noqa: E402
from contrail.envs.alfworld.env import NOTHING_HAPPENED, to_agentgym, to_engine  # noqa: E402
from contrail.envs.alfworld.expert import parse_goal  # noqa: E402
from contrail.envs.base import Task  # noqa: E402
from contrail.envs.parsing import last_action  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("alfworld-games"))


@pytest.fixture(scope="module")
def env(cache_dir):
    return make("alfworld", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def one_task_per_type(env):
    """The first test task of each of the six types (test ids cycle through the types)."""
    tasks = env.tasks("test")[:6]
    assert sorted(env.task_type(t) for t in tasks) == sorted(games.TASK_TYPES)
    return {env.task_type(t): t for t in tasks}


def play_expert(env, task, rewrite=lambda action: action):
    """Play ``task`` with the expert; ``rewrite`` may change each action line. Returns the steps."""
    env.reset(task)
    steps = []
    for _ in range(env.max_turns):
        text = env.expert()
        action = last_action(text)
        steps.append(env.step(text.replace(f"Action: {action}", f"Action: {rewrite(action)}")))
        if steps[-1].done:
            break
    return steps


# --- tasks ----------------------------------------------------------------------------


def test_task_ids_are_deterministic_and_splits_disjoint(env, cache_dir):
    other = make("alfworld", cache_dir=cache_dir)
    train, test = env.tasks("train"), env.tasks("test")
    assert [t.id for t in train] == [t.id for t in other.tasks("train")]
    assert not {t.id for t in train} & {t.id for t in test}
    for task_type in games.TASK_TYPES:
        assert sum(env.task_type(t) == task_type for t in train) >= 200
        assert sum(env.task_type(t) == task_type for t in test) >= 24
    # Test games come from floor plans no train game uses (ALFRED's unseen scenes).
    assert not set(games.scene_numbers("train")) & set(games.scene_numbers("test"))


def test_difficulty_is_the_task_type(env):
    easy, hard = env.tasks("test", "easy"), env.tasks("test", "hard")
    assert {env.task_type(t) for t in easy} == {"pick_and_place_simple", "look_at_obj_in_light"}
    assert {env.task_type(t) for t in hard} == set(games.TASK_TYPES) - set(games.EASY_TYPES)
    assert len(easy) + len(hard) == len(env.tasks("test"))
    with pytest.raises(ValueError, match="difficulty"):
        env.tasks("test", "medium")


def test_generated_games_are_deterministic_and_in_tw_pddl_format():
    spec = games.game_spec("pick_two_obj_and_place", "train", 7)
    game = games.generate_game(spec)
    assert game == games.generate_game(spec)
    assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
    assert "UNKNOWN GOAL" not in game["grammar"]
    assert parse_goal(game["pddl_problem"]).task_type == "pick_two_obj_and_place"
    other = games.generate_game(games.game_spec("pick_two_obj_and_place", "train", 8))
    assert other["pddl_problem"] != game["pddl_problem"]


# --- observations -----------------------------------------------------------------------


def test_first_observation_is_room_task_and_actions(env, one_task_per_type):
    observation = env.reset(one_task_per_type["pick_and_place_simple"])
    room, task, actions = observation.split("\n")
    assert room.startswith("You are in the middle of a room. Looking quickly around you, you see a ")
    assert re.fullmatch(r"Your task is to: put (a|some) \w+ (in|on) \w+\.", task)
    assert actions.startswith("AVAILABLE ACTIONS: go to ")
    assert "look" in actions.split(": ", 1)[1].split(",")
    assert "Welcome" not in observation


def test_later_observations_are_feedback_only(env, one_task_per_type):
    env.reset(one_task_per_type["pick_clean_then_place_in_recep"])
    step = env.step(env.expert())
    assert step.valid and not step.done
    assert "AVAILABLE ACTIONS" not in step.observation
    assert not step.observation.startswith("You arrive at")
    assert re.match(r"(On the|The) \w+ \d+", step.observation)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I think I should look around.",
        "Action:",
        "Action: fly to the moon",
        "Thought: the fridge.\nAction: go to fridge 99",
        "Action: take apple 1 from countertop 1",  # nothing is held yet, but nothing is here either
    ],
)
def test_malformed_output_is_nothing_happened(env, one_task_per_type, text):
    env.reset(one_task_per_type["pick_and_place_simple"])
    step = env.step(text)
    assert (step.observation, step.reward, step.done, step.valid) == (NOTHING_HAPPENED, 0.0, False, False)
    assert env.step(env.expert()).valid  # the episode goes on


def test_last_action_line_is_used(env, one_task_per_type):
    env.reset(one_task_per_type["pick_and_place_simple"])
    expert = last_action(env.expert())
    assert env.step(f"Action: fly away\nThought: no.\nAction: {expert}").valid
    # The layout AgentGym's instruction asks for: each field's content on its own line.
    following = last_action(env.expert())
    assert env.step(f"Thought:\nI know where to go.\n\nAction:\n{following}").valid


# --- actions ---------------------------------------------------------------------------


def test_action_translation_between_grammars():
    assert to_engine("put apple 1 in/on fridge 1") == "move apple 1 to fridge 1"
    assert to_engine("Put apple 1 in fridge 1.") == "move apple 1 to fridge 1"
    assert to_engine("put  apple 1 on countertop 1") == "move apple 1 to countertop 1"
    assert to_engine("move apple 1 to fridge 1") == "move apple 1 to fridge 1"
    assert to_engine("go to cabinet 2") == "go to cabinet 2"
    assert to_agentgym("move apple 1 to fridge 1") == "put apple 1 in/on fridge 1"


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda action: action,  # put X in/on Y (alfworld 0.3.3, as AgentGym shows it)
        lambda action: re.sub(r"^put (.+) in/on (.+)$", r"move \1 to \2", action),  # alfworld 0.4
        lambda action: re.sub(r"^put (.+) in/on (.+)$", r"put \1 in \2", action),
        lambda action: re.sub(r"^put (.+) in/on (.+)$", r"put \1 on \2", action),
    ],
    ids=["put-in/on", "move-to", "put-in", "put-on"],
)
def test_both_grammars_solve(env, one_task_per_type, rewrite):
    steps = play_expert(env, one_task_per_type["pick_and_place_simple"], rewrite)
    assert all(step.valid for step in steps)
    assert steps[-1].done and steps[-1].success and steps[-1].reward == 1.0


@pytest.mark.parametrize("task_type", games.TASK_TYPES)
def test_expert_solves_each_task_type(env, one_task_per_type, task_type):
    steps = play_expert(env, one_task_per_type[task_type])
    assert [s.reward for s in steps[:-1]] == [0.0] * (len(steps) - 1)
    assert steps[-1].done and steps[-1].success and steps[-1].reward == 1.0


def test_expert_text_format(env, one_task_per_type):
    env.reset(one_task_per_type["look_at_obj_in_light"])
    thought, action = env.expert().split("\n")
    assert thought.startswith("Thought: ") and len(thought) > len("Thought: ") + 5
    assert action.startswith("Action: go to ")


def test_expert_recovers_after_a_detour(env, one_task_per_type):
    task = one_task_per_type["pick_heat_then_place_in_recep"]
    env.reset(task)
    env.step("Action: go to sinkbasin 1")
    env.step("Action: inventory")
    for _ in range(env.max_turns):
        step = env.step(env.expert())
        if step.done:
            break
    assert step.success


def test_random_actions_are_admissible(env, one_task_per_type):
    env.reset(one_task_per_type["look_at_obj_in_light"])
    rng = random.Random(3)
    for _ in range(5):
        step = env.step(env.random_action(rng))
        assert step.valid
        if step.done:
            break


# --- episode life ------------------------------------------------------------------------


def test_step_before_reset_and_after_done_raise(cache_dir, one_task_per_type):
    fresh = make("alfworld", cache_dir=cache_dir)
    with pytest.raises(RuntimeError):
        fresh.step("Action: look")
    task = one_task_per_type["pick_and_place_simple"]
    assert play_expert(fresh, task)[-1].done
    with pytest.raises(RuntimeError):
        fresh.step("Action: look")
    assert fresh.reset(task).startswith("You are in the middle of a room.")  # reset after done works
    assert fresh.step("Action: look").valid


def test_engine_failure_fails_the_episode_not_the_process(env, one_task_per_type):
    task = one_task_per_type["pick_and_place_simple"]
    env.reset(task)

    def broken(command):
        raise RuntimeError("fast-downward crashed")

    env._engine.step = broken
    step = env.step(env.expert())
    assert (step.done, step.reward, step.success) == (True, 0.0, False)
    assert "fast-downward crashed" in step.info["error"]
    with pytest.raises(RuntimeError):
        env.step("Action: look")
    assert play_expert(env, task)[-1].success  # a fresh engine plays the next episode


def test_engines_are_reused_across_episodes(cache_dir, one_task_per_type):
    task = one_task_per_type["pick_and_place_simple"]
    envs = [make("alfworld", cache_dir=cache_dir) for _ in range(2)]
    for each in envs:
        each.reset(task)
    for each in envs:
        each.close()
    created = ENGINES.created
    for _ in range(3):
        for each in envs:
            each.reset(task)
            each.step("Action: look")
    del envs  # collected episodes give their engines back too
    assert ENGINES.created == created


# --- real game files ------------------------------------------------------------------------


def test_real_game_files_load_through_the_same_class(tmp_path):
    """A directory in ALFWorld's json_2.1.1 layout, with game files as alfworld-generate writes them."""
    layout = {
        "train/pick_and_place_simple-Apple-None-Fridge-7/trial_T1": ("pick_and_place_simple", "train", 0),
        "valid_unseen/pick_cool_then_place_in_recep-Apple-None-CounterTop-1/trial_T2": (
            "pick_cool_then_place_in_recep",
            "test",
            0,
        ),
        "valid_seen/pick_and_place_with_movable_recep-Apple-Bowl-Fridge-7/trial_T3": (
            "pick_and_place_simple",
            "train",
            1,
        ),
    }
    for folder, (task_type, split, index) in layout.items():
        path = tmp_path / folder / "game.tw-pddl"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(games.generate_game(games.game_spec(task_type, split, index))))
    real = make("alfworld", game_dir=str(tmp_path))
    train, test = real.tasks("train"), real.tasks("test")
    assert len(train) == 1 and len(test) == 1  # movable-receptacle games are skipped, as AlfredTWEnv does
    assert real.task_type(test[0]) == "pick_cool_then_place_in_recep"
    assert test[0].difficulty == "hard"
    steps = play_expert(real, test[0])
    assert steps[-1].success
    unseen = [str(p) for p in tmp_path.rglob("valid_unseen/**/game.tw-pddl")]
    listed = make("alfworld", game_files={"train": [], "test": unseen})
    assert [t.id for t in listed.tasks("test")] == [t.id for t in test]
    assert isinstance(listed.tasks("test")[0], Task)


def test_a_game_that_cannot_start_fails_its_episode(tmp_path, cache_dir):
    broken = tmp_path / "valid_unseen" / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T1" / "game.tw-pddl"
    broken.parent.mkdir(parents=True)
    game = games.generate_game(games.game_spec("pick_and_place_simple", "test", 0))
    # A duplicate object: fast-downward's translator reports it and calls sys.exit.
    problem = game["pddl_problem"].replace("agent1 - agent", "agent1 - agent\n        agent1 - agent")
    broken.write_text(json.dumps({**game, "pddl_problem": problem}))
    real = make("alfworld", game_files=[str(broken)])
    task = real.tasks("test")[0]
    assert "could not be started" in real.reset(task)
    step = real.step("Action: look")
    assert step.done and step.reward == 0.0 and "error" in step.info
    healthy = make("alfworld", cache_dir=cache_dir)
    assert healthy.reset(healthy.tasks("test")[0]).startswith("You are in the middle of a room.")


def test_interleaved_episodes_of_one_game_do_not_interfere(cache_dir, one_task_per_type):
    """A GRPO group plays one game in many live episodes, stepped in turn."""
    task = one_task_per_type["pick_two_obj_and_place"]
    group = [make("alfworld", cache_dir=cache_dir) for _ in range(2)]
    first = [each.reset(task) for each in group]
    assert first[0] == first[1]
    group[1].step(group[1].random_action(random.Random(0)))  # the second episode takes a detour
    results = [None, None]
    for _ in range(group[0].max_turns):
        for i, each in enumerate(group):
            if results[i] is None:
                step = each.step(each.expert())
                if step.done:
                    results[i] = step.success
    assert results == [True, True]


def test_games_in_the_0_3_3_grammar_accept_both_forms(tmp_path):
    """Real games written for alfworld 0.3.3 carry a grammar whose put command is ``put X in/on Y``."""
    game = games.generate_game(games.game_spec("pick_and_place_simple", "test", 1))
    old_grammar = game["grammar"].replace('template :: "move {o} to {r}"', 'template :: "put {o} in/on {r}"')
    assert old_grammar != game["grammar"]
    path = tmp_path / "game.tw-pddl"
    path.write_text(json.dumps({**game, "grammar": old_grammar}))
    for rewrite in (lambda a: a, lambda a: re.sub(r"^put (.+) in/on (.+)$", r"move \1 to \2", a)):
        old = make("alfworld", game_files=[str(path)])
        assert play_expert(old, old.tasks("test")[0], rewrite)[-1].success


def test_textworld_intern_table_is_emptied_between_games(env, one_task_per_type, monkeypatch):
    """textworld interns every proposition forever; the engine empties that table once it is large."""
    import mementos.core
    from textworld.logic import Proposition

    from contrail.envs.alfworld import engine

    def interned_names():
        return {
            argument.name
            for value in list(mementos.core._memento_cache.values())
            if isinstance(value, Proposition)
            for argument in value.arguments
            if "_bar_" in argument.name  # THOR ids: unique to a floor plan
        }

    monkeypatch.setattr(engine, "_INTERNED_LIMIT", 1)
    env.reset(one_task_per_type["pick_and_place_simple"])  # a kitchen
    kitchen = interned_names()
    env.reset(one_task_per_type["look_at_obj_in_light"])  # a living room or bedroom
    assert kitchen and not kitchen & interned_names()
