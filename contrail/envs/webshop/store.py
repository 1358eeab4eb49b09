"""The shop as a process-wide resource: catalogue, ASIN lookup and search index.

A batched rollout builds one environment per live episode, so the catalogue
and the BM25 index are built once per process and seed (``get_shop``) and
shared. They are also kept on disk, under
``<cache root>/<CATALOG_VERSION>-<seed>-<fingerprint>/`` where the root is
``$CONTRAIL_WEBSHOP_CACHE`` or ``~/.cache/contrail/webshop``; the fingerprint
digests the generator's vocabulary, so editing it never serves a stale shop.
A damaged cache entry is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from contrail.envs.webshop.catalog import CATALOG_VERSION, Product, build_catalog, spec_fingerprint
from contrail.envs.webshop.search import ProductSearch
from contrail.paths import environment_cache

CACHE_ENV_VAR = "CONTRAIL_WEBSHOP_CACHE"
_CATALOG_FILE = "catalog.json"


@dataclass
class Shop:
    """A catalogue with its ASIN lookup and search index."""

    seed: int
    products: list[Product]
    search: ProductSearch
    by_asin: dict[str, Product] = field(init=False)

    def __post_init__(self) -> None:
        self.by_asin = {p.asin: p for p in self.products}


_SHOPS: dict[tuple[int, str | None], Shop] = {}
_LOCK = threading.Lock()


def default_cache_root() -> Path:
    """Where shops are kept on disk unless told otherwise."""
    return environment_cache("webshop", CACHE_ENV_VAR)


def get_shop(seed: int = 0, cache_dir: str | os.PathLike | None = None, disk_cache: bool = True) -> Shop:
    """The shop of ``seed``, built at most once per process (and once per disk cache)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    key = (seed, str(root) if disk_cache else None)
    with _LOCK:
        if key not in _SHOPS:
            _SHOPS[key] = _load_or_build(seed, root) if disk_cache else build_shop(seed)
        return _SHOPS[key]


def forget_shops() -> None:
    """Drop every shop this process holds (the disk cache stays)."""
    with _LOCK:
        _SHOPS.clear()


def build_shop(seed: int) -> Shop:
    """Generate the catalogue and index it (no cache involved)."""
    products = build_catalog(seed)
    return Shop(seed=seed, products=products, search=ProductSearch(products))


def cache_path(seed: int, root: Path) -> Path:
    """The directory that holds the shop of ``seed`` under ``root``."""
    return root / f"{CATALOG_VERSION}-{seed}-{spec_fingerprint()}"


def _load_or_build(seed: int, root: Path) -> Shop:
    directory = cache_path(seed, root)
    if directory.is_dir():
        try:
            return _read(seed, directory)
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(directory, ignore_errors=True)  # damaged: rebuild below
    shop = build_shop(seed)
    try:
        _write(shop, directory)
    except OSError:
        pass  # a read-only home still gets a working shop, just no disk cache
    return shop


def _read(seed: int, directory: Path) -> Shop:
    records = json.loads((directory / _CATALOG_FILE).read_text(encoding="utf-8"))
    products = [Product.from_dict(record) for record in records]
    return Shop(seed=seed, products=products, search=ProductSearch.load(directory / "index", products))


def _write(shop: Shop, directory: Path) -> None:
    """Write into a temporary sibling, then rename: readers never see half a cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory.parent))
    try:
        records = [p.to_dict() for p in shop.products]
        (staging / _CATALOG_FILE).write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
        shop.search.save(staging / "index")
        os.replace(staging, directory)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not directory.is_dir():
            raise
