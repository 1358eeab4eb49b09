"""BM25 product search for the WebShop catalogue (``bm25s``).

WebShop searches its products with Pyserini/Lucene over title, description
and bullet points, and shows the top 50 hits. Here ``bm25s`` indexes each
product's title, category, description and features; a query returns the
ASINs of at most ``MAX_RESULTS`` products with a positive score, best first
(ties broken by catalogue order, so results are deterministic).

Tokens: ``normalize``d words minus English stop words, with a light plural
stemmer (``shoes`` and ``shoe`` meet) since no Snowball stemmer is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import bm25s
import numpy as np

from contrail.envs.webshop.catalog import Product
from contrail.envs.webshop.reward import normalize

MAX_RESULTS = 50

_STOP_WORDS = frozenset(
    "a an and are as at be but by for from has have i in is it its made me my need of on or "
    "our so that the this to was we with you your".split()
)


def stem(word: str) -> str:
    """A light plural stemmer: ``batteries -> battery``, ``boxes -> box``, ``shoes -> shoe``."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "sses", "xes", "zes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def tokenize(text: str) -> list[str]:
    """Search tokens of ``text``."""
    return [stem(w) for w in normalize(text).split() if w not in _STOP_WORDS]


def document_text(product: Product) -> str:
    """The text of ``product`` that search sees."""
    return " ".join([product.title, product.category.replace("›", " "), product.description, *product.features])


class ProductSearch:
    """A BM25 index over a catalogue, answering keyword queries with ASINs."""

    def __init__(self, products: Sequence[Product], retriever: bm25s.BM25 | None = None) -> None:
        self._asins = [p.asin for p in products]
        if retriever is None:
            retriever = bm25s.BM25()
            retriever.index([tokenize(document_text(p)) for p in products], show_progress=False)
        self.retriever = retriever
        self._vocabulary = retriever.vocab_dict

    def search(self, keywords: str, limit: int = MAX_RESULTS) -> list[str]:
        """ASINs of the best ``limit`` products for ``keywords`` (none for unknown words)."""
        tokens = [t for t in tokenize(keywords) if t in self._vocabulary]
        if not tokens:
            return []
        scores = self.retriever.get_scores(tokens)
        order = np.argsort(-scores, kind="stable")[:limit]
        return [self._asins[i] for i in order if scores[i] > 0]

    def save(self, directory: Path) -> None:
        """Write the index under ``directory``."""
        self.retriever.save(str(directory), show_progress=False)

    @classmethod
    def load(cls, directory: Path, products: Sequence[Product]) -> "ProductSearch":
        """Read an index written by ``save`` for the same ``products``."""
        retriever = bm25s.BM25.load(str(directory), load_vocab=True, show_progress=False)
        return cls(products, retriever)
