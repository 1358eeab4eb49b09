"""Every seed of a run, derived from its one root seed by name.

A run has a single root seed (``Experiment.seed``). Everything random asks
for its own seed by a path of names, so two consumers never share a stream
by accident and adding one never shifts the others:

>>> derive_seed(0, "rollout", 1)          # process 1's rollout sampling
>>> derive_seed(0, "stage", 2, "tasks")   # stage 2's task order
>>> derive_seed(0, "eval")                # evaluation sampling (the same at every stage)

The value is a stable hash (SHA-256), the same on every machine and process,
and fits in 63 bits (a valid seed for torch, numpy and ``random``).
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_SEED", "derive_seed", "check_seed"]

MAX_SEED = 2**63 - 1


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` if it is an integer in [0, 2**63 - 1]; otherwise a ValueError naming ``name``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**63 - 1], got {seed!r}")
    return seed


def derive_seed(root: int, *names: str | int) -> int:
    """The seed named ``names`` under root seed ``root`` (see the module docstring)."""
    check_seed(root, "root seed")
    key = "/".join([str(root), *(str(name) for name in names)])
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1
