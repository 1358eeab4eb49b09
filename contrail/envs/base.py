"""The environment contract: `Task`, `Step`, `Env` with its episode lifecycle, and the registry.

An environment knows nothing about models. It turns a task id into a first
observation, turns the raw text a model wrote into the next observation, and
can say what a competent agent would write next (`expert`).

The base class owns the episode lifecycle so that every environment keeps the
same rules (see ENVIRONMENTS.md); subclasses fill small hooks:

- `Env.reset` checks the task, starts the turn count and calls ``on_reset``;
- `Env.step` refuses a step before ``reset`` (`RuntimeError`) and after the
  episode ended (`EpisodeOver`), decodes ``bytes``, counts the turn, calls
  ``on_step`` and ends the episode at its turn limit;
- ``on_step`` receives the model's raw output and never raises on bad text:
  invalid or unparsable output returns the environment's own error
  observation with reward 0 and ``valid=False``.
- Rewards are terminal: the episode's reward is the last step's reward.
- Task ids are deterministic and the train and test ids never overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import random
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Callable, ClassVar, Iterator, final

from contrail.envs.options import conforms, declared_options, describe

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


@dataclass(kw_only=True)
class Step:
    """What the environment answers to one model output (keyword arguments only).

    ``valid`` is False when the output was not a valid action (it feeds the
    invalid-action rate); ``success`` is True on the step that solves the task
    (BabyAI's step-scaled reward is below 1 even on success, so success cannot
    be read off the reward). ``done`` is True on the last step of the episode,
    whatever ended it (solved, failed, or the turn limit, which sets
    ``info["turn_limit"]``).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    success: bool = False
    valid: bool = True
    info: dict[str, Any] = field(default_factory=dict)


class UnknownNameError(ValueError):
    """An unknown environment, difficulty, strategy or preset name."""


class EnvOptionError(ValueError):
    """An environment option that the environment does not declare, or of the wrong type."""


class EpisodeOver(RuntimeError):
    """``step()`` after the episode ended (a done step or the turn limit); call ``reset`` first."""


