"""ALFWorld: household tasks on alfworld's real TextWorld engine (AgentGym's presentation).

The environment is `ALFWorldEnv` (registered as ``alfworld``). The engine
(``alfworld``/``textworld``, the ``contrail[alfworld]`` extra) is imported only
when an episode starts: importing this package, building the environment and
listing its tasks never need it.
"""

from contrail.envs.alfworld.env import ALFWorldEnv

__all__ = ["ALFWorldEnv"]
