"""Where contrail keeps what it builds once and reuses (models, indices, games, warm-starts)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """The cache root: ``$CONTRAIL_CACHE``, else ``~/.cache/contrail``."""
    return Path(os.environ.get("CONTRAIL_CACHE") or Path.home() / ".cache" / "contrail")


def environment_cache(name: str, variable: str) -> Path:
    """An environment's own cache folder: ``$variable`` when set, else ``<cache root>/name``."""
    return Path(os.environ.get(variable) or cache_root() / name).expanduser()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold ``<cache>/locks/<name>.lock`` exclusively: one process at a time builds that cache entry.

    Runs sharing a cache (a sweep's shards on one machine, or a cluster's
    shared file system) would otherwise build the same entry at once, into
    the same staging files. Whoever waited finds the entry built and reuses
    it. The lock is an ``flock``: a killed holder releases it.
    """
    path = cache_root() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
