"""WebShop's own data files (a small set written here in exactly their format) load into `WebShopEnv`."""

from __future__ import annotations

import json
import re

import pytest

import contrail.envs as envs
from contrail.envs.webshop.real import (
    WebShopDataError,
    parse_pricing,
    real_data,
    token_set_ratio,
)


def record(asin, name, query, options, pricing="$12.99", category="Clothing › Men › Shirts"):
    """A product record as in WebShop's items_shuffle.json (extra keys included: the loader ignores them)."""
    return {
        "asin": asin, "name": name, "query": query.upper() + " ", "product_category": category,
        "category": "fashion", "full_description": f"The {name.lower()}. Soft and durable.",
        "small_description": ["machine wash", "100% cotton"], "pricing": pricing,
        "customization_options": {
            group: [{"value": v, "image": None} for v in values] for group, values in options.items()
        },
        "images": ["https://example.invalid/1.jpg"], "brand": "Acme", "list_price": "", "average_rating": 4.5,
    }


PRODUCTS = [
    record("B000SHIRT1", "Acme Cotton Shirt Navy", "men shirts",
           {"Color": ["Navy Blue", "White/Grey"], "Size": ["Small", "Large"]}),
    record("B000SHIRT2", "Acme Linen Shirt", "men shirts", {"Color": ["Red"]}, pricing="$30.00$40.00"),
    record("B000MUG001", "Ceramic Coffee Mug", "coffee mugs", {}, pricing="$8.50", category="Home › Kitchen › Mugs"),
    record("nan", "Broken", "x", {}),
    record("B000SHIRT1", "Duplicate of the first", "men shirts", {}),
]
ATTRIBUTES = {
    "B000SHIRT1": {"attributes": ["machine wash", "cotton"], "instruction": "i want a cotton shirt",
                   "instruction_attributes": ["cotton", "machine wash"]},
    "B000SHIRT2": {"attributes": ["linen"], "instruction": "i need a linen shirt", "instruction_attributes": ["linen"]},
    "B000MUG001": {"attributes": ["dishwasher safe"], "instruction": "a coffee mug",
                   "instruction_attributes": ["dishwasher safe"]},
}
HUMAN = {
    "B000SHIRT1": [{"instruction": "i want a machine wash cotton shirt in navy blue.",
                    "instruction_attributes": ["machine wash", "cotton"], "instruction_options": ["navy"]}],
    "B000MUG001": [{"instruction": "find me a dishwasher safe coffee mug",
                    "instruction_attributes": ["dishwasher safe"], "instruction_options": []},
                   {"instruction": "skipped: no attributes", "instruction_attributes": [], "instruction_options": []}],
}


@pytest.fixture
def data_dir(tmp_path):
    for name, content in (("items_shuffle_1000.json", PRODUCTS), ("items_ins_v2_1000.json", ATTRIBUTES),
                          ("items_human_ins.json", HUMAN)):
        (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def play(env, task, actions):
    env.reset(task)
    steps = [env.step(f"Thought:\nI think so.\n\nAction:\n{action}") for action in actions]
    return steps[-1]


def goal_index(env, asin):
    return next(t for t in env.tasks("test") if env.goal_of(t).asin == asin)


def test_human_goals_give_webshops_pages_and_reward(data_dir):
    env = envs.make("webshop", data_dir=str(data_dir))
    tasks = env.tasks("test")
    assert len(tasks) == 2 and env.tasks("train") == []  # 2 human goals (one skipped): ids 0-1 are WebShop's test ids
    shirt = goal_index(env, "B000SHIRT1")
    first = env.reset(shirt)
    instruction = re.fullmatch(r"WebShop \[SEP\] Instruction: \[SEP\] (.*) \[SEP\] Search", first).group(1)
    assert re.fullmatch(r"i want a machine wash cotton shirt in navy blue, and price lower than \d+\.00 dollars",
                        instruction)
    results = env.step("Action:\nsearch[cotton shirt navy]").observation
    assert "B000SHIRT1 [SEP] Acme Cotton Shirt Navy [SEP] $12.99" in results
    item = env.step("Action:\nclick[B000SHIRT1]").observation
    assert "color [SEP] navy blue [SEP] white | grey [SEP] size [SEP] small [SEP] large" in item  # WebShop's lowering
    env.step("Action:\nclick[navy blue]")
    bought = env.step("Action:\nclick[Buy Now]")
    assert bought.done and bought.reward == 1.0 and bought.success  # "navy" matches "navy blue" (token-set ratio)
    wrong_option = play(env, shirt, ["search[cotton shirt]", "click[B000SHIRT1]", "click[white | grey]",
                                     "click[Buy Now]"])
    assert wrong_option.reward == pytest.approx(3 / 4)  # 2 attributes + price, not the option, over 2 + 1 + 1
    other_type = play(env, shirt, ["search[coffee mug]", "click[B000MUG001]", "click[Buy Now]"])
    assert other_type.reward < 0.5 and other_type.info["reward"]["r_type"] < 1


def test_synthetic_goals_enumerate_option_combinations(data_dir):
    env = envs.make("webshop", data_dir=str(data_dir), human_goals=False)
    texts = [env.goal_of(t).instruction for t in env.tasks("test")]
    assert len(texts) == 2 * 2 + 1 + 1  # shirt 1: 2 colours x 2 sizes; shirt 2: 1 colour; the mug: none
    assert any(t.startswith("i want a cotton shirt with color: white | grey, and size: large, and price lower than")
               for t in texts)
    mug = next(t for t in env.tasks("test") if env.goal_of(t).asin == "B000MUG001")
    assert play(env, mug, ["search[coffee mug]", "click[B000MUG001]", "click[Buy Now]"]).reward == 1.0


def test_loading_follows_webshop(data_dir):
    data = real_data(data_dir)
    assert [p.asin for p in data.products] == ["B000SHIRT1", "B000SHIRT2", "B000MUG001"]  # nan and duplicate skipped
    assert data.products[0].query == "men shirts"  # lower-cased and stripped, as WebShop
    assert 30.0 <= data.products[1].price <= 40.0  # a range: one fixed draw inside it
    assert parse_pricing("$30.00$40.00") == [30.0, 40.0] and parse_pricing("") == [100.0]
    assert real_data(data_dir) is data  # once per process


def test_missing_files_are_one_clear_error(tmp_path):
    (tmp_path / "items_shuffle.json").write_text("[]")
    env = envs.make("webshop", data_dir=str(tmp_path))  # building reads nothing
    with pytest.raises(WebShopDataError, match=r"has no items_ins_v2\*\.json"):
        env.tasks("test")
    with pytest.raises(envs.EnvOptionError, match="option human_goals of webshop: expected bool"):
        envs.make("webshop", human_goals="yes")


def test_token_set_ratio_matches_thefuzz_on_known_values():
    assert token_set_ratio("fuzzy was a bear", "fuzzy fuzzy was a bear") == 100  # thefuzz's documented example
    assert token_set_ratio("Navy Blue", "blue navy") == 100
    assert token_set_ratio("machine wash", "hand wash") < 85
    assert token_set_ratio("this is a test", "this is a test!") == 100  # punctuation is processed away
    assert token_set_ratio("cotton", "cottons") == 92  # 200 * 6 / 13, rounded
