"""The `Experiment`: one typed value from a YAML file (or Python) to the runner.

An experiment file is a mapping of these sections::

    name: quickstart                 # default: the file's stem
    out: runs/${name}                # omegaconf interpolation works anywhere
    seed: 0                          # or seeds: [0, 1, 2] (one run per seed)
    orders: all                      # optional: every permutation of stream.train, or a list of orders
    model: {name: smollm2-135m, warmstart: {envs: [babyai:easy], episodes: 60}}
    stream: quickstart               # a preset (streams/quickstart.yaml) ...
    strategy: {name: replay, options: {replay_share: 0.5}}   # ... or a mapping
    rollout: {max_new_tokens: 48, max_turns: 4}              # RolloutConfig: training and evaluation
    grpo: {lr: 1.0e-6, group_size: 8}                        # GRPOConfig fields
    eval: {k: 4, temperature: 0.7}   # evaluation overrides only what differs from rollout

``stream`` and ``strategy`` accept a preset name, a mapping, or a mapping with
``preset: NAME`` plus fields that override the preset's (presets are found
along a search path, see `contrail.presets`); ``strategy`` also accepts a
registered strategy's name (built in, or from the ``contrail.strategies``
entry-point group) or ``"pkg.module:Class"``. ``model`` accepts a bare model
name. Overrides are dotted ``key=value`` pairs whose values are YAML
(``grpo.lr=1e-6``, ``strategy=replay``, ``stream.train=[babyai:easy,textcraft:easy]``).

The file is read into plain containers, presets are expanded and overrides
applied (remembering where every key came from), then omegaconf's structured
configs check the keys and types against the dataclasses below, the
dataclasses' ``__post_init__`` check ranges and choices, and `Experiment.check`
checks what depends on the registries and the machine (environments and their
options, the strategy and its options, the device). Every mistake raises
`ConfigError` naming the file (or the override) and the key::

    exp.yaml: rollout.top_p: must be in (0, 1], got 1.5
    override 'grpo.lr=nan': grpo.lr: must be a finite number, got nan
    exp.yaml: stream.env_options.textcraft.bogus: unknown option 'bogus' for textcraft; valid: max_turns, ...

>>> exp = load_experiment("experiments/quickstart.yaml", ["grpo.lr=1e-5"])
>>> Experiment.from_yaml(exp.to_yaml()) == exp
True
>>> runs = expand_runs(exp)          # one Experiment per (order, seed)
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contrail import envs, presets, strategies
from contrail.agent.rollout import RolloutConfig
from contrail.envs.base import UnknownNameError
from contrail.grpo.config import GRPOConfig
from contrail.integrations.trackers import TrackingSpec
from contrail.models import check_device, check_device_name
from contrail.precision import PRECISIONS, Precision
from contrail.seeds import check_seed
from contrail.strategies import Strategy
from contrail.stream import Experience, Stream

T = TypeVar("T")  # any item of a list of runs (`shard`)

__all__ = [
    "ConfigError",
    "EnvUnavailableError",
    "EvalSpec",
    "Experiment",
    "ModelSpec",
    "StrategySpec",
    "StreamSpec",
    "ShardError",
    "WarmStart",
    "build_strategy",
    "build_stream",
    "describe_plan",
    "expand_runs",
    "load_experiment",
    "order_label",
    "parse_shard",
    "run_label",
    "shard",
]


class ConfigError(ValueError):
    """A mistake in an experiment: ``<file or override>: <key>: <problem>; valid: ...``."""


class EnvUnavailableError(ConfigError):
    """An experiment names an environment that exists but cannot be loaded here (a missing optional extra)."""


class ShardError(ConfigError):
    """A ``--shard`` value that is not ``i/n`` with ``0 <= i < n``."""


# --- the typed sections -------------------------------------------------------------------


@dataclass
class WarmStart:
    """Behaviour cloning on expert episodes before GRPO (a small model cannot write the formats yet).

    ``episodes`` expert episodes in all, split evenly over ``envs`` (training
    tasks only); the demonstrations' seed is derived from the experiment's seed.
    This is the one warm-start type: ``contrail run`` and ``contrail train
    --warmstart-episodes`` both build it, and the warm-start code reads it.
    """

    envs: list[str]
    episodes: int = 100
    epochs: int = 2
    lr: float = 1e-4
    max_episode_tokens: int = 2048
    batch_size: int = 8
    precision: Precision = "auto"  # bf16 where the device has bf16 matrix units (`contrail.precision`)

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("envs must name at least one environment spec (e.g. [babyai:easy])")
        _specs(self, "envs")
        _choice(self, "precision", PRECISIONS)
        _at_least(self, 1, "episodes", "epochs", "max_episode_tokens", "batch_size")
        _finite_positive(self, "lr")


@dataclass
class ModelSpec:
    """The starting model: a Hugging Face id, a local path or ``smollm2-135m``; optional warm-start.

    ``device``: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``,
    ``cuda:N`` or ``mps``; whether this machine has it is checked by `Experiment.check`.
    """

    name: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    warmstart: WarmStart | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must name a model (an HF id, a local path or smollm2-135m)")
        _choice(self, "dtype", ("float32", "bfloat16", "float16"))
        try:
            check_device_name(self.device)
        except ValueError as error:
            raise ValueError(f"device: {error}") from None


@dataclass
class StreamSpec:
    """Experiences to train (in order) and to test; ``test`` empty = the training ones.

    ``steps_per_experience`` is each training experience's GRPO budget, and
    ``steps`` overrides it for some (``{babyai:easy: 6}``);
    ``train_tasks``/``test_tasks`` cap the task lists (``null`` = all), chosen
    with ``task_seed`` so every training seed sees the same tasks, and
    ``test_tasks_for`` overrides ``test_tasks`` for some test experiences
    (``{babyai:easy: 64}``: resolution where a run's question is);
    ``env_options`` maps an environment name to its constructor options.
    """

    train: list[str]
    test: list[str] = field(default_factory=list)
    train_tasks: int | None = None
    test_tasks: int | None = 20
    steps_per_experience: int = 10
    steps: dict[str, int] = field(default_factory=dict)
    test_tasks_for: dict[str, int] = field(default_factory=dict)
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_seed: int = 0

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("train must list at least one experience spec (e.g. [textcraft:easy])")
        _specs(self, "train", "test")
        _at_least(self, 1, "steps_per_experience", "train_tasks", "test_tasks")
        for key in ("steps", "test_tasks_for"):
            for spec, count in getattr(self, key).items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ValueError(f"{key}.{spec} must be an integer >= 1, got {count!r}")
        for name, options in self.env_options.items():
            if not isinstance(options, dict):
                raise ValueError(f"env_options.{name} must be a mapping of option: value, got {options!r}")
        check_seed(self.task_seed, "task_seed")


@dataclass
class StrategySpec:
    """A strategy's name (registered, an entry point, or ``"pkg.module:Class"``) and its options.

    ``steps_per_experience`` is not an option here: the stream's is passed to
    the strategy (`build_strategy`).
    """

    name: str = "sequential"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must name a strategy")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a mapping of option: value, got {self.options!r}")


_EVAL_ROLLOUT_FIELDS = ("max_new_tokens", "max_episode_tokens", "temperature", "top_p", "max_turns")


@dataclass
class EvalSpec:
    """How every test experience is measured after each stage: ``k`` samples per task.

    The rollout fields default to ``None``: take the experiment's ``rollout``
    value; set one only where evaluation differs from training (say a lower
    ``temperature``). ``drift`` adds each stage's forgetting-beyond-success
    measures to its row (`contrail.drift`: KL to the start model on its own
    samples, a forward pass per row-0 episode; the share of parameters changed).
    """

    k: int = 4
    batch_episodes: int = 64
    max_new_tokens: int | None = None
    max_episode_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_turns: int | None = None
    drift: bool = True

    def __post_init__(self) -> None:
        _at_least(self, 1, "k", "batch_episodes")
        if not isinstance(self.drift, bool):
            raise ValueError(f"drift must be true or false, got {self.drift!r}")

    def rollout_for(self, base: RolloutConfig) -> RolloutConfig:
        """``base`` with this section's non-``None`` rollout fields replacing its own."""
        changes = {name: getattr(self, name) for name in _EVAL_ROLLOUT_FIELDS if getattr(self, name) is not None}
        return dataclasses.replace(base, **changes)


@dataclass(kw_only=True)
class Experiment:
    """One experiment; with ``seeds`` or ``orders``, a family of runs (see `expand_runs`).

    ``seed`` is the run's root seed: every random choice derives its own seed
    from it by name (`contrail.seeds`). ``rollout`` is shared by training and
    evaluation (``eval`` overrides only what differs). ``out`` is the run
    directory (``${name}`` is replaced by the name). ``label`` names the run's
    group in `contrail.report.compare` (set by `expand_runs`; see `run_label`).
    ``checkpoint_minutes`` spaces the checkpoints taken within a stage
    (`contrail.checkpoints`); every stage's end is checkpointed too.
    """

    name: str
    stream: StreamSpec
    strategy: StrategySpec = field(default_factory=StrategySpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalSpec = field(default_factory=EvalSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)  # TensorBoard / W&B / trackio / MLflow
    seed: int = 0
    out: str = "runs/${name}"
    seeds: list[int] | None = None
    orders: Any = None  # None, "all", or a list of orders (lists of specs); checked below
    label: str | None = None
    # Within a stage, checkpoint after a step once this many minutes have passed since the stage began or the
    # last such checkpoint (0: after every step), so a killed run loses at most that much training.
    checkpoint_minutes: float = 5.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string")
        self.out = self.out.replace("${name}", self.name)
        check_seed(self.seed, "seed")
        value = self.checkpoint_minutes
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"checkpoint_minutes must be a finite number >= 0, got {value!r}")
        if self.seeds is not None:
            if not self.seeds:
                raise ValueError("seeds must list at least one seed (or be omitted)")
            for index, seed in enumerate(self.seeds):
                check_seed(seed, f"seeds[{index}]")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"seeds must be distinct, got {self.seeds}")
        self.orders = _checked_orders(self.orders)
        try:
            self.eval.rollout_for(self.rollout)  # evaluation's settings are valid too
        except ValueError as error:
            raise ValueError(f"eval.{error}") from None

    @property
    def eval_rollout(self) -> RolloutConfig:
        """The rollout settings evaluation uses: ``rollout`` with ``eval``'s overrides."""
        return self.eval.rollout_for(self.rollout)

    def to_yaml(self) -> str:
        """The experiment as YAML: what a run directory stores as ``config.yaml``."""
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    @classmethod
    def from_yaml(cls, source: str | Path) -> "Experiment":
        """An experiment from YAML text or a file (presets and interpolation allowed), checked."""
        if isinstance(source, Path) or _names_a_file(source):
            return load_experiment(source)
        sources = _Sources("experiment YAML")
        tree = _parse_yaml(source, "experiment YAML")
        return _from_tree(tree, sources, presets.search_path())

    def check(self) -> "Experiment":
        """Check what depends on the registries and this machine; returns ``self``.

        Environment specs and options, the strategy and its options, and that
        ``model.device`` exists here. The loaders call it; call it on an
        experiment built in Python before anything is written.
        """
        _check(self, lambda key: "experiment")
        return self


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is a path to an existing file rather than YAML text."""
    if "\n" in text:
        return False
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: YAML text
        return False


def _checked_orders(orders: Any) -> Any:
    if orders is None or orders == "all":
        return orders
    if not isinstance(orders, list) or not orders:
        raise ValueError(f"orders must be 'all' or a non-empty list of orders (lists of specs), got {orders!r}")
    for index, order in enumerate(orders):
        if not isinstance(order, list) or not order or not all(isinstance(s, str) for s in order):
            raise ValueError(f"orders[{index}] must be a non-empty list of experience specs, got {order!r}")
    return [list(order) for order in orders]


def _specs(obj: Any, *names: str) -> None:
    """Every item of the lists ``names`` is an experience spec string (``env`` or ``env:difficulty``)."""
    for name in names:
        for index, spec in enumerate(getattr(obj, name)):
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"{name}[{index}] must be an experience spec such as textcraft:easy, got {spec!r}")


def _at_least(obj: Any, low: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _finite_positive(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _choice(obj: Any, name: str, valid: Sequence[str]) -> None:
    if getattr(obj, name) not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}, got {getattr(obj, name)!r}")


# Keys that moved out of a section in the redesign: a file still setting them is told where they went.
_MOVED = {
    "grpo.seed": "seed",
    **{f"grpo.{name}": f"rollout.{name}" for name in _EVAL_ROLLOUT_FIELDS},
    "model.warmstart.seed": "seed (the warm-start's seed derives from it)",
    "strategy.options.seed": "seed",
    "strategy.options.steps_per_experience": "stream.steps_per_experience",
}


# --- where each key came from --------------------------------------------------------------


class _Sources:
    """Where each dotted key came from (the experiment file, a preset, an override)."""

    def __init__(self, default: str) -> None:
        self.by_prefix = {"": default}

    def set(self, key: str, where: str) -> None:
        self.by_prefix = {k: v for k, v in self.by_prefix.items() if not (k == key or k.startswith(key + "."))}
        self.by_prefix[key] = where

    def of(self, key: str) -> str:
        parts = re.sub(r"\[\d+\]", "", key).split(".")
        for end in range(len(parts), -1, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.by_prefix:
                return self.by_prefix[prefix]
        return self.by_prefix[""]

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.of(key)}: {key or 'the experiment'}: {problem}")


# --- loading ---------------------------------------------------------------------------------


def load_experiment(path: str | Path, overrides: Sequence[str] = (),
                    preset_dirs: Sequence[str | Path] = ()) -> Experiment:
    """Read an experiment file, expand presets, apply ``overrides``, validate; see the module docstring.

    ``preset_dirs`` are searched for presets before the folders beside the
    file and the packaged presets (`contrail.presets.search_path`).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such experiment file")
    tree = _read_yaml(path)
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: an experiment must be a mapping of sections, got {type(tree).__name__}")
    tree.setdefault("name", path.stem)
    places = presets.search_path(path, preset_dirs)
    return _from_tree(tree, _Sources(str(path)), places, overrides)


