"""The environment contract: `Task`, `Step`, `Env`, and the registry.

An environment knows nothing about models. It turns a task id into a first
observation, turns the raw text a model wrote into the next observation, and
can say what a competent agent would write next (`expert`).

Contract rules every environment keeps (see ENVIRONMENTS.md):
- `step(text)` receives the model's raw output and never raises on bad text:
  invalid or unparsable output returns the environment's own error
  observation with reward 0 and ``valid=False``.
- Rewards are terminal: the episode's reward is the last step's reward.
- Task ids are deterministic and the train and test ids never overlap.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Callable, ClassVar

SPLITS = ("train", "test")
ENTRY_POINT_GROUP = "contrail.envs"


@dataclass(frozen=True)
class Task:
    """One task of one environment, addressed by an integer id.

    The same ``(env, id)`` is the same task on any machine. ``difficulty`` is
    one of the environment's declared levels.
    """

    env: str
    id: int
    split: str
    difficulty: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Task":
        return cls(env=data["env"], id=int(data["id"]), split=data["split"], difficulty=data["difficulty"])


@dataclass
class Step:
    """What the environment answers to one model output.

    ``valid`` is False when the output was not a valid action (it feeds the
    invalid-action rate); ``success`` is True on the step that solves the task
    (BabyAI's step-scaled reward is below 1 even on success, so success cannot
    be read off the reward).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    success: bool = False
    valid: bool = True
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Base class of every environment.

    Subclasses set ``name``, ``difficulties`` and ``default_max_turns`` and
    implement ``instruction``, ``tasks``, ``reset``, ``step`` and ``expert``.
    One instance plays one episode at a time; a batched rollout makes one
    instance per live episode, so heavy shared data (indices, recipe tables)
    belongs in a module-level cache, not in ``__init__``.
    """

    name: ClassVar[str]
    difficulties: ClassVar[tuple[str, ...]]
    default_max_turns: ClassVar[int] = 30
    acknowledgement: ClassVar[str] = "OK. I'll follow your instructions and try my best to solve the task."

    def __init__(self, max_turns: int | None = None) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns or self.default_max_turns

    # --- the conversation ------------------------------------------------
    @abstractmethod
    def instruction(self) -> str:
        """The first user turn: how to act, the action format, an example."""

    def prompt_messages(self) -> list[dict[str, str]]:
        """Chat messages that precede the first observation (AgentGym's layout):
        user = instruction, assistant = a short acknowledgement."""
        return [
            {"role": "user", "content": self.instruction()},
            {"role": "assistant", "content": self.acknowledgement},
        ]

    def turn_limit(self, task: Task) -> int:
        """Maximum number of model turns for ``task`` (SearchQA differs by split)."""
        return self.max_turns

    # --- tasks and episodes ----------------------------------------------
    @abstractmethod
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        """All tasks of ``split`` (``train``/``test``), optionally of one difficulty."""

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Start ``task``; return the first observation."""

    @abstractmethod
    def step(self, text: str) -> Step:
        """Apply the model's raw output ``text``; never raises on bad text."""

    @abstractmethod
    def expert(self) -> str:
        """What a competent agent would write now, in the environment's format."""

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random *valid* action as full model text (a baseline).

        Environments that can enumerate their valid actions override this.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define random valid actions")

    def close(self) -> None:
        """Release resources held by the current episode."""

    # --- helpers for subclasses -------------------------------------------
    def check_split(self, split: str, difficulty: str | None = None) -> None:
        """Raise a clear error for an unknown split or difficulty."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if difficulty is not None and difficulty not in self.difficulties:
            raise ValueError(
                f"unknown difficulty {difficulty!r} for {self.name}; valid: {', '.join(self.difficulties)}"
            )


# --- registry ------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Env]] = {}
_BUILTIN_MODULES = {
    "babyai": "contrail.envs.babyai",
    "textcraft": "contrail.envs.textcraft",
    "alfworld": "contrail.envs.alfworld",
    "webshop": "contrail.envs.webshop",
    "searchqa": "contrail.envs.searchqa",
}


class UnknownNameError(ValueError):
    """An unknown environment, difficulty, strategy or preset name."""


def register(name: str) -> Callable[[type[Env]], type[Env]]:
    """Class decorator that registers a user environment under ``name``.

    >>> @register("echo")
    ... class Echo(Env): ...
    """

    def decorate(cls: type[Env]) -> type[Env]:
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load_entry_points() -> None:
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in _REGISTRY:
            _REGISTRY[entry.name] = entry.load()


def names() -> list[str]:
    """Names of every available environment (built-in, registered, entry points)."""
    _load_entry_points()
    return sorted(set(_BUILTIN_MODULES) | set(_REGISTRY))


def env_class(name: str) -> Callable[..., Env]:
    """The class (or factory) registered under ``name``; imports built-ins lazily."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        import importlib

        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise UnknownNameError(f"unknown environment {name!r}; valid: {', '.join(names())}")
    return _REGISTRY[name]


def make(name: str, **options: Any) -> Env:
    """Build the environment registered under ``name`` with ``options``."""
    return env_class(name)(**options)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"textcraft:easy"`` into ``("textcraft", "easy")``; validate both names."""
    name, _, difficulty = spec.partition(":")
    cls = env_class(name)
    difficulty = difficulty or None
    levels = getattr(cls, "difficulties", ())
    if difficulty is not None and difficulty not in levels:
        raise UnknownNameError(
            f"unknown difficulty {difficulty!r} for {name}; valid: {', '.join(levels)}"
        )
    return name, difficulty