class Env(ABC):
    """Base class of every environment; it owns the episode lifecycle.

    Subclasses set ``difficulties`` and ``default_max_turns`` (``name`` is set
    by `register`), and implement the hooks ``instruction``, ``tasks``,
    ``on_reset``, ``on_step`` and ``expert`` (optionally ``random_action``,
    ``close``, ``turn_limit``). `reset` and `step` are final: the guards, the
    turn count (``self.turns``), ``self.task`` and ``self.done`` live here.

    The keyword parameters of ``__init__``, annotated, are the environment's
    declared options (`check_options`). Constructors and ``tasks()`` never
    start an engine: heavy state is built at the first ``reset``. One
    instance plays one episode at a time; a batched rollout makes one
    instance per live episode, so heavy shared data (indices, recipe tables)
    belongs in a module-level cache, not in ``__init__``.
    """

    name: ClassVar[str]
    difficulties: ClassVar[tuple[str, ...]] = ()
    default_max_turns: ClassVar[int] = 30
    acknowledgement: ClassVar[str] = "OK. I'll follow your instructions and try my best to solve the task."
    # Whether an episode may wait, reset but not yet played, at little cost: evaluation starts a few
    # batches' episodes ahead to batch them by opening length (`contrail.evaluation`). An environment
    # whose every live episode holds a scarce resource (ALFWorld: a planner library) says False.
    cheap_to_hold: ClassVar[bool] = True

    # Episode state, owned by `reset`/`step` (class defaults: valid before the first reset).
    task: Task | None = None
    turns: int = 0
    done: bool = False
    episode_turn_limit: int = 0

    def __init__(self, max_turns: int | None = None) -> None:
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise EnvOptionError(f"option max_turns of {self._label()}: expected an int >= 1, got {max_turns!r}")
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

    # --- tasks -----------------------------------------------------------
    @abstractmethod
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        """All tasks of ``split`` (``train``/``test``), optionally of one difficulty."""

    # --- the lifecycle (final) ---------------------------------------------
    @final
    def reset(self, task: Task, *, turn_limit: int | None = None) -> str:
        """Start ``task``; return the first observation.

        ``turn_limit`` overrides ``self.turn_limit(task)`` for this episode
        (a rollout's ``max_turns``). A task of another environment is a
        ValueError, anything but a `Task` a TypeError.
        """
        if not isinstance(task, Task):
            raise TypeError(f"{self._label()}: reset expects a Task, got {type(task).__name__}")
        own = getattr(self, "name", None)
        if own is not None and task.env != own:
            raise ValueError(f"task belongs to environment {task.env!r}, not {own!r}: {task}")
        limit = self.turn_limit(task) if turn_limit is None else turn_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{self._label()}: turn_limit must be an int >= 1, got {limit!r}")
        self.task, self.turns, self.done, self.episode_turn_limit = None, 0, False, limit
        observation = self.on_reset(task)
        self.task = task  # only once the hook succeeded: a failed reset leaves no episode to step
        return observation

    @final
    def step(self, text: str | bytes) -> Step:
        """Apply the model's raw output ``text`` (``str``, or ``bytes`` decoded as UTF-8).

        Never raises on bad text. Raises `RuntimeError` before `reset`,
        `EpisodeOver` after the episode ended, `TypeError` for anything that
        is not text. The step that reaches the turn limit is returned with
        ``done=True`` and ``info["turn_limit"] = True``.
        """
        self.require_episode("step()")
        text = as_text(text)
        self.turns += 1
        result = self.on_step(text)
        if not isinstance(result, Step):
            raise TypeError(f"{type(self).__name__}.on_step returned {type(result).__name__}, not a Step")
        if not result.done and self.turns >= self.episode_turn_limit:
            result = dataclasses.replace(result, done=True, info={**result.info, "turn_limit": True})
        self.done = result.done
        return result

    def require_episode(self, what: str = "this") -> None:
        """Raise unless an episode is live: before `reset` a RuntimeError, after its end `EpisodeOver`.

        ``expert`` and ``random_action`` call it too, so every entry point keeps one rule.
        """
        if self.task is None:
            raise RuntimeError(f"{self._label()}: call reset(task) before {what}")
        if self.done:
            raise EpisodeOver(
                f"{self._label()}: the episode of task {self.task.id} is over after {self.turns} turns; "
                "call reset(task) to play again"
            )

    # --- hooks -------------------------------------------------------------
    def on_reset(self, task: Task) -> str:
        """Start the episode of ``task`` (already checked); return the first observation."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_reset(task)")

    def on_step(self, text: str) -> Step:
        """Apply the model's raw output; never raises on bad text (the base counts the turn)."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_step(text)")

    @abstractmethod
    def expert(self) -> str:
        """What a competent agent would write now, in the environment's format."""

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random *valid* action as full model text (a baseline).

        Environments that can enumerate their valid actions override this.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define random valid actions")

    def close(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing to release
        """Release resources held by the current episode."""

    # --- helpers for subclasses -------------------------------------------
    def check_split(self, split: str, difficulty: str | None = None) -> None:
        """Raise a clear error for an unknown split or difficulty."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if difficulty is not None and difficulty not in self.difficulties:
            raise ValueError(
                f"unknown difficulty {difficulty!r} for {self._label()}; valid: {', '.join(self.difficulties)}"
            )

    def _label(self) -> str:
        return getattr(self, "name", type(self).__name__)


def as_text(text: Any) -> str:
    """Model output as ``str``: ``bytes`` decoded as UTF-8 (bad bytes replaced), else a TypeError."""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray)):
        return bytes(text).decode("utf-8", errors="replace")
    raise TypeError(f"step() expects the model's text as str or bytes, got {type(text).__name__}")


# --- registry ------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Env]] = {}
_BUILTIN_MODULES = {
    "babyai": "contrail.envs.babyai",
    "textcraft": "contrail.envs.textcraft",
    "alfworld": "contrail.envs.alfworld",
    "webshop": "contrail.envs.webshop",
    "searchqa": "contrail.envs.searchqa",
}
# Parametrised specs "<family>:<parameter>" (e.g. "agentgym:webshop@http://host:port"): a family
# turns the parameter into an Env class, registered under the whole spec so tasks find it again.
_FAMILIES: dict[str, Callable[[str], type[Env]]] = {}
_BUILTIN_FAMILIES = {"agentgym": "contrail.envs.agentgym"}


def register(name: str) -> Callable[[type[Env]], type[Env]]:
    """Class decorator that registers an environment under ``name`` and sets ``cls.name``.

    A name already taken by another class, a built-in name claimed from
    outside its package, or a class already registered under another name is
    a ValueError (subclass the class to register it twice).

    >>> @register("echo")
    ... class EchoEnv(Env): ...
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ValueError(f"environment name must be a non-empty string without ':' or surrounding spaces, got {name!r}")

    def decorate(cls: type[Env]) -> type[Env]:
        _add(name, cls)
        return cls

    return decorate


def _add(name: str, cls: Callable[..., Env]) -> None:
    existing = _REGISTRY.get(name)
    if existing is cls:
        return  # the same class again (its module imported twice): nothing to do
    builtin = _BUILTIN_MODULES.get(name)
    if builtin is not None and not getattr(cls, "__module__", "").startswith(builtin):
        raise ValueError(f"environment name {name!r} is reserved for the built-in {builtin}; choose another name")
    if existing is not None:
        raise ValueError(
            f"environment name {name!r} is already registered by {_qualname(existing)}; "
            f"choose another name (or unregister({name!r}) first)"
        )
    other = next((key for key, value in _REGISTRY.items() if value is cls), None)
    if other is not None:
        raise ValueError(f"{_qualname(cls)} is already registered as {other!r}; register a subclass under {name!r}")
    if isinstance(cls, type):
        cls.name = name
    _REGISTRY[name] = cls


def unregister(name: str) -> Callable[..., Env]:
    """Remove the registration of ``name`` (tests, interactive sessions); returns the class."""
    if name not in _REGISTRY:
        raise UnknownNameError(f"environment {name!r} is not registered; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY.pop(name)


@contextlib.contextmanager
def registered(name: str, cls: type[Env]) -> Iterator[type[Env]]:
    """Register ``cls`` as ``name`` for the ``with`` block only (a test's stand-in environment)."""
    register(name)(cls)
    try:
        yield cls
    finally:
        if _REGISTRY.get(name) is cls:
            unregister(name)


def register_family(prefix: str, resolve: Callable[[str], type[Env]]) -> None:
    """Let ``"<prefix>:<parameter>"`` name an environment: ``resolve(parameter)`` returns its class.

    The class is registered under the whole spec (so a task's ``env`` field
    builds it again); such specs take no difficulty suffix.
    """
    _FAMILIES[prefix] = resolve


def _family_of(name: str) -> str | None:
    prefix, sep, _ = name.partition(":")
    if not sep:
        return None
    if prefix not in _FAMILIES and prefix in _BUILTIN_FAMILIES:
        importlib.import_module(_BUILTIN_FAMILIES[prefix])
    return prefix if prefix in _FAMILIES else None


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _load_entry_points() -> None:
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in _REGISTRY:
            _add(entry.name, entry.load())


def names() -> list[str]:
    """Names of every available environment (built-in, registered, entry points)."""
    _load_entry_points()
    return sorted(set(_BUILTIN_MODULES) | set(_REGISTRY))


def is_class_path(name: str) -> bool:
    """Whether ``name`` is a ``"pkg.module:Class"`` path rather than a registered name."""
    module, sep, attribute = name.partition(":")
    return bool(sep) and "." in module and attribute.isidentifier()


def env_class(name: str) -> Callable[..., Env]:
    """The class registered under ``name``; imports built-ins lazily.

    ``name`` may also be ``"pkg.module:Class"``: the module is imported and the
    class, if its module did not register it, is registered under that path.
    """
    if is_class_path(name):
        return _load_class(name)
    family = _family_of(name) if name not in _REGISTRY else None
    if family is not None:
        _add(name, _FAMILIES[family](name.partition(":")[2]))
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise UnknownNameError(
            f"unknown environment {name!r}; valid: {', '.join(names())} (or 'pkg.module:Class')"
        )
    return _REGISTRY[name]


def _load_class(path: str) -> type[Env]:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UnknownNameError(f"environment {path!r}: cannot import module {module_name!r} ({error})") from None
    cls = getattr(module, attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise UnknownNameError(f"environment {path!r}: {module_name} has no Env subclass named {attribute!r}")
    if not any(value is cls for value in _REGISTRY.values()):
        _add(path, cls)  # Task.env is then the path, so make(task.env) finds the class again
    return cls


def options(name: str) -> list[str]:
    """The options the environment ``name`` declares (its constructor's keyword parameters)."""
    return list(declared_options(env_class(name)))


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate ``options`` against the declared options of ``name``; returns them as a dict.

    Raises `EnvOptionError` naming the option and listing the valid ones, or
    naming the expected type.
    """
    declared = declared_options(env_class(name))
    for key, value in dict(options).items():
        if key not in declared:
            valid = ", ".join(declared) or "(none)"
            raise EnvOptionError(f"unknown option {key!r} for {name}; valid: {valid}")
        if not conforms(value, declared[key]):
            raise EnvOptionError(f"option {key} of {name}: expected {describe(declared[key])}, got {value!r}")
    return dict(options)


def make(name: str, **options: Any) -> Env:
    """Build the environment ``name`` with ``options``, checked by `check_options` first."""
    cls = env_class(name)
    return cls(**check_options(name, options))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"textcraft:easy"`` into ``("textcraft", "easy")``; validate both names.

    ``"pkg.module:Class:hard"`` names a user class with a difficulty; the
    returned name is the class's registered name (what its tasks carry).
    """
    head, _, rest = spec.partition(":")
    if _family_of(spec) is not None:
        return env_class(spec).name, None
    if is_class_path(spec) or is_class_path(f"{head}:{rest.partition(':')[0]}"):
        attribute, _, difficulty = rest.partition(":")
        cls = env_class(f"{head}:{attribute}")
        name = cls.name
    else:
        name, difficulty = head, rest
        cls = env_class(name)
    difficulty = difficulty or None
    levels = getattr(cls, "difficulties", ())
    if difficulty is not None and difficulty not in levels:
        raise UnknownNameError(
            f"unknown difficulty {difficulty!r} for {name}; valid: {', '.join(levels) or '(none)'}"
        )
    return name, difficulty