def _from_tree(tree: Any, sources: _Sources, places: list[presets.PresetPlace],
               overrides: Sequence[str] = ()) -> Experiment:
    where = sources.of("")
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: an experiment must be a mapping of sections, got {type(tree).__name__}")
    for section in ("stream", "strategy", "model"):
        if section in tree:
            tree[section] = _expand_section(section, tree[section], where, sources, places)
    for override in overrides:
        _apply_override(tree, override, sources, places)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{where}: cannot resolve an interpolation: {_first_line(error)}") from None
    _check_shape(resolved, Experiment, "", sources)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Experiment), resolved)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or ""
        raise sources.error(key, _type_problem(key, resolved) or _first_line(error)) from None
    experiment = _instantiate(merged, Experiment, "", sources)
    _check(experiment, sources.of)
    return experiment


def _read_yaml(path: Path) -> Any:
    """Parse a YAML file with omegaconf's loader (``1e-6`` is a float); errors name the file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the file: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not a UTF-8 text file (undecodable byte at offset {error.start}); "
                          "an experiment is YAML text") from None
    return _parse_yaml(text, str(path))


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(io.StringIO(text)), resolve=False)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{where}{line}: malformed YAML: {problem}") from None
    except OSError:  # omegaconf's "Invalid loaded object type": a scalar at the top
        raise ConfigError(f"{where}: an experiment must be a mapping of sections") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{where}: {_first_line(error)}") from None


def _expand_section(section: str, value: Any, where: str, sources: _Sources,
                    places: list[presets.PresetPlace]) -> Any:
    """Replace a preset name (or ``{preset: NAME, ...}``) by the preset's mapping."""
    if section == "model":
        return {"name": value} if isinstance(value, str) else value
    if isinstance(value, str):
        data, origin = _preset(section, value, where, section, places)
        sources.set(section, origin)
        return data
    if isinstance(value, dict) and "preset" in value:
        name = value["preset"]
        if not isinstance(name, str):
            raise ConfigError(f"{where}: {section}.preset: expected a preset name, got {name!r}")
        data, origin = _preset(section, name, where, f"{section}.preset", places)
        sources.set(section, origin)
        merged = dict(data)
        for key, item in value.items():
            if key != "preset":
                merged[key] = item
                sources.set(f"{section}.{key}", where)
        return merged
    return value


