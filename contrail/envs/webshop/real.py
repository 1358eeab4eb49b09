"""WebShop's own data files: the real products, instructions and reward.

Point the environment at a folder holding WebShop's files
(``WebShopEnv(data_dir=...)``, or ``stream.env_options: {webshop: {data_dir: ...}}``):

- ``items_shuffle*.json`` (required): the product records, a JSON list of
  objects with ``asin``, ``name``, ``full_description``, ``small_description``,
  ``pricing`` (``"$12.99"`` or ``"$10.00$20.00"`` for a range),
  ``customization_options`` (``{name: [{"value": ...}, ...]}``), ``query``,
  ``product_category`` (``"A › B › C"``);
- ``items_ins_v2*.json`` (required): per ASIN, ``attributes`` (and, for the
  synthetic goals, ``instruction`` and ``instruction_attributes``);
- ``items_human_ins.json`` (optional): per ASIN, a list of human goals with
  ``instruction``, ``instruction_attributes`` and ``instruction_options``.
  Used when present (WebShop's ``human_goals`` setting), else the synthetic
  goals: one per product and combination of its option values.

Loading follows WebShop's ``engine.load_products`` and ``goal.get_goals``:
ASINs that are ``"nan"``, longer than 10 characters or repeated are skipped;
option names and values are lower-cased, values with ``/`` shown as `` | ``;
goals get ``, and price lower than P dollars`` with P drawn from the round
prices above the product's as WebShop draws it; goals are shuffled as WebShop
shuffles them (``random.seed(233)``), so a task id is WebShop's session index
(AgentGym's ``data_idx``). Splits are WebShop's: ids 0-499 test, 1500 and up
train (500-1499 are WebShop's validation goals, used by neither split).
Difficulty: easy with at most 3 constraints, hard with more.

The reward is WebShop's ``get_reward``: ``r_type * (attributes + options +
price) / (#attributes + #options + 1)``, attributes and options matched by a
token-set ratio above 85 (a re-implementation of ``thefuzz.token_set_ratio``),
attributes also found as substrings of the title, features or description,
and ``r_type`` from the query, the category path and the titles' nouns. The
nouns come from spaCy's ``en_core_web_sm`` tagger when it is installed (as
WebShop); otherwise every word that is not a stop word counts as a noun (an
approximation: `nouns_are_exact` says which one is in use). Two further
differences: a product with a price range gets a fixed price per ASIN (drawn
uniformly in the range, as WebShop draws it per process), and WebShop's colour
normalisation of option values is not applied.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from contrail.envs.base import EnvOptionError
from contrail.envs.webshop.catalog import Product
from contrail.envs.webshop.goals import PRICE_STEPS, Goal
from contrail.envs.webshop.reward import RewardBreakdown, type_reward
from contrail.envs.webshop.search import ProductSearch
from contrail.envs.webshop.store import Shop

SHUFFLE_SEED = 233  # WebShop's goal shuffle
TEST_IDS = range(0, 500)
TRAIN_START = 1500
NO_BOUND = 1_000_000.0  # WebShop's price bound when fewer than two round prices lie above the price


class WebShopDataError(EnvOptionError):
    """A WebShop data folder that is missing a file or holds one in another format."""


# --- loading -------------------------------------------------------------------------------------


def find_file(data_dir: Path, pattern: str, required: bool = True) -> Path | None:
    """The data file matching ``pattern`` (the full file before the ``_1000``-style samples)."""
    found = sorted(data_dir.glob(pattern), key=lambda p: (len(p.name), p.name))
    if not found and required:
        raise WebShopDataError(f"option data_dir of webshop: {data_dir} has no {pattern} (WebShop's data files)")
    return found[0] if found else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise WebShopDataError(f"option data_dir of webshop: cannot read {path}: {error}") from None


def parse_pricing(pricing: Any) -> list[float]:
    """WebShop's ``pricing`` string as a list of prices (``[100.0]`` when absent)."""
    if not pricing:
        return [100.0]
    prices = []
    for piece in str(pricing).split("$")[1:]:
        try:
            prices.append(float(Decimal(re.sub(r"[^\d.]", "", piece))))
        except InvalidOperation:
            continue
    return prices[:2] or [100.0]


def product_price(asin: str, prices: list[float]) -> float:
    """One price: the single price, or a draw in the range fixed by the ASIN."""
    if len(prices) == 1:
        return prices[0]
    return random.Random(f"webshop-price:{asin}").uniform(prices[0], prices[1])


