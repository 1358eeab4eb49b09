"""Where contrail keeps what it builds once and reuses (models, indices, games, warm-starts)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache root: ``$CONTRAIL_CACHE``, else ``~/.cache/contrail``."""
    return Path(os.environ.get("CONTRAIL_CACHE") or Path.home() / ".cache" / "contrail")
