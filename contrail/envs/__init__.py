"""Environments: the contract (`Env`, `Task`, `Step`) and the registry.

>>> import contrail.envs as envs
>>> envs.names()
['alfworld', 'babyai', 'searchqa', 'textcraft', 'webshop']
>>> env = envs.make("babyai")
"""

from contrail.envs.base import (
    Env,
    Step,
    Task,
    UnknownNameError,
    env_class,
    make,
    names,
    parse_spec,
    register,
)

__all__ = ["Env", "Step", "Task", "UnknownNameError", "env_class", "make", "names", "parse_spec", "register"]
