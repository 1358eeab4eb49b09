"""WebShop's purchase reward, as a pure function of (product, chosen options, goal).

    r = r_type * (attributes matched + options matched + [price <= bound])
               / (#attributes + #options + 1)

Matching rules (WebShop's ``web_agent_site/engine/goal.py``, without its fuzzy
matcher and spaCy tagger, which the generated catalogue does not need):

- Text is compared after ``normalize``: lower case, apostrophes dropped, every
  other non-alphanumeric character a space (dots kept inside numbers).
- An **attribute** of the goal is matched when it is one of the product's
  attributes, or when it occurs as a whole phrase in the product's title,
  features or description (WebShop's fallback).
- An **option** ``group: value`` of the goal is matched when ``value`` is
  among the values chosen before buying (WebShop compares values only).
- The **price** term is 1 when the product's price is at most the bound.
- **r_type** compares the bought product's type with the target's:
  ``query_match``: same query (product type); ``category_match``: the two
  category paths share at least 2 of their parts; ``title_score``: the
  fraction of the target title's nouns found among the bought title's nouns,
  where a title's nouns are its words in the catalogue's noun lexicon
  (product-type nouns; brands never count). Then, in this order:
  r_type = 1, or 0.5 if none of query_match, category_match,
  title_score > 0.2 holds; 0.1 if title_score < 0.1; 0 if title_score == 0.
  A target without nouns gives title_score 0.2, as WebShop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from contrail.envs.webshop.catalog import NOUN_LEXICON, Product
from contrail.envs.webshop.goals import Goal

_NON_WORD = re.compile(r"[^a-z0-9.%]+")
_LOOSE_DOT = re.compile(r"(?<![0-9])\.|\.(?![0-9])")


def normalize(text: str) -> str:
    """Lower case, apostrophes dropped, punctuation to single spaces (``3.4`` kept)."""
    text = text.lower().replace("'", "").replace("’", "")
    text = _LOOSE_DOT.sub(" ", _NON_WORD.sub(" ", text))
    return " ".join(text.split())


def title_nouns(title: str) -> set[str]:
    """The words of ``title`` that are in the catalogue's noun lexicon."""
    return {word for word in normalize(title).split() if word in NOUN_LEXICON}


@dataclass(frozen=True)
class RewardBreakdown:
    """Every term of the purchase reward (``total`` is the reward)."""

    r_type: float
    query_match: bool
    category_match: bool
    title_score: float
    attributes_matched: int
    options_matched: int
    price_ok: bool
    total: float


def type_reward(product: Product, goal: Goal, nouns: Callable[[str], frozenset[str]] | None = None,
                ) -> tuple[float, bool, bool, float]:
    """``(r_type, query_match, category_match, title_score)`` of buying ``product`` for ``goal``.

    ``nouns`` reads a title's nouns (default `title_nouns`; real WebShop data brings its own).
    """
    nouns = nouns or title_nouns
    query_match = product.query == goal.query
    bought_path = {part.strip() for part in product.category.split("›")}
    goal_path = {part.strip() for part in goal.category.split("›")}
    category_match = len(bought_path & goal_path) >= 2
    wanted = nouns(goal.title)
    title_score = len(nouns(product.title) & wanted) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Product, attributes: tuple[str, ...]) -> int:
    """How many of ``attributes`` the product has (listed, or written in its text)."""
    listed = {normalize(a) for a in product.attributes}
    text = " " + normalize(" ".join([product.title, *product.features, product.description])) + " "
    return sum(1 for a in map(normalize, attributes) if a in listed or f" {a} " in text)


def option_matches(chosen: Mapping[str, str], goal_options: tuple[tuple[str, str], ...]) -> int:
    """How many of the goal's option values were chosen."""
    chosen_values = {normalize(value) for value in chosen.values()}
    return sum(1 for _, value in goal_options if normalize(value) in chosen_values)


def purchase_reward(product: Product, chosen: Mapping[str, str], goal: Goal) -> RewardBreakdown:
    """The reward of buying ``product`` with option values ``chosen`` for ``goal``."""
    r_type, query_match, category_match, title_score = type_reward(product, goal)
    n_attributes = attribute_matches(product, goal.attributes)
    n_options = option_matches(chosen, goal.options)
    price_ok = product.price <= goal.price_upper
    denominator = len(goal.attributes) + len(goal.options) + 1
    total = r_type * (n_attributes + n_options + int(price_ok)) / denominator
    return RewardBreakdown(
        r_type=r_type,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
        attributes_matched=n_attributes,
        options_matched=n_options,
        price_ok=price_ok,
        total=total,
    )


def satisfies(product: Product, goal: Goal) -> bool:
    """True when buying ``product`` with the goal's own option values earns reward 1."""
    offered = {normalize(v) for values in product.options.values() for v in values}
    if any(normalize(value) not in offered for _, value in goal.options):
        return False
    return purchase_reward(product, dict(goal.options), goal).total == 1.0
