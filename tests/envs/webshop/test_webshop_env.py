"""WebShop: pages, actions, reward, determinism, splits, expert and search quality."""

from __future__ import annotations

import random
import re

import pytest

import contrail.envs as envs
from contrail.envs.base import EpisodeOver, Task
from contrail.envs.webshop.catalog import Product, build_catalog
from contrail.envs.webshop.env import INSTRUCTION, WebShopEnv, parse_action
from contrail.envs.webshop.goals import TEST_SIZE, TRAIN_SIZE, Goal, make_goal
from contrail.envs.webshop.reward import purchase_reward, satisfies
from contrail.envs.webshop.store import build_shop, forget_shops, get_shop

SEP = " [SEP] "


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("webshop-cache"))


@pytest.fixture
def env(cache_dir):
    return WebShopEnv(cache_dir=cache_dir)


def play(env: WebShopEnv, task: Task, policy) -> tuple[float, bool, int]:
    """Run one episode through step(); every action must be valid."""
    env.reset(task)
    for turn in range(1, env.turn_limit(task) + 1):
        step = env.step(policy())
        assert step.valid, step.info
        if step.done:
            return step.reward, step.success, turn
    return 0.0, False, env.turn_limit(task)


def search_first_task(env: WebShopEnv, difficulty: str = "hard") -> tuple[Task, Goal, str]:
    task = env.tasks("test", difficulty)[0]
    env.reset(task)
    goal = env.goal
    step = env.step(f"Thought:\nI think I should search.\n\nAction:\nsearch[{goal.search_words}]")
    return task, goal, step.observation


# --- registry, instruction, tasks ----------------------------------------------------


def test_registered_with_agentgym_settings(cache_dir):
    env = envs.make("webshop", cache_dir=cache_dir)
    assert isinstance(env, WebShopEnv)
    assert env.difficulties == ("easy", "hard")
    assert env.max_turns == 10 and WebShopEnv(max_turns=15).max_turns == 15
    assert env.instruction() == INSTRUCTION
    assert INSTRUCTION.startswith("You are web shopping.")
    assert "search[keywords]\nclick[value]" in INSTRUCTION and INSTRUCTION.endswith("Action: \nclick[something]")
    assert env.prompt_messages()[1] == {"role": "assistant", "content": "Ok."}