def _preset(section: str, name: str, where: str, key: str,
            places: list[presets.PresetPlace]) -> tuple[dict[str, Any], str]:
    """Preset ``name`` of ``section`` as a mapping, and the source label of its keys."""
    path = presets.find(section, name, places)
    if path is None:
        if section == "strategy" and (":" in name or name in strategies.names()):
            return {"name": name}, where  # a strategy without a preset file: its defaults
        extra = f"; registered strategies: {', '.join(strategies.names())}" if section == "strategy" else ""
        raise ConfigError(f"{where}: {key}: unknown {section} preset {name!r}; "
                          f"{presets.offers(section, places)}{extra}")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {section} preset must be a mapping, got {type(data).__name__}")
    return data, f"{path} (preset {name!r} named in {where})"


_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w:-]*)*$")


def _apply_override(tree: dict[str, Any], override: str, sources: _Sources,
                    places: list[presets.PresetPlace]) -> None:
    where = f"override {override!r}"
    key, eq, text = override.partition("=")
    key = key.strip()
    if not eq or not _KEY.match(key):
        raise ConfigError(f"{where}: expected KEY=VALUE with a dotted KEY (grpo.lr=1e-6, strategy=replay, "
                          "stream.train=[babyai:easy,textcraft:easy])")
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except (OmegaConfBaseException, yaml.YAMLError) as error:
        raise ConfigError(f"{where}: cannot parse the value {text!r}: {_first_line(error)}") from None
    parts = key.split(".")
    if len(parts) == 1 and key in ("stream", "strategy", "model"):
        sources.set(key, where)  # a preset then names its own file
        tree[key] = _expand_section(key, value, where, sources, places)
        return
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(f"{where}: {prefix} is {child!r}, not a section; cannot set {key}")
        node = child
    node[parts[-1]] = value
    sources.set(key, where)