def _options(record: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    options = {}
    for name, contents in (record.get("customization_options") or {}).items():
        if contents is None:
            continue
        options[name.lower()] = tuple(c["value"].strip().replace("/", " | ").lower() for c in contents)
    return options


def load_products(records: list[dict[str, Any]], attributes: dict[str, Any]) -> list[Product]:
    """WebShop's product records as contrail products (skipping what WebShop skips)."""
    products, seen = [], set()
    for record in records:
        asin = record.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        bullets = record.get("small_description")
        features = bullets if isinstance(bullets, list) else [bullets or ""]
        products.append(Product(
            asin=asin, title=record["name"], query=record["query"].lower().strip(),
            category=record.get("product_category", ""),
            attributes=tuple(attributes.get(asin, {}).get("attributes") or ["DUMMY_ATTR"]),
            options=_options(record), price=product_price(asin, parse_pricing(record.get("pricing"))),
            description=record.get("full_description") or "", features=tuple(str(f) for f in features),
            reviews=(),
        ))
    return products


def _price_bound(rng: random.Random, price: float) -> tuple[float, str]:
    above = [step for step in PRICE_STEPS if step > price][:4]
    if len(above) < 2:
        return NO_BOUND, ""
    bound = max(rng.sample(above, 2))
    return bound, f", and price lower than {bound:.2f} dollars"


def _goal(product: Product, text: str, attributes, options, rng: random.Random) -> Goal:
    bound, price_text = _price_bound(rng, product.price)
    return Goal(
        task_id=-1, asin=product.asin, product_words=product.query, attributes=tuple(attributes),
        options=tuple(options), price_upper=bound, query=product.query, category=product.category,
        title=product.title, text=text + price_text,
    )


def human_goals(products: list[Product], human: dict[str, Any], rng: random.Random) -> list[Goal]:
    """WebShop's human goals (those with at least one attribute), product by product."""
    goals = []
    for product in products:
        for entry in human.get(product.asin, []):
            if not entry.get("instruction_attributes"):
                continue
            options = [("", value) for value in entry.get("instruction_options") or []]
            goals.append(_goal(product, entry["instruction"].strip("."), entry["instruction_attributes"], options, rng))
    return goals


def synthetic_goals(products: list[Product], attributes: dict[str, Any], rng: random.Random) -> list[Goal]:
    """WebShop's synthetic goals: one per product and combination of its option values."""
    import itertools

    goals = []
    for product in products:
        entry = attributes.get(product.asin) or {}
        if not entry.get("instruction"):
            continue
        names = sorted(product.options)
        for combination in itertools.product(*(product.options[name] for name in names)):
            chosen = list(zip(names, combination))
            option_text = ", and ".join(f"{k}: {v}" for k, v in chosen)
            text = entry["instruction"] + (f" with {option_text}" if option_text else "")
            goals.append(_goal(product, text, entry["instruction_attributes"], chosen, rng))
    return goals


class RealData:
    """A WebShop data folder loaded: the shop (products + search) and the shuffled goals."""

    def __init__(self, data_dir: str | Path, human: bool = True) -> None:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise WebShopDataError(f"option data_dir of webshop: {root} is not a directory")
        attributes = _read_json(find_file(root, "items_ins_v2*.json"))
        products = load_products(_read_json(find_file(root, "items_shuffle*.json")), attributes)
        human_file = find_file(root, "items_human_ins*.json", required=False) if human else None
        rng = random.Random(SHUFFLE_SEED)  # the price bounds, then the shuffle: one fixed stream
        goals = (human_goals(products, _read_json(human_file), rng) if human_file
                 else synthetic_goals(products, attributes, rng))
        random.Random(SHUFFLE_SEED).shuffle(goals)
        self.goals = [_with_id(goal, index) for index, goal in enumerate(goals)]
        self.products = products
        self._shop: Shop | None = None
        self._lock = threading.Lock()

    @property
    def shop(self) -> Shop:
        """The products with their BM25 index (built at first use: listing tasks needs only the goals)."""
        with self._lock:
            if self._shop is None:
                self._shop = Shop(seed=-1, products=self.products, search=ProductSearch(self.products))
            return self._shop

    def ids(self, split: str) -> range:
        """Task ids of ``split`` (WebShop's: test 0-499, train 1500 and up)."""
        if split == "test":
            return range(0, min(len(self.goals), TEST_IDS.stop))
        return range(TRAIN_START, max(TRAIN_START, len(self.goals)))


def _with_id(goal: Goal, index: int) -> Goal:
    import dataclasses

    return dataclasses.replace(goal, task_id=index)


_LOADED: dict[tuple[str, bool], RealData] = {}
_LOCK = threading.Lock()


def real_data(data_dir: str | Path, human: bool = True) -> RealData:
    """The data of ``data_dir``, loaded once per process."""
    key = (str(Path(data_dir).expanduser().resolve()), human)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = RealData(data_dir, human)
        return _LOADED[key]


def real_difficulty(goal: Goal) -> str:
    """Easy: at most 3 constraints (attributes + options + price); hard: more."""
    return "easy" if goal.constraint_count <= 3 else "hard"


# --- WebShop's reward -----------------------------------------------------------------------------

_NON_ALNUM = re.compile(r"[^0-9a-z]+")
_STOP_WORDS = frozenset(
    "a an and are as at be by for from in into is it of on or the to with without".split()
)


def _process(text: str) -> str:
    return " ".join(_NON_ALNUM.sub(" ", text.lower()).split())


def _indel_ratio(a: str, b: str) -> float:
    """100 * (1 - indel distance / total length): the ratio thefuzz computes (via the LCS)."""
    if not a and not b:
        return 100.0
    previous = [0] * (len(b) + 1)
    for char in a:
        current = [0]
        for j, other in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if char == other else max(previous[j], current[j - 1]))
        previous = current
    return 200.0 * previous[-1] / (len(a) + len(b))


