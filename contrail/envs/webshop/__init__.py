"""WebShop: shop a generated catalogue by search and click; graded reward on purchase.

The environment is `WebShopEnv` (registered as ``webshop``). The catalogue and
its search index are built (or loaded from the disk cache) at the first
episode, never when the environment is built or its tasks are listed.
"""

from contrail.envs.webshop.env import WebShopEnv

__all__ = ["WebShopEnv"]