# --- typed conversion ---------------------------------------------------------------------------


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    found = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return found[0] if len(found) == 1 else None


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _check_shape(data: Any, cls: type, prefix: str, sources: _Sources) -> None:
    """Sections are mappings and hold only their dataclass's keys (valid keys listed otherwise)."""
    if not isinstance(data, dict):
        raise sources.error(prefix, f"expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    for name, value in data.items():
        key = _join(prefix, str(name))
        if key in _MOVED:
            raise sources.error(key, f"moved: set {_MOVED[key]} instead")
        if name not in valid:
            raise sources.error(key, f"unknown key; valid keys of {prefix or 'an experiment'}: {', '.join(valid)}")
        inner = _dataclass_of(hints[name])
        if inner is not None and not (value is None and _optional(hints[name])):
            _check_shape(value, inner, key, sources)


def _instantiate(node: DictConfig, cls: type, prefix: str, sources: _Sources) -> Any:
    """Build ``cls`` from a merged structured node, section by section, so errors name their key."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(prefix, f.name)
        if OmegaConf.is_missing(node, f.name):
            raise sources.error(key, "missing required key")
        value = node[f.name]
        inner = _dataclass_of(hints[f.name])
        if inner is not None and value is not None:
            kwargs[f.name] = _instantiate(value, inner, key, sources)
        elif isinstance(value, (DictConfig, ListConfig)):
            kwargs[f.name] = OmegaConf.to_container(value, resolve=True)
        else:
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise _field_error(str(error), cls, prefix, sources) from None


# A message's leading key: "top_p must ...", "env_options.babyai:easy must ...", "device: ...".
_LEADING_KEY = re.compile(r"^([A-Za-z_](?:[\w.-]|:(?=\S))*(?:\[\d+\])*)( must |: | )")


def _field_error(message: str, cls: type, prefix: str, sources: _Sources) -> ConfigError:
    """A dataclass's ValueError (starting with a field name) as ``where: section.field: problem``."""
    match = _LEADING_KEY.match(message)
    fields = {f.name for f in dataclasses.fields(cls)}
    if match is None or re.split(r"[.\[]", match.group(1))[0] not in fields:
        return sources.error(prefix, message)
    key = _join(prefix, match.group(1))
    if match.group(2) == " must ":  # "top_p must be in (0, 1]" -> "rollout.top_p: must be in (0, 1]"
        return sources.error(key, message[match.end(1) + 1:])
    if match.group(2) == ": ":
        return sources.error(key, message[match.end():])
    return sources.error(key, message)  # "max_episode_tokens (64) must exceed ...": keep it whole


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _type_problem(key: str, tree: Any) -> str | None:
    """``expected an integer, got 'abc'`` for a value at ``key`` that does not fit its field's type.

    Worded from the field's annotation and the value itself, instead of
    omegaconf's message (which names its own node classes); None when the key
    cannot be followed (then omegaconf's message is shown).
    """
    hint: Any = Experiment
    value = tree
    for name, index in _PATH_PART.findall(key):
        part: Any = int(index) if index else name
        hint = _hint_of_part(hint, part)
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return None
        if hint is None:
            return None
    literals = [a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is Literal]
    if literals:
        choices = [str(c) for a in literals for c in typing.get_args(a)]
        return f"invalid value {value!r}; valid: {', '.join(choices)}"
    return f"expected {_describe(hint)}, got {_show(value)}"


def _hint_of_part(hint: Any, part: str | int) -> Any:
    """The annotation one step below ``hint``: a dataclass field, a list item, a mapping value."""
    inner = _dataclass_of(hint)
    if inner is not None and isinstance(part, str):
        return typing.get_type_hints(inner).get(part)
    container = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: follow X
        container = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    origin = typing.get_origin(container)
    if origin is list and isinstance(part, int):
        return typing.get_args(container)[0]
    if origin is dict and isinstance(part, str):
        return typing.get_args(container)[1]
    return None


def _describe(hint: Any) -> str:
    """A person's words for an annotation: ``an integer or null``, ``a list of strings``."""
    arms = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        text = " or ".join(_describe(a) for a in arms)
        return f"{text} or null" if type(None) in typing.get_args(hint) else text
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(hint):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _show(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --- checks against the registries and the machine -------------------------------------------


def _check(exp: Experiment, where: Callable[[str], str]) -> None:
    """Environment specs and options, the strategy, the device: the checks that need more than the values."""
    _check_specs(exp, where)
    _check_env_options(exp, where)
    _check_strategy(exp, where)
    try:
        check_device(exp.model.device)
    except ValueError as error:
        raise ConfigError(f"{where('model.device')}: model.device: {error}") from None


def _check_specs(exp: Experiment, where: Callable[[str], str]) -> None:
    specs = [(f"stream.train[{i}]", s) for i, s in enumerate(exp.stream.train)]
    specs += [(f"stream.test[{i}]", s) for i, s in enumerate(exp.stream.test)]
    if exp.model.warmstart is not None:
        specs += [(f"model.warmstart.envs[{i}]", s) for i, s in enumerate(exp.model.warmstart.envs)]
    if isinstance(exp.orders, list):
        specs += [(f"orders[{i}][{j}]", s) for i, order in enumerate(exp.orders) for j, s in enumerate(order)]
    for key, spec in specs:
        _check_spec(spec, f"{where(key)}: {key}")


def _check_spec(spec: str, where: str) -> None:
    """Validate an ``env:difficulty`` spec; ``where`` prefixes the error (file and key)."""
    try:
        envs.parse_spec(spec)
    except UnknownNameError as error:
        raise ConfigError(f"{where}: {error}") from None
    except ImportError as error:
        raise EnvUnavailableError(
            f"{where}: environment {spec.partition(':')[0]!r} cannot be loaded here ({error}); "
            "is an optional extra missing (e.g. pip install 'contrail[alfworld]')?"
        ) from None


def _check_env_options(exp: Experiment, where: Callable[[str], str]) -> None:
    """Every environment's options against what the environment declares (names and types)."""
    valid = envs.names()
    for name, options in exp.stream.env_options.items():
        key = f"stream.env_options.{name}"
        if name not in valid:
            raise ConfigError(f"{where(key)}: {key}: unknown environment {name!r}; valid: {', '.join(valid)}")
        for option, value in options.items():  # one at a time, so the message names the key
            try:
                envs.check_options(name, {option: value})
            except ValueError as error:
                raise ConfigError(f"{where(f'{key}.{option}')}: {key}.{option}: {error}") from None
        try:
            envs.check_options(name, options)
        except ValueError as error:
            raise ConfigError(f"{where(key)}: {key}: {error}") from None


def _check_strategy(exp: Experiment, where: Callable[[str], str]) -> None:
    name = exp.strategy.name
    try:
        valid = strategies.options(name)
    except UnknownNameError as error:
        raise ConfigError(f"{where('strategy.name')}: strategy.name: {error}") from None
    for option in exp.strategy.options:
        key = f"strategy.options.{option}"
        if key in _MOVED:
            raise ConfigError(f"{where(key)}: {key}: moved: set {_MOVED[key]} instead")
        if option not in valid:
            shown = [o for o in valid if f"strategy.options.{o}" not in _MOVED]
            raise ConfigError(f"{where(key)}: {key}: unknown option of strategy {name!r}; "
                              f"valid: {', '.join(shown) or '(none)'}")
    try:
        build_strategy(exp)
    except (ValueError, TypeError) as error:
        option = next((o for o in exp.strategy.options if re.match(rf"\W*{re.escape(o)}\b", str(error))), None)
        key = f"strategy.options.{option}" if option else "strategy.options"
        raise ConfigError(f"{where(key)}: {key}: {_first_line(error)}") from None
    _check_weights(exp, where)
    _check_steps(exp, where)
    _check_test_tasks(exp, where)


def _trainable(exp: Experiment) -> set[str]:
    """Every spec some run of ``exp`` trains: ``stream.train`` and the specs of its ``orders``."""
    trainable = set(exp.stream.train)
    if isinstance(exp.orders, list):
        trainable |= {s for order in exp.orders for s in order}
    return trainable


def _check_names(where: Callable[[str], str], key: str, names, valid: set[str], kind: str) -> None:
    """Every name of ``names`` (the keys of the setting ``key``) is in ``valid``, else one line naming it."""
    for name in names:
        if name not in valid:
            path = f"{key}.{name}"
            raise ConfigError(f"{where(path)}: {path}: not a {kind} experience; valid: {', '.join(sorted(valid))}")


def _check_steps(exp: Experiment, where: Callable[[str], str]) -> None:
    """``stream.steps`` names training experiences only."""
    _check_names(where, "stream.steps", exp.stream.steps, _trainable(exp), "training")


def _check_test_tasks(exp: Experiment, where: Callable[[str], str]) -> None:
    """``stream.test_tasks_for`` names test experiences only."""
    tested = set(exp.stream.test) or _trainable(exp)
    _check_names(where, "stream.test_tasks_for", exp.stream.test_tasks_for, tested, "test")


def _check_weights(exp: Experiment, where: Callable[[str], str]) -> None:
    """A strategy's ``weights`` option names training experiences only."""
    weights = exp.strategy.options.get("weights")
    if isinstance(weights, dict):
        _check_names(where, "strategy.options.weights", weights, _trainable(exp), "training")


# --- from an experiment to what a run needs ----------------------------------------------------


def build_stream(exp: Experiment, cache: dict[str, Experience] | None = None) -> Stream:
    """The run's stream: ``stream.train`` in order, ``stream.test`` (or the training ones).

    Each experience's budget is ``stream.steps`` for it, else ``stream.steps_per_experience``; its tasks are
    capped by ``train_tasks`` and ``test_tasks_for`` for it, else ``test_tasks``, with ``task_seed``. ``cache``
    (spec → Experience) shares task lists between the runs of one family.
    """
    s = exp.stream
    cache = {} if cache is None else cache

    def get(spec: str) -> Experience:
        if spec not in cache:
            options = s.env_options.get(envs.parse_spec(spec)[0])  # the env's name, whatever the spec's shape
            steps = s.steps.get(spec, s.steps_per_experience)
            test_tasks = s.test_tasks_for.get(spec, s.test_tasks)
            cache[spec] = Experience.from_spec(spec, s.train_tasks, test_tasks, steps, s.task_seed, options)
        return cache[spec]

    return Stream([get(spec) for spec in s.train], [get(spec) for spec in (s.test or s.train)])


def build_strategy(exp: Experiment) -> Strategy:
    """The configured strategy, given the stream's step budget when it takes one."""
    options = dict(exp.strategy.options)
    if "steps_per_experience" in strategies.options(exp.strategy.name):
        options["steps_per_experience"] = exp.stream.steps_per_experience
    return strategies.make(exp.strategy.name, **options)


# --- fan-out over orders and seeds ---------------------------------------------------------------


def order_label(order: Sequence[str]) -> str:
    """A directory-safe name for a training order: ``babyai-easy__textcraft-easy``."""
    return "__".join(re.sub(r"[^\w.-]+", "-", spec) for spec in order)


def run_label(exp: Experiment) -> str:
    """The group a run belongs to in comparisons: the strategy with all its options, and the order.

    Options are the strategy's own values (defaults included, the stream's
    ``steps_per_experience`` included, or each trained experience's budget
    when ``stream.steps`` sets some), so two runs group together only when
    they differ in nothing but the seed, which is never part of the label.
    """
    strategy = build_strategy(exp)
    if dataclasses.is_dataclass(strategy):
        options = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)
                   if f.name != "seed" and f.init}
    else:
        options = dict(exp.strategy.options)
    if exp.stream.steps and "steps_per_experience" in options:
        # The stream's per-experience budgets override the strategy's default: show what each trains.
        default = options.pop("steps_per_experience")
        options["steps"] = {spec: exp.stream.steps.get(spec, default) for spec in exp.stream.train}
    shown = ", ".join(f"{k}={_label_value(v)}" for k, v in sorted(options.items()))
    return f"{exp.strategy.name}({shown}): {' → '.join(exp.stream.train)}"


