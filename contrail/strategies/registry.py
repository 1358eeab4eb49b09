"""Naming strategies: registered names, the ``contrail.strategies`` entry points, ``"pkg.module:Class"``."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from importlib import metadata
from typing import Any

from contrail.envs.base import UnknownNameError
from contrail.strategies.base import Strategy

__all__ = ["ENTRY_POINT_GROUP", "StrategyOptionError", "make", "names", "options", "register", "strategy_class"]

ENTRY_POINT_GROUP = "contrail.strategies"

_REGISTRY: dict[str, type[Strategy]] = {}


class StrategyOptionError(ValueError):
    """An option a strategy does not declare."""


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator registering a strategy under ``name``; a name taken by another class is refused.

    >>> @register("reverse")
    ... @dataclass
    ... class Reverse(Strategy): ...
    """

    def decorate(cls: type[Strategy]) -> type[Strategy]:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register({name!r}) decorates Strategy subclasses, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"strategy name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def names() -> list[str]:
    """Registered strategies and those installed under the ``contrail.strategies`` entry-point group."""
    return sorted(set(_REGISTRY) | {ep.name for ep in _entry_points()})


def strategy_class(name: str) -> type[Strategy]:
    """The class named ``name``: registered, an entry point, or ``"pkg.module:Class"``."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _import_class(name)
    for entry_point in _entry_points():
        if entry_point.name == name:
            return _checked(entry_point.load(), f"entry point {name!r} ({entry_point.value})")
    raise UnknownNameError(f"unknown strategy {name!r}; valid: {', '.join(names())}, or 'pkg.module:Class'")


def options(name: str) -> list[str]:
    """The option names strategy ``name`` accepts (its dataclass fields, or its ``__init__`` keywords)."""
    cls = strategy_class(name)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def make(name: str, **options_: Any) -> Strategy:
    """Build strategy ``name`` with ``options``; unknown names or options fail with the valid ones.

    >>> make("replay", replay_share=0.5).plan(stream, seed=0)
    >>> make("my_pkg.methods:Distill", alpha=0.5)
    """
    cls = strategy_class(name)
    valid = options(name)
    unknown = sorted(set(options_) - set(valid))
    if unknown:
        raise StrategyOptionError(
            f"unknown option(s) {', '.join(unknown)} for strategy {name!r}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**options_)


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _import_class(spec: str) -> type[Strategy]:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise  # the module exists but one of *its* imports is missing: keep the traceback
        raise UnknownNameError(f"strategy {spec!r}: no module named {module_name!r}") from None
    if not hasattr(module, class_name):
        raise UnknownNameError(f"strategy {spec!r}: module {module_name!r} has no attribute {class_name!r}")
    return _checked(getattr(module, class_name), f"strategy {spec!r}")


def _checked(cls: Any, what: str) -> type[Strategy]:
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise UnknownNameError(f"{what} is {cls!r}, not a contrail.strategies.Strategy subclass")
    return cls