def test_splits_are_disjoint_and_sized(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == TRAIN_SIZE and len(test) == TEST_SIZE
    assert not {t.id for t in train} & {t.id for t in test}
    assert all(t.split == "test" and t.env == "webshop" for t in test)
    easy, hard = env.tasks("test", "easy"), env.tasks("test", "hard")
    assert len(easy) + len(hard) == TEST_SIZE and {t.difficulty for t in easy} == {"easy"}
    with pytest.raises(ValueError):
        env.tasks("validation")
    with pytest.raises(ValueError):
        env.tasks("train", "medium")


def test_train_and_test_goals_target_different_products(env):
    train_targets = {env.goal_of(t).asin for t in env.tasks("train")[:1500]}
    test_targets = {env.goal_of(t).asin for t in env.tasks("test")}
    assert not train_targets & test_targets


def test_difficulty_counts_constraints(env):
    for task in env.tasks("train")[:400]:
        goal = env.goal_of(task)
        if task.difficulty == "easy":
            assert goal.constraint_count <= 3
        else:
            assert goal.constraint_count >= 5


def test_instruction_follows_agentgym_synthetic_style(env):
    goal = env.goal_of(env.tasks("test", "hard")[1])
    pattern = r"i need a [a-z0-9'% -]+ with .+(, and [a-z ]+: .+)+, and price lower than \d+\.00 dollars"
    assert re.fullmatch(pattern, goal.instruction), goal.instruction
    for group, value in goal.options:
        assert f", and {group}: {value}" in goal.instruction


# --- determinism ----------------------------------------------------------------------


def test_catalogue_is_identical_across_builds():
    first, second = build_catalog(0), build_catalog(0)
    assert first == second
    assert len(first) >= 2000 and len({p.asin for p in first}) == len(first)
    assert len({p.query for p in first}) >= 50 and len({p.category.split(" › ")[0] for p in first}) >= 10
    assert build_catalog(1) != first


def test_same_task_id_gives_same_goal(cache_dir):
    products = build_catalog(0)
    for task_id in (0, 1, 4321, TRAIN_SIZE, TRAIN_SIZE + 777):
        assert make_goal(products, task_id) == make_goal(products, task_id)
    one, other = WebShopEnv(cache_dir=cache_dir), WebShopEnv(disk_cache=False)
    task = one.tasks("test", "hard")[5]
    assert one.reset(task) == other.reset(task)


def test_disk_cache_serves_the_same_shop(tmp_path):
    written = get_shop(seed=3, cache_dir=tmp_path)  # builds and writes
    assert any(tmp_path.iterdir())
    forget_shops()  # the next call must read the disk
    read = get_shop(seed=3, cache_dir=tmp_path)
    fresh = build_shop(3)
    assert read is not written and read.products == fresh.products
    for query in ("women's running shoes non slip", "usb c cable braided nylon", "organic green tea"):
        assert read.search.search(query) == fresh.search.search(query)


# --- pages --------------------------------------------------------------------------


def test_search_page_format(env):
    task = env.tasks("test", "easy")[0]
    first = env.reset(task)
    assert first == f"WebShop [SEP] Instruction: [SEP] {env.goal.instruction} [SEP] Search"


def test_results_page_format_and_paging(env):
    _, goal, page = search_first_task(env)
    results = env.view.results
    head = f"Instruction: [SEP] {goal.instruction} [SEP] Back to Search [SEP] Page 1 (Total results: {len(results)})"
    assert page.startswith(head + " [SEP] Next > [SEP] ")
    assert len(results) == 50  # WebShop shows the top 50
    listed = page.split(SEP)[5:]
    assert len(listed) == 30
    for asin, (shown_asin, title, price) in zip(results[:10], zip(*[iter(listed)] * 3)):
        product = env.product(asin)
        assert (shown_asin, title, price) == (asin, product.title, f"${product.price:.2f}")
    second = env.step("Action: click[Next >]").observation
    assert f"Page 2 (Total results: {len(results)}) [SEP] < Prev [SEP] Next > [SEP] {results[10]}" in second
    for _ in range(3):
        last = env.step("Action: click[next >]").observation
    assert "Page 5" in last and "< Prev" in last and "Next >" not in last
    assert not env.step("Action: click[Next >]").valid
    assert "Page 4" in env.step("Action: click[< Prev]").observation


def test_item_page_format_and_sub_pages(env):
    _, goal, _ = search_first_task(env)
    asin = env.view.results[0]
    product = env.product(asin)
    item = env.step(f"Action: click[{asin}]").observation
    option_text = SEP.join(SEP.join([group, *values]) for group, values in product.options.items())
    assert item == SEP.join([
        "Instruction:", goal.instruction, "Back to Search", "< Prev", option_text, product.title,
        f"Price: ${product.price:.2f}", "Rating: N.A.", "Description", "Features", "Reviews", "Buy Now",
    ])
    head = f"Instruction: [SEP] {goal.instruction} [SEP] Back to Search [SEP] < Prev [SEP] "
    assert env.step("Action: click[Description]").observation == head + product.description
    assert env.step("Action: click[< Prev]").observation == item
    assert env.step("Action: click[features]").observation == head + SEP.join(product.features)
    env.step("Action: click[< Prev]")
    reviews = env.step("Action: click[Reviews]").observation
    assert reviews.startswith(head) and len(reviews) > len(head)
    env.step("Action: click[< Prev]")
    assert env.step("Action: click[< Prev]").observation.startswith(
        f"Instruction: [SEP] {goal.instruction} [SEP] Back to Search [SEP] Page 1"
    )
    assert env.step("Action: click[Back to Search]").observation == (
        f"WebShop [SEP] Instruction: [SEP] {goal.instruction} [SEP] Search"
    )


def test_search_that_matches_nothing_shows_an_empty_results_page(env):
    env.reset(env.tasks("test")[0])
    page = env.step("Action: search[zzqx qqvw]").observation
    assert page.endswith("Back to Search [SEP] Page 1 (Total results: 0)")
    assert env.step("Action: click[Back to Search]").valid


# --- actions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Thought:\nI think so.\n\nAction:\nsearch[red shoes]", ("search", "red shoes")),
        ("Thought: I think so.\nAction: click[Buy Now]", ("click", "Buy Now")),
        ("Action: \nclick[< Prev]\n", ("click", "< Prev")),
        ("click[Next >]", ("click", "Next >")),
        ("Thought: a\nAction: search[x]\nThought: b\nAction: CLICK[b0abc]", ("click", "b0abc")),
        ("Action: `search[green tea]`", None),
        ("Action: click[Buy Now] please", ("click", "Buy Now")),
        ("Action: click[a] or click[b]", None),
        ("Action: Search[ Green Tea ]", ("search", "Green Tea")),
        ("Thought: nothing to do", None),
        ("Action: search[]", None),
        ("Action: search[  ]", None),
        ("Action: buy[it]", None),
        ("I will search[shoes] now", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


BAD_OUTPUTS = [
    "",
    "I would like to buy shoes.",
    "Thought:\nhmm\n\nAction:\n",
    "Action: click[this is not on the page]",
    "Action: click[Search]",
    "Action: jump[now]",
    "Action: click[Buy Now",
    "Action: click[a] or click[Buy Now]",
    "\x00\x01 [SEP] ]]][[[ Action: ::: click[]",
    "Action: " + "x" * 5000,
    "🛒 Action: click[🛒]",
]


@pytest.mark.parametrize("bad", BAD_OUTPUTS)
def test_malformed_output_leaves_the_page_unchanged(env, bad):
    env.reset(env.tasks("test", "hard")[2])
    env.step(f"Action: search[{env.goal.search_words}]")
    for _ in range(2):  # on the results page, then on an item page
        before = env.observation()
        step = env.step(bad)
        assert (step.observation, step.reward, step.done, step.valid, step.success) == (
            before, 0.0, False, False, False)
        env.step(f"Action: click[{env.view.results[0]}]")


def test_search_only_on_the_search_page(env):
    _, goal, results_page = search_first_task(env)
    step = env.step("Thought:\nI think I will search again.\n\nAction:\nsearch[anything]")
    assert not step.valid and step.observation == results_page and step.reward == 0.0
    item = env.step(f"Action: click[{env.view.results[0]}]").observation
    assert not env.step("Action: search[anything]").valid and env.observation() == item
    env.step("Action: click[Back to Search]")
    assert not env.step("Action: click[Search]").valid  # the search button is not a click target
    assert env.step("Action: search[anything]").valid


def test_clicks_are_case_insensitive(env):
    search_first_task(env)
    asin = env.view.results[0]
    assert env.step(f"Action: click[{asin.lower()}]").valid and env.view.asin == asin
    value = next(iter(env.product(asin).options.values()))[0]
    assert env.step(f"Action: click[{value.upper()}]").valid
    step = env.step("Action: click[bUY nOW]")
    assert step.valid and step.done


def test_buy_now_ends_the_episode(env):
    search_first_task(env)
    env.step(f"Action: click[{env.view.results[0]}]")
    step = env.step("Action: click[Buy Now]")
    assert step.done and step.observation.startswith("Thank you for shopping with us!")
    assert step.info["reward"]["total"] == step.reward
    with pytest.raises(EpisodeOver):  # the one rule of every environment (contrail.envs.base)
        env.step("Action: click[Back to Search]")


def test_chosen_options_survive_sub_pages_and_count_in_the_reward(env):
    for task in env.tasks("test", "hard")[:20]:
        env.reset(task)
        goal = env.goal
        env.step(f"Action: search[{goal.search_words}]")
        asin = next(a for a in env.view.results if satisfies(env.product(a), goal))
        if asin not in env.view.page_asins():
            continue
        env.step(f"Action: click[{asin}]")
        for _, value in goal.options:
            env.step(f"Action: click[{value}]")
        env.step("Action: click[Features]")
        env.step("Action: click[< Prev]")
        assert env.step("Action: click[Buy Now]").reward == 1.0
        env.reset(task)
        env.step(f"Action: search[{goal.search_words}]")
        env.step(f"Action: click[{asin}]")
        without_options = env.step("Action: click[Buy Now]").reward
        assert without_options == pytest.approx((goal.constraint_count - len(goal.options)) / goal.constraint_count)
        return
    pytest.fail("no task had a satisfying product on the first page")


# --- reward on hand-made purchases ----------------------------------------------------


def shoe(**changes) -> Product:
    fields = dict(
        asin="B0TESTSHOE", title="Acme Women's Lightweight Running Shoes, Mesh Sneakers",
        query="running shoes", category="clothing, shoes & jewelry › shoes › athletic",
        attributes=("lightweight", "non slip", "breathable"),
        options={"size": ("7", "8", "9"), "color": ("black", "white")}, price=45.99,
        description="A running shoe for the road.", features=("LIGHTWEIGHT - light on the feet.",),
        reviews=(),
    )
    fields.update(changes)
    return Product(**fields)


SHOE_GOAL = Goal(
    task_id=-1, asin="B0TESTSHOE", product_words="women's running shoes",
    attributes=("lightweight", "non slip"), options=(("size", "8"), ("color", "black")),
    price_upper=50.0, query="running shoes", category="clothing, shoes & jewelry › shoes › athletic",
    title="Acme Women's Lightweight Running Shoes, Mesh Sneakers",
)


def test_full_match_earns_one():
    result = purchase_reward(shoe(), {"size": "8", "color": "black"}, SHOE_GOAL)
    assert result.total == 1.0 and result.r_type == 1.0
    assert satisfies(shoe(), SHOE_GOAL)


def test_partial_matches_are_graded():
    # 5 constraints: 2 attributes, 2 options, price
    assert purchase_reward(shoe(), {"size": "9", "color": "black"}, SHOE_GOAL).total == pytest.approx(4 / 5)
    assert purchase_reward(shoe(), {}, SHOE_GOAL).total == pytest.approx(3 / 5)
    no_grip = shoe(attributes=("lightweight", "breathable"))
    assert purchase_reward(no_grip, {"size": "8", "color": "black"}, SHOE_GOAL).total == pytest.approx(4 / 5)
    assert not satisfies(no_grip, SHOE_GOAL)


def test_attribute_found_in_text_counts():
    written = shoe(attributes=("breathable",), features=("NON SLIP - grips wet floors.",))
    result = purchase_reward(written, {"size": "8", "color": "black"}, SHOE_GOAL)
    assert result.attributes_matched == 2  # lightweight from the title, non slip from a feature


def test_over_price_loses_the_price_term():
    pricey = shoe(price=50.01)
    result = purchase_reward(pricey, {"size": "8", "color": "black"}, SHOE_GOAL)
    assert not result.price_ok and result.total == pytest.approx(4 / 5)
    assert purchase_reward(shoe(price=50.0), {"size": "8", "color": "black"}, SHOE_GOAL).price_ok


def test_wrong_type_earns_nothing():
    speaker = shoe(title="Acme Lightweight Bluetooth Speaker", query="bluetooth speaker",
                   category="electronics › portable audio › speakers")
    result = purchase_reward(speaker, {"size": "8", "color": "black"}, SHOE_GOAL)
    assert result.r_type == 0.0 and result.total == 0.0


def test_related_type_in_another_category_keeps_full_type_reward():
    # walking shoes share the "shoes" noun: title_score 1/3 > 0.2
    walker = shoe(title="Acme Walking Shoes", query="walking shoes", category="other › footwear › walking")
    assert purchase_reward(walker, {"size": "8", "color": "black"}, SHOE_GOAL).r_type == 1.0


def test_weak_title_overlap_halves_or_cuts_the_reward():
    many_nouns = Goal(**{**SHOE_GOAL.__dict__, "title": "Acme Running Shoes Sneakers Mesh Boots Slippers"})
    # one of five target nouns, no query or category match: title_score 0.2 -> r_type 0.5
    half = shoe(title="Acme Lightweight Slippers", query="slippers", category="elsewhere › home › slippers")
    assert purchase_reward(half, {"size": "8", "color": "black"}, many_nouns).r_type == 0.5
    eleven = Goal(**{**SHOE_GOAL.__dict__,
                     "title": "shoes sneakers mesh boots slippers leather suede rubber fleece shirt tee"})
    # one of eleven: title_score < 0.1 -> r_type 0.1, even with a query match
    tenth = shoe(title="Acme Tee")
    assert purchase_reward(tenth, {"size": "8", "color": "black"}, eleven).r_type == 0.1


# --- the expert, the random baseline, search quality ----------------------------------


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_expert_solves_tasks_through_step(env, difficulty):
    tasks = env.tasks("test", difficulty)[:60]
    outcomes = [play(env, task, env.expert) for task in tasks]
    assert all(success for _, success, _ in outcomes), [t.id for t, o in zip(tasks, outcomes) if not o[1]]
    assert max(turns for _, _, turns in outcomes) <= env.max_turns


def test_expert_writes_agentgym_react_text(env):
    env.reset(env.tasks("test", "easy")[3])
    text = env.expert()
    assert re.fullmatch(r"Thought:\nI think .+\n\nAction:\nsearch\[.+\]", text), text


def test_expert_recovers_after_a_detour(env):
    task = env.tasks("test", "hard")[7]
    env.reset(task)
    env.step("Action: search[organic green tea]")
    env.step(f"Action: click[{env.view.results[0]}]")
    env.step("Action: click[Reviews]")
    for _ in range(env.max_turns):
        step = env.step(env.expert())
        if step.done:
            break
    assert step.success


def test_random_actions_are_valid_and_rarely_succeed(env):
    rng = random.Random(0)
    outcomes = [play(env, task, lambda: env.random_action(rng)) for task in env.tasks("test")[:80]]
    assert sum(success for _, success, _ in outcomes) <= 4


def test_target_is_on_the_first_results_page(env):
    shop = env.shop
    goals = [env.goal_of(task) for task in env.tasks("test")[:200]]
    hits = sum(goal.asin in shop.search.search(goal.search_words)[:10] for goal in goals)
    assert hits / len(goals) >= 0.9
    # the same type's distractors crowd the results: several look alike on page 1
    goal = goals[1]
    same_type = [a for a in shop.search.search(goal.search_words)[:10] if shop.by_asin[a].query == goal.query]
    assert len(same_type) >= 3