def _label_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_label_value(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value) if isinstance(value, str) else str(value)


def expand_runs(exp: Experiment) -> list[Experiment]:
    """One experiment per (order, seed), each with its own ``out`` and a ``label`` for comparisons.

    ``orders: all`` means every permutation of ``stream.train``; a list of
    orders replaces ``stream.train`` order by order. Run directories are
    ``<out>/<order-label>/seed<k>`` (``<out>/seed<k>`` without orders, ``<out>``
    for a single run). When ``stream.test`` is empty, every run tests the same
    experiences (all those trained in any order), so their columns match.
    """
    if exp.orders is None:
        orders: list[list[str] | None] = [None]
    elif exp.orders == "all":
        orders = [list(p) for p in itertools.permutations(exp.stream.train)]
    else:
        orders = [list(o) for o in exp.orders]
    test = list(exp.stream.test)
    if not test and exp.orders is not None:
        test = list(dict.fromkeys(s for order in orders for s in order))
    seeds = exp.seeds if exp.seeds is not None else [exp.seed]
    runs = []
    for order in orders:
        stream = exp.stream if order is None else dataclasses.replace(exp.stream, train=order, test=test)
        for seed in seeds:
            out = Path(exp.out)
            if order is not None:
                out = out / order_label(order)
            if exp.seeds is not None:
                out = out / f"seed{seed}"
            one = dataclasses.replace(exp, seed=seed, seeds=None, orders=None, out=str(out), stream=stream)
            if exp.label is None:
                one.label = run_label(one)
            else:
                one.label = f"{exp.label}: {' → '.join(order)}" if order else exp.label
            runs.append(one)
    return runs


