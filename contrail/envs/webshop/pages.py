"""WebShop pages as the text environment shows them: ``[SEP]``-joined visible text.

WebShop's text mode (``observation_mode="text"``, AgentGym's setting) joins
the visible strings of each HTML page with `` [SEP] ``. The templates put a
hidden instruction block first on every page but the start page, so:

- search:  ``WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search``
- results: ``Instruction: [SEP] <instruction> [SEP] Back to Search [SEP] Page 2
  (Total results: 50) [SEP] < Prev [SEP] Next > [SEP] <asin> [SEP] <title>
  [SEP] $<price> ...`` (10 per page)
- item:    ``Instruction: [SEP] <instruction> [SEP] Back to Search [SEP] < Prev
  [SEP] <option group> [SEP] <value> ... [SEP] <title> [SEP] Price: $x [SEP]
  Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now``
- description / features / reviews: ``Instruction: [SEP] <instruction> [SEP]
  Back to Search [SEP] < Prev [SEP] <content>``

As in WebShop's simple text mode, a chosen option is not marked on the page.
One deliberate difference: ``Next >`` is shown only when a next page exists
(WebShop's template always shows it and serves an empty page past the end).

Clickables are the strings a ``click[...]`` may name on a page, keyed in
lower case (WebShop lower-cases the clicked value).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from contrail.envs.webshop.catalog import Product

SEP = " [SEP] "
RESULTS_PER_PAGE = 10
SUB_PAGES = ("description", "features", "reviews")

BACK_TO_SEARCH = "Back to Search"
PREV = "< Prev"
NEXT = "Next >"
BUY_NOW = "Buy Now"


@dataclass
class View:
    """Where the shopper is: the page kind and what it needs to be drawn.

    ``kind`` is ``search``, ``results``, ``item``, one of ``SUB_PAGES`` or ``done``.
    """

    kind: str = "search"
    keywords: str = ""
    results: list[str] = field(default_factory=list)  # every hit's ASIN, best first
    page: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)  # group -> chosen value

    def page_asins(self) -> list[str]:
        """The ASINs shown on the current results page."""
        start = (self.page - 1) * RESULTS_PER_PAGE
        return self.results[start:start + RESULTS_PER_PAGE]

    def has_next(self) -> bool:
        return self.page * RESULTS_PER_PAGE < len(self.results)


def price_text(price: float) -> str:
    return f"${price:.2f}"


def render(view: View, instruction: str, products: Mapping[str, Product], score: float | None = None) -> str:
    """The observation text of ``view``."""
    if view.kind == "search":
        return SEP.join(["WebShop", "Instruction:", instruction, "Search"])
    if view.kind == "done":
        return _done_page(view, score)
    head = ["Instruction:", instruction, BACK_TO_SEARCH]
    if view.kind == "results":
        return SEP.join(head + _results_body(view, products))
    product = products[view.asin]
    if view.kind == "item":
        return SEP.join(head + [PREV] + _item_body(product))
    return SEP.join(head + [PREV] + _sub_page_body(view.kind, product))


def _results_body(view: View, products: Mapping[str, Product]) -> list[str]:
    parts = [f"Page {view.page} (Total results: {len(view.results)})"]
    if view.page > 1:
        parts.append(PREV)
    if view.has_next():
        parts.append(NEXT)
    for asin in view.page_asins():
        product = products[asin]
        parts += [asin, product.title, price_text(product.price)]
    return parts


def _item_body(product: Product) -> list[str]:
    parts: list[str] = []
    for group, values in product.options.items():
        parts += [group, *values]
    return parts + [
        product.title, f"Price: {price_text(product.price)}", "Rating: N.A.",
        "Description", "Features", "Reviews", BUY_NOW,
    ]


def _sub_page_body(kind: str, product: Product) -> list[str]:
    if kind == "description":
        return [product.description]
    if kind == "features":
        return list(product.features)
    if not product.reviews:
        return ["No reviews found"]
    parts: list[str] = []
    for title, score, body in product.reviews:
        parts += [f'"{title}"', str(score), body]
    return parts


def _done_page(view: View, score: float | None) -> str:
    options = ", ".join(f"{group}: {value}" for group, value in view.options.items()) or "none"
    return SEP.join([
        "Thank you for shopping with us!", "Purchased", "asin", view.asin or "",
        "options", options, "Your score (min 0.0, max 1.0)", f"{score or 0.0:.2f}",
    ])


class Clickable(NamedTuple):
    """One clickable: the text shown, what clicking does, and its argument."""

    label: str
    effect: str  # back_to_search, prev_page, next_page, open, back, option, sub_page, buy
    target: str = ""  # the ASIN, sub-page or option group
    value: str = ""  # the option value


def clickables(view: View, products: Mapping[str, Product]) -> dict[str, Clickable]:
    """What ``click[...]`` may name on ``view``, keyed by the lower-cased text, in page order."""
    if view.kind in ("search", "done"):
        return {}  # the start page has only the search box (click[search] does nothing in WebShop)
    found = {BACK_TO_SEARCH.lower(): Clickable(BACK_TO_SEARCH, "back_to_search")}
    if view.kind == "results":
        if view.page > 1:
            found[PREV.lower()] = Clickable(PREV, "prev_page")
        if view.has_next():
            found[NEXT.lower()] = Clickable(NEXT, "next_page")
        for asin in view.page_asins():
            found[asin.lower()] = Clickable(asin, "open", asin)
        return found
    found[PREV.lower()] = Clickable(PREV, "back")
    if view.kind == "item":
        for group, values in products[view.asin].options.items():
            for value in values:
                found[value.lower()] = Clickable(value, "option", group, value)
        for sub_page in SUB_PAGES:
            found[sub_page] = Clickable(sub_page.capitalize(), "sub_page", sub_page)
        found[BUY_NOW.lower()] = Clickable(BUY_NOW, "buy")
    return found
