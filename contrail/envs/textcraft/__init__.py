"""TextCraft: craft a Minecraft item from listed crafting commands (AgentGym's TextCraft).

The environment is `TextCraftEnv` (registered as ``textcraft``); the recipe
tables and the planner behind its expert live in ``contrail.envs.textcraft.recipes``.
"""

from contrail.envs.textcraft.env import TextCraftEnv

__all__ = ["TextCraftEnv"]
