"""Environments: the contract (`Env`, `Task`, `Step`), the registry and declared options.

>>> import contrail.envs as envs
>>> envs.names()
['alfworld', 'babyai', 'searchqa', 'textcraft', 'webshop']
>>> env = envs.make("textcraft", max_turns=20)
>>> envs.check_options("textcraft", {"bogus": 1})
Traceback (most recent call last):
EnvOptionError: unknown option 'bogus' for textcraft; valid: max_turns, data_dir, max_distractors

Each built-in environment is a package (``contrail.envs.textcraft``, ...)
imported on first use, so importing ``contrail.envs`` needs no optional extra.
"""

from contrail.envs.base import (
    Env,
    EnvOptionError,
    EpisodeOver,
    Step,
    Task,
    UnknownNameError,
    check_options,
    env_class,
    make,
    names,
    options,
    parse_spec,
    register,
    registered,
    unregister,
)

__all__ = [
    "Env",
    "EnvOptionError",
    "EpisodeOver",
    "Step",
    "Task",
    "UnknownNameError",
    "check_options",
    "env_class",
    "make",
    "names",
    "options",
    "parse_spec",
    "register",
    "registered",
    "unregister",
]