def token_set_ratio(a: str, b: str) -> int:
    """``thefuzz.fuzz.token_set_ratio``: compare the shared and the differing word sets (0-100)."""
    tokens_a, tokens_b = set(_process(a).split()), set(_process(b).split())
    if not tokens_a or not tokens_b:
        return 0
    shared = " ".join(sorted(tokens_a & tokens_b))
    only_a, only_b = " ".join(sorted(tokens_a - tokens_b)), " ".join(sorted(tokens_b - tokens_a))
    if shared and (not only_a or not only_b):
        return 100  # one set contains the other
    with_a = f"{shared} {only_a}".strip()
    with_b = f"{shared} {only_b}".strip()
    scores = [_indel_ratio(with_a, with_b)]
    if shared:
        scores += [_indel_ratio(shared, with_a), _indel_ratio(shared, with_b)]
    return int(round(max(scores)))


@functools.lru_cache(maxsize=1)
def _tagger():
    try:
        import spacy

        return spacy.load("en_core_web_sm")
    except (ImportError, OSError):
        return None


def nouns_are_exact() -> bool:
    """Whether titles' nouns come from spaCy (WebShop's reward exactly) or the stop-word fallback."""
    return _tagger() is not None


@functools.lru_cache(maxsize=65536)
def title_nouns(title: str) -> frozenset[str]:
    """The nouns of ``title`` (spaCy's NOUN/PROPN when installed, else its non-stop words)."""
    tagger = _tagger()
    if tagger is not None:
        return frozenset(t.text.lower() for t in tagger(title) if t.pos_ in ("NOUN", "PROPN"))
    return frozenset(w for w in _process(title).split() if w not in _STOP_WORDS and not w.isdigit())


def real_reward(product: Product, chosen: dict[str, str], goal: Goal) -> RewardBreakdown:
    """WebShop's ``get_reward`` for buying ``product`` with option values ``chosen``."""
    r_type, query_match, category_match, title_score = type_reward(product, goal, nouns=title_nouns)
    text = [product.title.lower(), " ".join(product.features).lower(), product.description.lower()]
    attributes = sum(
        1 for attribute in goal.attributes
        if any(token_set_ratio(own, attribute) > 85 for own in product.attributes)
        or any(attribute in part for part in text)
    )
    values = list(chosen.values())
    options = sum(1 for _, value in goal.options if any(token_set_ratio(v, value) > 85 for v in values))
    price_ok = product.price <= goal.price_upper
    total = r_type * (attributes + options + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    return RewardBreakdown(r_type=r_type, query_match=query_match, category_match=category_match,
                           title_score=title_score, attributes_matched=attributes, options_matched=options,
                           price_ok=price_ok, total=total)