# --- sweeps over many machines --------------------------------------------------------------------


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``: share ``i`` (0-based) of ``n``; anything else raises `ShardError`.

    The syntax is that of a SLURM array: ``--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None:
        raise ShardError(f"--shard {text!r}: expected i/n with integers, e.g. 0/4 (share 0 of 4)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ShardError(f"--shard {text!r}: the number of shares n must be >= 1")
    if index >= count:
        raise ShardError(f"--shard {text!r}: the share i must be in 0..{count - 1}")
    return index, count


def shard(runs: Sequence[T], index: int, count: int) -> list[tuple[int, T]]:
    """Share ``index`` of ``count`` of ``runs``, as ``(position in runs, run)`` pairs.

    Run ``j`` belongs to share ``j % count``: the shares are disjoint, cover
    every run, depend on nothing but the (deterministic) order of
    `expand_runs`, and stay balanced within one run of each other. A share may
    be empty when there are more shares than runs.
    """
    if count < 1 or not 0 <= index < count:
        raise ShardError(f"shard {index}/{count}: the share must be in 0..{count - 1} and the count >= 1")
    return [(j, run) for j, run in enumerate(runs) if j % count == index]


# --- the plan a dry run prints -------------------------------------------------------------------


def describe_plan(exp: Experiment) -> str:
    """Every run's plan in plain text (for ``contrail run --dry-run``); loads no model.

    Per run: the stages with their experiences and weights, GRPO steps, tasks
    per step and rollouts (steps × tasks_per_step × group_size); then the
    test experiences with their task counts, ``k`` and where each is trained.
    """
    runs = expand_runs(exp)
    cache: dict[str, Experience] = {}
    lines = [f"experiment {exp.name}: {len(runs)} run(s)", _describe_model(exp), _describe_rollout(exp), ""]
    for number, one in enumerate(runs, start=1):
        lines += _describe_run(one, number, len(runs), cache)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _describe_model(exp: Experiment) -> str:
    m = exp.model
    text = f"model {m.name} ({m.dtype}, device {m.device})"
    if m.warmstart is not None:
        w = m.warmstart
        text += (f"; warm-start on {', '.join(w.envs)}: {w.episodes} expert episodes in all (split evenly), "
                 f"{w.epochs} epoch{'' if w.epochs == 1 else 's'}, lr {w.lr:g}")
    return text


def _describe_rollout(exp: Experiment) -> str:
    def show(r: RolloutConfig) -> str:
        turns = r.max_turns if r.max_turns is not None else "the environment's limit"
        return (f"{r.max_new_tokens} tokens/turn, {r.max_episode_tokens} tokens/episode, "
                f"temperature {r.temperature:g}, top_p {r.top_p:g}, turns {turns}")

    evaluation = "the same" if exp.eval_rollout == exp.rollout else show(exp.eval_rollout)
    return f"rollouts: {show(exp.rollout)}; evaluation: {evaluation}"


def _describe_run(run: Experiment, number: int, total: int, cache: dict[str, Experience]) -> list[str]:
    stream = build_stream(run, cache)
    strategy = build_strategy(run)
    note, base = "", None
    if strategy.needs_base_success:
        base = {e.name: 0.0 for e in stream.train}
        note = "  (order shown is the stream's; the run orders stages by the start model's measured success)"
    stages = strategy.plan(stream, seed=run.seed, base_success=base)
    g = run.grpo
    lines = [f"run {number}/{total}: {run.label}", f"  out {run.out}, seed {run.seed}, strategy {strategy.name}{note}"]
    sizes = {e.name: len(e.train_tasks) for e in stream.experiences}
    total_steps = total_rollouts = 0
    for stage in stages:
        rollouts = stage.steps * g.tasks_per_step * g.group_size
        total_steps += stage.steps
        total_rollouts += rollouts
        weights = ", ".join(f"{n} {w:.2f} ({sizes[n]} train tasks)" for n, w in stage.weights.items())
        lines.append(f"  stage {stage.index} {stage.name}: {stage.steps} steps × {g.tasks_per_step} tasks × "
                     f"group {g.group_size} = {rollouts} rollouts; samples {weights}")
    lines.append(f"  training total: {total_steps} steps, {total_rollouts} rollouts")
    trained_at = stream.trained_at([stage.new for stage in stages])
    k = run.eval.k
    tests = [f"{e.name} {len(e.test_tasks)} tasks ({f'trained in stage {s}' if s is not None else 'held out'})"
             for e, s in zip(stream.test, trained_at, strict=True)]
    episodes = (len(stages) + 1) * sum(len(e.test_tasks) for e in stream.test) * k
    lines.append(f"  test after stages 0..{len(stages)} with k={k}: " + "; ".join(tests))
    lines.append(f"  evaluation total: {episodes} episodes")
    return lines
