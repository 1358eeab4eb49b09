"""contrail: continual reinforcement learning for LLM agents across environments."""

import os

__version__ = "0.1.0"

# PyTorch puts CPU tensors of 2 MB or more in transparent huge pages when this is set; it reads it once, at its
# first allocation, so it only takes effect when contrail is imported before torch (the `contrail` command is).
# Every fresh KV-cache buffer is otherwise faulted in 4 kB pages: copying a 64-row SmolLM2 cache (2.6 GB in fp32)
# took 1.1 s against 0.4 s with it, and parking stopped decode rows, which copies caches, gained 0.92x with it
# and nothing without (bench/rollout.py (e), a 2-core AMD EPYC). A value the user set is left as it is.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
