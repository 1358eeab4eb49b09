"""TextCraft: observations, actions, errors, tasks and the expert (offline, CPU, fast)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from contrail.envs import make
from contrail.envs.base import Task
from contrail.envs.parsing import last_action
from contrail.envs.textcraft.env import TextCraftEnv
from contrail.envs.textcraft.recipes import item_id, load_recipe_book, plan_actions

CRAFTING_TABLE = 183  # depth 2: 4 planks (a tag) <- 1 logs
OAK_PLANKS = 70  # depth 1


@pytest.fixture(scope="module")
def env() -> TextCraftEnv:
    return TextCraftEnv()


def act(action: str) -> str:
    return f"Thought: trying.\nAction: {action}"


def start(env: TextCraftEnv, task_id: int) -> str:
    return env.reset(env.task_by_id(task_id))


def play_expert(env: TextCraftEnv, task: Task) -> bool:
    env.reset(task)
    for _ in range(env.turn_limit(task)):
        step = env.step(env.expert())
        assert step.valid, (task, step.observation)
        if step.done:
            return step.success and step.reward == 1.0
    return False


# --- registry and instruction -------------------------------------------------


def test_registered_under_its_name():
    built = make("textcraft", max_turns=12)
    assert isinstance(built, TextCraftEnv)
    assert built.max_turns == 12 and TextCraftEnv.default_max_turns == 30
    assert TextCraftEnv.difficulties == ("easy", "hard")


def test_instruction_names_the_format_and_examples(env):
    text = env.instruction()
    assert "Thought:\nyour thoughts.\n\nAction:\nyour next action" in text
    assert "get 1 lapis lazuli" in text and "craft 1 golden carrot using 8 gold nugget, 1 carrot" in text


# --- first observation ----------------------------------------------------------


def test_first_observation_lists_commands_then_goal(env):
    observation = start(env, CRAFTING_TABLE)
    head, _, tail = observation.partition("\n\n")
    assert head.startswith("Crafting commands:\n")
    assert tail == "Goal: craft crafting table."
    lines = head.splitlines()[1:]
    assert all(line.startswith("craft ") and " using " in line for line in lines)
    assert "craft 1 crafting table using 4 planks" in lines
    # The generic "planks" ingredient brings every kind of planks' recipe.
    assert "craft 4 oak planks using 1 oak logs" in lines and "craft 4 warped planks using 1 warped stems" in lines


def test_every_goal_recipe_line_is_shown_with_at_most_ten_distractors(env):
    book = load_recipe_book()
    for task in env.tasks("test")[::9]:
        lines = env.reset(task).split("\n\n")[0].splitlines()[1:]
        tree = {recipe.command for recipe in book.recipe_tree(env.goal)}
        assert tree <= set(lines), task
        assert len(lines) - len(tree) <= 10
        assert len(lines) == len(set(lines))


def test_same_task_gives_the_same_observation(env):
    task = env.task_by_id(540)
    assert env.reset(task) == env.reset(task) == TextCraftEnv().reset(task)
    assert env.reset(task) != env.reset(env.task_by_id(541))


# --- actions ----------------------------------------------------------------------


def test_get_craft_and_inventory_observations(env):
    start(env, CRAFTING_TABLE)
    assert env.step(act("inventory")).observation == "Inventory: You are not carrying anything."
    got = env.step(act("get 1 oak logs"))
    assert (got.observation, got.valid, got.reward, got.done) == ("Got 1 oak logs", True, 0.0, False)
    crafted = env.step(act("craft 4 oak planks using 1 oak logs"))
    assert crafted.observation == "Crafted 4 minecraft:oak_planks" and crafted.valid and not crafted.done
    assert env.step(act("inventory")).observation == "Inventory: [oak planks] (4) "
    # A specific kind of planks fills the generic "planks" ingredient; crafting the goal ends the episode.
    final = env.step(act("craft 1 crafting table using 4 oak planks"))
    assert final.observation == "Crafted 1 minecraft:crafting_table"
    assert (final.reward, final.done, final.success) == (1.0, True, True)


def test_action_on_the_line_after_action_and_trailing_punctuation(env):
    start(env, OAK_PLANKS)
    assert env.step("Thought:\nI need logs.\n\nAction:\nget 2 oak logs.").observation == "Got 2 oak logs"
    assert env.step(act("look")).observation == "Inventory: [oak logs] (2) "


def test_last_action_line_is_the_one_played(env):
    start(env, OAK_PLANKS)
    step = env.step("Action: get 1 stick\nThought: no, logs.\nAction: get 1 oak logs")
    assert step.observation == "Got 1 oak logs"


def test_get_refuses_craftable_tag_and_unknown_items(env):
    start(env, CRAFTING_TABLE)
    for name in ("oak planks", "planks", "unobtainium"):
        step = env.step(act(f"get 1 {name}"))
        assert step.observation == f"Could not find {name}"
        assert not step.valid and step.reward == 0.0 and step.info["error"] == "not_found"


def test_craft_with_missing_items(env):
    start(env, CRAFTING_TABLE)
    step = env.step(act("craft 4 oak planks using 1 oak logs"))
    assert step.observation == "Could not find enough items to craft minecraft:oak_planks"
    assert not step.valid and step.info["error"] == "not_enough_items"
    # A generic tag is never in the inventory, as in AgentGym.
    env.step(act("get 8 oak planks"))
    step = env.step(act("craft 1 crafting table using 4 planks"))
    assert step.observation == "Could not find enough items to craft minecraft:crafting_table"


def test_craft_counts_must_match_a_recipe_exactly(env):
    start(env, CRAFTING_TABLE)
    env.step(act("get 5 oak logs"))
    for wrong in ("craft 4 oak planks using 2 oak logs", "craft 1 crafting table using 1 oak logs"):
        step = env.step(act(wrong))
        assert step.observation.startswith("Could not find a valid recipe for ItemTagWithCount(")
        assert not step.valid and step.info["error"] == "invalid_recipe"
    assert env.step(act("inventory")).observation == "Inventory: [oak logs] (5) "  # nothing consumed
    # One application per action, whatever output count the agent writes (as AgentGym).
    assert env.step(act("craft 1 oak planks using 1 oak logs")).observation == "Crafted 4 minecraft:oak_planks"
    assert env.inventory == {item_id("oak logs"): 4, item_id("oak planks"): 4}


def test_craft_with_an_extra_ingredient_is_not_a_recipe(env):
    start(env, CRAFTING_TABLE)
    env.step(act("get 1 oak logs"))
    env.step(act("get 1 diamond"))
    step = env.step(act("craft 4 oak planks using 1 oak logs, 1 diamond"))
    assert step.observation.startswith("Could not find a valid recipe for") and not step.valid


def test_wrong_item_format(env):
    start(env, OAK_PLANKS)
    step = env.step(act("craft 4 oak planks using oak logs"))
    assert step.observation == "Wrong item format: oak logs" and not step.valid


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n",
        "asdf qwer zxcv",
        "I will get some logs.",
        "Action:",
        "Action: dance",
        "Action: Inventory",
        "Action: get oak logs",
        "Action: get 1 " + "9" * 10_000,
        "Action: get " + "9" * 10_000 + " oak logs",
        "Action: craft " + "9" * 10_000 + " oak planks using 1 oak logs",
        "x" * 10_000,
        "Action: " + "craft " * 2_000,
        "Action: 🙂 ∑ \x00",
    ],
)
def test_malformed_output_never_raises(env, text):
    start(env, OAK_PLANKS)
    step = env.step(text)
    assert isinstance(step.observation, str) and step.observation
    assert len(step.observation) < 400  # a long action is not echoed whole
    assert (step.valid, step.reward, step.done, step.success) == (False, 0.0, False, False)
    assert env.step(act("get 1 oak logs")).valid  # the episode goes on


def test_no_action_line_is_reported(env):
    start(env, OAK_PLANKS)
    step = env.step("Thought: hmm")
    assert step.observation.startswith("Could not execute") and step.info["error"] == "no_action"


def test_step_before_reset_and_after_done_raise():
    fresh = TextCraftEnv()
    with pytest.raises(RuntimeError, match="reset"):
        fresh.step(act("inventory"))
    with pytest.raises(RuntimeError, match="reset"):
        fresh.expert()
    start(fresh, OAK_PLANKS)
    fresh.step(act("get 1 oak logs"))
    assert fresh.step(act("craft 4 oak planks using 1 oak logs")).done
    with pytest.raises(RuntimeError, match="over"):
        fresh.step(act("inventory"))


# --- tasks ------------------------------------------------------------------------


def test_train_and_test_are_disjoint_and_cover_every_goal(env):
    train = {task.id for task in env.tasks("train")}
    test = {task.id for task in env.tasks("test")}
    assert not train & test
    assert train | test == set(range(544))
    assert 0.15 < len(test) / 544 < 0.25
    assert env.tasks("test") == TextCraftEnv().tasks("test")
    assert all(task.split == "test" and task.env == "textcraft" for task in env.tasks("test"))


def test_difficulty_is_crafting_depth_with_agentgym_boundaries(env):
    depths = [env.goal_depth(env.task_by_id(task_id)) for task_id in range(544)]
    assert depths == sorted(depths)
    assert Counter(depths) == {1: 125, 2: 291, 3: 117, 4: 11}
    assert (depths[124], depths[125], depths[415], depths[416], depths[532], depths[533]) == (1, 2, 2, 3, 3, 4)
    for split in ("train", "test"):
        easy, hard = env.tasks(split, "easy"), env.tasks(split, "hard")
        assert easy and hard
        assert all(task.id <= 415 and task.difficulty == "easy" for task in easy)
        assert all(task.id >= 416 and task.difficulty == "hard" for task in hard)
        assert len(easy) + len(hard) == len(env.tasks(split))
    assert any(task.id >= 533 for task in env.tasks("test", "hard"))  # depth 4 is tested too


def test_unknown_split_or_difficulty_or_task_raises(env):
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")
    with pytest.raises(ValueError, match="difficulty"):
        env.tasks("test", "medium")
    with pytest.raises(ValueError):
        env.reset(Task("textcraft", 544, "test", "hard"))
    with pytest.raises(ValueError):
        env.reset(Task("babyai", 1, "test", "easy"))


# --- expert and baseline ------------------------------------------------------------


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_expert_solves_test_tasks_of_each_difficulty(env, difficulty):
    tasks = env.tasks("test", difficulty)
    solved = sum(play_expert(env, task) for task in tasks)
    assert solved / len(tasks) >= 0.95


def test_under_a_short_turn_limit_the_test_split_keeps_what_the_expert_finishes_in_time(env):
    short = TextCraftEnv(max_turns=3)
    kept = short.tasks("test", "easy")
    every = env.tasks("test", "easy")
    assert 0 < len(kept) < len(every)  # the default limit keeps every test task; 3 turns only some
    assert all(play_expert(short, task) for task in kept)  # each finished within its 3 turns
    dropped = [task for task in every if task not in kept]
    assert all(short.expert_turns(task) > 3 for task in dropped)
    assert not play_expert(short, dropped[0])  # and a dropped one really cannot be finished in time


def test_filter_train_applies_the_turn_limit_to_the_train_split(env):
    assert TextCraftEnv(max_turns=3).tasks("train", "easy") == env.tasks("train", "easy")  # unfiltered by default
    kept = TextCraftEnv(max_turns=3, filter_train=True).tasks("train", "easy")
    assert 0 < len(kept) < len(env.tasks("train", "easy"))
    assert all(env.expert_turns(task) <= 3 for task in kept)
    with pytest.raises(ValueError, match="option filter_train of textcraft"):
        TextCraftEnv(filter_train="yes")


def test_expert_writes_thought_and_action_lines(env):
    start(env, CRAFTING_TABLE)
    text = env.expert()
    thought, action = text.split("\n")
    assert thought.startswith("Thought: ") and len(thought) > len("Thought: ") + 10
    # Among equally deep kinds of planks the planner takes the first in name order.
    assert action == "Action: get 1 acacia logs" and last_action(text) == "get 1 acacia logs"
    thoughts = set()
    for task in env.tasks("train", "hard")[:10]:
        env.reset(task)
        thoughts.add(env.expert().split("\n")[0].split(" ")[1])
    assert len(thoughts) > 1  # phrasings vary


def test_expert_recovers_from_a_messy_inventory(env):
    rng = random.Random(3)
    for task in env.tasks("test", "hard")[:8]:
        env.reset(task)
        for _ in range(5):
            if env.step(env.random_action(rng)).done:
                break
        else:
            while not env.done and env.turns < 60:
                env.step(env.expert())
        assert env.done, task


def test_plan_uses_what_is_held(env):
    book = load_recipe_book()
    table = item_id("crafting table")
    assert [step.action for step in plan_actions(book, table, {})] == [
        "get 1 acacia logs",
        "craft 4 acacia planks using 1 acacia logs",
        "craft 1 crafting table using 4 acacia planks",
    ]
    assert [step.action for step in plan_actions(book, table, {item_id("birch planks"): 4})] == [
        "craft 1 crafting table using 4 birch planks"
    ]
    assert plan_actions(book, table, {table: 1}) == []


def test_random_action_is_a_listed_kind_of_action(env):
    start(env, CRAFTING_TABLE)
    rng = random.Random(0)
    actions = {last_action(env.random_action(rng)) for _ in range(200)}
    assert "inventory" in actions
    assert any(action.startswith("get ") for action in actions)
    assert any(action.startswith("craft ") for action in actions)
    listed = env.reset(env.task_by_id(CRAFTING_TABLE))
    assert all(action in listed for action in actions if action.startswith("craft "))
