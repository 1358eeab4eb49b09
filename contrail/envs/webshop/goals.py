"""WebShop goals: task ids, splits, difficulties and the instruction text.

A goal names a target product and asks for some of its attributes, some of
its option values and a price bound, in AgentGym's synthetic style::

    i need a <product words> with <attr>, and <attr>, and <option>: <value>,
    and price lower than <P> dollars

``<product words>`` are the target's product type (its ``query``), refined by
the qualifier its title carries (``women's running shoes``).

Layout of task ids (the same id is the same goal on any machine):
- ids ``0 .. TRAIN_SIZE-1`` are train tasks, ``TRAIN_SIZE .. TRAIN_SIZE+TEST_SIZE-1``
  test tasks; even ids are easy, odd ids hard;
- train goals target train products and test goals test products (every
  fifth product of the catalogue is a test product), so a test target was
  never a train target.

Difficulty is the number of constraints (attributes + options + price):
easy goals have at most 3, hard goals at least 5.

Price bound, as WebShop: among the round prices 10, 20, ..., 990 above the
target's price, two of the first four are drawn and the larger is the bound.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from contrail.envs.webshop.catalog import Product

TRAIN_SIZE = 6000
TEST_SIZE = 1000
DIFFICULTIES = ("easy", "hard")
TEST_PRODUCT_EVERY = 5
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))

# (attributes, options) mixes; the price is always the last constraint
EASY_MIXES = ((1, 0), (2, 0), (1, 1))


@dataclass(frozen=True)
class Goal:
    """What the shopper wants, and the target product it was drawn from.

    ``query``, ``category`` and ``title`` describe the target's type; the
    reward compares the purchased product's against them (see webshop.reward).
    """

    task_id: int
    asin: str
    product_words: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (group, value)
    price_upper: float
    query: str
    category: str
    title: str
    text: str = ""  # WebShop's own instruction (real data, `webshop.real`); empty: composed below

    @property
    def instruction(self) -> str:
        """The instruction text shown on every page."""
        if self.text:
            return self.text
        parts = list(self.attributes) + [f"{group}: {value}" for group, value in self.options]
        constraints = "".join(f", and {part}" for part in parts[1:])
        return (
            f"i need a {self.product_words} with {parts[0]}{constraints}, "
            f"and price lower than {self.price_upper:.2f} dollars"
        )

    @property
    def constraint_count(self) -> int:
        """Attributes + options + the price bound."""
        return len(self.attributes) + len(self.options) + 1

    @property
    def search_words(self) -> str:
        """What a competent shopper types: the product words and the attributes."""
        return " ".join([self.product_words, *self.attributes])


def task_ids(split: str) -> range:
    """The task ids of ``split``."""
    if split == "train":
        return range(0, TRAIN_SIZE)
    if split == "test":
        return range(TRAIN_SIZE, TRAIN_SIZE + TEST_SIZE)
    raise ValueError(f"unknown split {split!r}; valid splits: train, test")


def split_of(task_id: int) -> str:
    """The split that owns ``task_id``; raises for ids outside both."""
    if 0 <= task_id < TRAIN_SIZE:
        return "train"
    if TRAIN_SIZE <= task_id < TRAIN_SIZE + TEST_SIZE:
        return "test"
    raise ValueError(f"webshop task id {task_id} is outside 0..{TRAIN_SIZE + TEST_SIZE - 1}")


def difficulty_of(task_id: int) -> str:
    """Even ids are easy, odd ids hard."""
    return DIFFICULTIES[task_id % 2]


def split_products(catalog: Sequence[Product], split: str) -> list[Product]:
    """The products ``split``'s goals may target (test: every fifth product)."""
    is_test = split == "test"
    return [p for index, p in enumerate(catalog) if (index % TEST_PRODUCT_EVERY == 0) == is_test]


def make_goal(catalog: Sequence[Product], task_id: int, seed: int = 0) -> Goal:
    """The goal of ``task_id`` over ``catalog`` (deterministic in ``seed`` and the id)."""
    rng = random.Random(seed * 1_000_003 + task_id * 7_919 + 11)
    target = rng.choice(split_products(catalog, split_of(task_id)))
    groups = list(target.options)
    if difficulty_of(task_id) == "easy":
        n_attributes, n_options = rng.choice(EASY_MIXES)
        n_options = min(n_options, len(groups))
    else:
        n_options = rng.randint(1, len(groups))
        n_attributes = min(max(4 - n_options, rng.choice((2, 3))), len(target.attributes))
    attributes = tuple(rng.sample(target.attributes, n_attributes))
    chosen_groups = sorted(rng.sample(groups, n_options), key=groups.index)
    options = tuple((group, rng.choice(target.options[group])) for group in chosen_groups)
    # the qualifier refines the product words unless it repeats an asked attribute
    qualifier = target.qualifier if target.qualifier not in attributes else ""
    return Goal(
        task_id=task_id,
        asin=target.asin,
        product_words=f"{qualifier} {target.query}".strip(),
        attributes=attributes,
        options=options,
        price_upper=_price_bound(rng, target.price),
        query=target.query,
        category=target.category,
        title=target.title,
    )


def _price_bound(rng: random.Random, price: float) -> float:
    above = [step for step in PRICE_STEPS if step > price][:4]
    return max(rng.sample(above, 2))
