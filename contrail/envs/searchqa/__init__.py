"""SearchQA: search-augmented question answering with Search-R1's protocol.

The environment is `SearchQAEnv` (registered as ``searchqa``). Questions are
generated (or loaded) when tasks are first listed; the retrieval index is
built at the first search.
"""

from contrail.envs.searchqa.env import SearchQAEnv

__all__ = ["SearchQAEnv"]
