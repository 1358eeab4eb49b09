"""Declared environment options: the annotated keyword parameters of an ``__init__``.

An environment declares its options by its constructor's signature, nothing
else: ``def __init__(self, max_turns: int | None = None, data_dir: str | Path | None = None)``
declares ``max_turns`` (an int or None) and ``data_dir`` (a path or None). A
stream's ``env_options`` are checked against that signature before anything
is built, so a typo or a wrong type is one clear line, not a traceback from
deep inside the environment.
"""

from __future__ import annotations

import collections.abc as abc
import inspect
import os
import types
import typing
from pathlib import PurePath
from typing import Any, Callable, Literal, Union


def declared_options(factory: Callable[..., Any]) -> dict[str, Any]:
    """``{option: annotation}`` for every keyword parameter of ``factory``'s constructor.

    ``factory`` is an environment class (its ``__init__`` is read) or a plain
    callable. Unannotated parameters map to ``Any``; ``*args``/``**kwargs`` are
    not options.
    """
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError, AttributeError):  # an annotation that does not evaluate: "anything"
        hints = {}
    found: dict[str, Any] = {}
    for index, (name, parameter) in enumerate(inspect.signature(target).parameters.items()):
        if isinstance(factory, type) and index == 0:
            continue  # self
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            found[name] = hints.get(name, Any)
    return found


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (the shapes options use)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, arm) for arm in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple, set, frozenset, abc.Sequence, abc.Set, abc.Collection, abc.Iterable):
        return isinstance(value, (list, tuple)) and _items_conform(value, typing.get_args(hint))
    if origin in (dict, abc.Mapping):
        return isinstance(value, dict) and _mapping_conforms(value, typing.get_args(hint))
    if isinstance(origin, type):
        return isinstance(value, origin)
    return _conforms_class(value, hint)


def _mapping_conforms(mapping: dict, args: tuple) -> bool:
    if len(args) != 2:
        return True
    return all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in mapping.items())


def _items_conform(items: Any, args: tuple) -> bool:
    if not args:
        return True
    element = args[0] if len(args) == 1 or args[-1] is Ellipsis else None
    if element is None:  # tuple[int, str]: a fixed shape
        return len(items) == len(args) and all(conforms(v, a) for v, a in zip(items, args))
    return all(conforms(v, element) for v in items)


def _conforms_class(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # YAML writes 1 for 1.0
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, (PurePath, os.PathLike)):
        return isinstance(value, (str, os.PathLike))  # a path option takes a string from YAML
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation we cannot check (a TypeVar, a string): accept


def describe(hint: Any) -> str:
    """A short human name for an annotation: ``int or None``, ``path``, ``one of 'a', 'b'``."""
    if hint is Any:
        return "anything"
    if hint is None or hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        names = list(dict.fromkeys(describe(arm) for arm in typing.get_args(hint)))
        if "path" in names and "str" in names:
            names.remove("str")  # a path option takes a string anyway
        return " or ".join(names)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if origin in (list, tuple, set, frozenset, abc.Sequence, abc.Set, abc.Collection, abc.Iterable):
        return "list"
    if origin in (dict, abc.Mapping):
        return "mapping"
    if origin is not None:
        return getattr(origin, "__name__", str(hint))
    if isinstance(hint, type) and issubclass(hint, (PurePath, os.PathLike)):
        return "path"
    return getattr(hint, "__name__", str(hint))
