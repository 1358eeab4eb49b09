"""Typed experiment configs: YAML files, presets and ``key=value`` overrides.

An experiment file is a mapping of these sections (see `ExperimentConfig`)::

    name: quickstart                 # default: the file's stem
    out: runs/${name}                # omegaconf interpolation works anywhere
    seed: 0                          # or seeds: [0, 1, 2] (one run per seed)
    orders: all                      # optional: every permutation of stream.train, or a list of orders
    model: {name: smollm2-135m, warmstart: {envs: [babyai:easy], episodes: 60}}
    stream: quickstart               # a preset (contrail/presets/streams/quickstart.yaml) ...
    strategy: {name: replay, options: {replay_share: 0.5}}   # ... or a mapping
    grpo: {lr: 1.0e-6, group_size: 8}                      # GRPOConfig fields
    eval: {k: 4}

``stream`` and ``strategy`` accept a preset name, a mapping, or a mapping
with ``preset: NAME`` plus fields that override the preset's. ``model``
accepts a bare model name. Overrides are dotted ``key=value`` pairs whose
values are YAML (``grpo.lr=1e-6``, ``strategy=replay``,
``stream.train=[babyai:easy,textcraft:easy]``).

Every mistake raises `ConfigError` naming the file (or the override) and the
key, with the valid choices.

>>> cfg = load_experiment("experiments/quickstart.yaml", ["grpo.lr=1e-5"])
>>> runs = expand_runs(cfg)       # one config per (order, seed)
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contrail import envs, strategies
from contrail.envs.base import UnknownNameError
from contrail.grpo.config import GRPOConfig

__all__ = [
    "ConfigError",
    "EnvUnavailableError",
    "EvalConfig",
    "ExperimentConfig",
    "ModelConfig",
    "PRESETS",
    "StrategyConfig",
    "StreamConfig",
    "WarmStartConfig",
    "expand_runs",
    "load_experiment",
    "order_label",
    "preset_names",
    "run_label",
    "to_dict",
]

PRESETS = Path(__file__).parent / "presets"
PRESET_SECTIONS = ("stream", "strategy")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A mistake in an experiment config: says where (file or override), which key, and the valid choices."""


class EnvUnavailableError(ConfigError):
    """A config names an environment that exists but cannot be loaded here (a missing optional extra)."""


# --- the typed sections -------------------------------------------------------------


@dataclass
class WarmStartConfig:
    """Behaviour cloning on expert episodes before GRPO (a small model cannot write the formats yet)."""

    envs: list[str]
    episodes: int = 100
    epochs: int = 2
    lr: float = 1e-4
    max_episode_tokens: int = 2048
    seed: int = 0
    batch_size: int = 8
    precision: str = "bf16"

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if not self.envs:
            raise ValueError("envs must name at least one environment spec (e.g. [babyai:easy])")
        _positive(self, "episodes", "epochs", "max_episode_tokens", "batch_size")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class ModelConfig:
    """The starting model: an HF id, a local path or ``smollm2-135m``; optional warm-start."""

    name: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    warmstart: WarmStartConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class StreamConfig:
    """Experiences to train (in order) and to test; ``test`` empty = the training ones.

    ``steps_per_experience`` is each training experience's GRPO budget;
    ``train_tasks``/``test_tasks`` cap the task lists (``null`` = all), chosen
    with ``task_seed`` so every training seed sees the same tasks;
    ``env_options`` maps an environment name to its constructor options.
    """

    train: list[str]
    test: list[str] = field(default_factory=list)
    train_tasks: int | None = None
    test_tasks: int | None = 20
    steps_per_experience: int = 10
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_seed: int = 0

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("train must list at least one experience spec (e.g. [textcraft:easy])")
        _positive(self, "steps_per_experience", "train_tasks", "test_tasks")


@dataclass
class StrategyConfig:
    """A registered strategy and its options (see `contrail.strategies`)."""

    name: str = "sequential"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalConfig:
    """How every test experience is measured after each stage (``k`` samples per task)."""

    k: int = 4
    max_new_tokens: int = 64
    max_turns: int | None = None
    temperature: float = 1.0
    max_episode_tokens: int = 2048
    batch_episodes: int = 64

    def __post_init__(self) -> None:
        _positive(self, "k", "max_new_tokens", "max_turns", "max_episode_tokens", "batch_episodes")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.max_episode_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_episode_tokens ({self.max_episode_tokens}) must exceed max_new_tokens ({self.max_new_tokens})"
            )


@dataclass(kw_only=True)
class ExperimentConfig:
    """One experiment; with ``seeds`` or ``orders``, a family of runs (see `expand_runs`).

    ``seed`` seeds training (``grpo.seed`` always follows it); ``label``
    names the run's group in `contrail.report.compare` (set by `expand_runs`).
    """

    name: str
    out: str = "runs/${name}"
    seed: int = 0
    seeds: list[int] | None = None
    orders: list[list[str]] | str | None = None
    label: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    stream: StreamConfig
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        self.out = self.out.replace("${name}", self.name)
        if self.seeds is not None:
            if not self.seeds:
                raise ValueError("seeds must list at least one seed (or be omitted)")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if isinstance(self.orders, str) and self.orders != "all":
            raise ValueError(f"orders must be 'all' or a list of orders (lists of specs), got {self.orders!r}")
        if isinstance(self.orders, list) and (not self.orders or not all(self.orders)):
            raise ValueError("orders must list at least one non-empty order")
        if self.grpo.seed != self.seed:
            self.grpo = dataclasses.replace(self.grpo, seed=self.seed)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config as plain containers (what a run directory saves as ``config.yaml``)."""
    return dataclasses.asdict(cfg)


# --- presets ------------------------------------------------------------------------


def preset_names(section: str) -> list[str]:
    """Preset names of ``section`` (``stream`` or ``strategy``)."""
    return sorted(p.stem for p in (PRESETS / _preset_dir(section)).glob("*.yaml"))


def _preset_dir(section: str) -> str:
    return {"stream": "streams", "strategy": "strategies"}[section]


def _preset(section: str, name: str, where: str, key: str) -> tuple[dict[str, Any], str]:
    """Load preset ``name`` of ``section``; returns (mapping, its path)."""
    path = PRESETS / _preset_dir(section) / f"{name}.yaml"
    if not path.is_file():
        if section == "strategy" and name in strategies.names():
            return {"name": name}, where  # a registered strategy without a preset file
        valid = preset_names(section)
        extra = f"; registered strategies: {', '.join(strategies.names())}" if section == "strategy" else ""
        raise ConfigError(
            f"{where}: {key}: unknown {section} preset {name!r}; valid presets: {', '.join(valid)}{extra}"
        )
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {section} preset must be a mapping, got {type(data).__name__}")
    return data, str(path)


# --- loading --------------------------------------------------------------------------


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


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read an experiment file, expand presets, apply ``overrides``, validate; see the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such experiment file")
    tree = _read_yaml(path)
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: an experiment must be a mapping of sections, got {type(tree).__name__}")
    sources = _Sources(str(path))
    for section in (*PRESET_SECTIONS, "model"):
        if section in tree:
            tree[section] = _expand_section(section, tree[section], str(path), sources)
    for override in overrides:
        _apply_override(tree, override, sources)
    tree.setdefault("name", path.stem)
    tree.setdefault("out", "runs/${name}")
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: cannot resolve an interpolation: {error}") from None
    return _experiment(resolved, sources)


def _read_yaml(path: Path) -> Any:
    """Parse a YAML file with omegaconf's loader (``1e-6`` is a float); errors name the file and line."""
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{path}{line}: malformed YAML: {problem}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {error}") from None


def _expand_section(section: str, value: Any, where: str, sources: _Sources) -> Any:
    """Replace a preset name (or ``{preset: NAME, ...}``) by the preset's mapping."""
    if section == "model":
        return {"name": value} if isinstance(value, str) else value
    if isinstance(value, str):
        data, origin = _preset(section, value, where, section)
        sources.set(section, origin if origin == where else f"{origin} (preset {value!r} named in {where})")
        return data
    if isinstance(value, dict) and "preset" in value:
        name = value["preset"]
        if not isinstance(name, str):
            raise ConfigError(f"{where}: {section}.preset: expected a preset name, got {name!r}")
        data, origin = _preset(section, name, where, f"{section}.preset")
        sources.set(section, origin if origin == where else f"{origin} (preset {name!r} named in {where})")
        merged = dict(data)
        for key, item in value.items():
            if key != "preset":
                merged[key] = item
                sources.set(f"{section}.{key}", where)
        return merged
    return value


_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w:-]*)*$")


def _apply_override(tree: dict[str, Any], override: str, sources: _Sources) -> None:
    where = f"override {override!r}"
    key, eq, text = override.partition("=")
    key = key.strip()
    if not eq or not _KEY.match(key):
        raise ConfigError(
            f"{where}: expected KEY=VALUE with a dotted KEY (grpo.lr=1e-6, strategy=replay, "
            "stream.train=[babyai:easy,textcraft:easy])"
        )
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except (OmegaConfBaseException, yaml.YAMLError) as error:
        raise ConfigError(f"{where}: cannot parse the value {text!r}: {error}") from None
    parts = key.split(".")
    if len(parts) == 1 and key in (*PRESET_SECTIONS, "model"):
        sources.set(key, where)  # a preset then names its own file
        tree[key] = _expand_section(key, value, where, sources)
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


# --- typed conversion -------------------------------------------------------------


def _experiment(data: dict[str, Any], sources: _Sources) -> ExperimentConfig:
    if isinstance(data.get("grpo"), dict) and "seed" in data["grpo"]:
        raise ConfigError(f"{sources.of('grpo.seed')}: grpo.seed: set the top-level seed (or seeds) instead")
    cfg = _build(ExperimentConfig, data, "", sources)
    _check_specs(cfg, sources)
    _check_strategy(cfg, sources)
    return cfg


def _build(cls: type, data: Any, prefix: str, sources: _Sources) -> Any:
    where = sources.of(prefix)
    label = prefix or "the experiment"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {label}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = _join(prefix, str(unknown[0]))
        raise ConfigError(
            f"{sources.of(key)}: {key}: unknown key; valid keys of {label}: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{sources.of(key)}: {key}: missing required key")
            continue
        value = data[name]
        kwargs[name] = _coerce(value, hints[name], key, sources)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        bad = next((n for n in fields if re.match(rf"\W*{re.escape(n)}\b", str(error))), None)
        key = _join(prefix, bad) if bad else label
        raise ConfigError(f"{sources.of(key)}: {key}: {error}") from None


def _coerce(value: Any, hint: Any, key: str, sources: _Sources) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key, sources)
            except ConfigError as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{sources.of(key)}: {key}: expected {_type_name(hint)}, got {_show(value)}")
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key, sources)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ConfigError(f"{sources.of(key)}: {key}: expected {_type_name(hint)}, got {_show(value)}")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(v, item, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{sources.of(key)}: {key}: expected a mapping, got {_show(value)}")
        _, item = typing.get_args(hint) or (str, Any)
        return {str(k): _coerce(v, item, f"{key}.{k}", sources) for k, v in value.items()}
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint)
    if ok is None:
        raise TypeError(f"unsupported config type {hint!r} at {key}")
    if not ok:
        raise ConfigError(f"{sources.of(key)}: {key}: expected {_type_name(hint)}, got {_show(value)}")
    return float(value) if hint is float else value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --- semantic checks ---------------------------------------------------------------


def _check_specs(cfg: ExperimentConfig, sources: _Sources) -> None:
    specs = [(f"stream.train[{i}]", s) for i, s in enumerate(cfg.stream.train)]
    specs += [(f"stream.test[{i}]", s) for i, s in enumerate(cfg.stream.test)]
    if cfg.model.warmstart is not None:
        specs += [(f"model.warmstart.envs[{i}]", s) for i, s in enumerate(cfg.model.warmstart.envs)]
    if isinstance(cfg.orders, list):
        specs += [(f"orders[{i}][{j}]", s) for i, order in enumerate(cfg.orders) for j, s in enumerate(order)]
    for key, spec in specs:
        check_spec(spec, f"{sources.of(key)}: {key}")
    valid_envs = envs.names()
    for name in cfg.stream.env_options:
        if name not in valid_envs:
            key = f"stream.env_options.{name}"
            raise ConfigError(f"{sources.of(key)}: {key}: unknown environment {name!r}; valid: {', '.join(valid_envs)}")


def check_spec(spec: str, where: str) -> None:
    """Validate an ``env:difficulty`` spec; ``where`` prefixes the error (file and key)."""
    try:
        envs.parse_spec(spec)
    except UnknownNameError as error:
        raise ConfigError(f"{where}: {error}") from None
    except ImportError as error:
        raise EnvUnavailableError(
            f"{where}: environment {spec.partition(':')[0]!r} cannot be loaded here ({error}); "
            "is an optional extra or dependency missing (e.g. pip install 'contrail[alfworld]')?"
        ) from None


def _check_strategy(cfg: ExperimentConfig, sources: _Sources) -> None:
    name = cfg.strategy.name
    if name not in strategies.names():
        key = "strategy.name"
        raise ConfigError(
            f"{sources.of(key)}: {key}: unknown strategy {name!r}; valid: {', '.join(strategies.names())} "
            f"(presets: {', '.join(preset_names('strategy'))})"
        )
    moved = {"steps_per_experience": "stream.steps_per_experience", "seed": "seed"}
    for option, home in moved.items():
        if option in cfg.strategy.options:
            key = f"strategy.options.{option}"
            raise ConfigError(f"{sources.of(key)}: {key}: set {home} instead")
    valid = [o for o in strategies.options(name) if o not in moved]
    for option in cfg.strategy.options:
        if option not in valid:
            key = f"strategy.options.{option}"
            raise ConfigError(
                f"{sources.of(key)}: {key}: unknown option of strategy {name!r}; valid: {', '.join(valid) or '(none)'}"
            )
    try:
        strategies.make(name, **cfg.strategy.options)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{sources.of('strategy.options')}: strategy.options: {error}") from None
    weights = cfg.strategy.options.get("weights")
    if isinstance(weights, dict):
        trainable = set(cfg.stream.train)
        if isinstance(cfg.orders, list):
            trainable |= {s for order in cfg.orders for s in order}
        for exp in weights:
            if exp not in trainable:
                key = f"strategy.options.weights.{exp}"
                raise ConfigError(
                    f"{sources.of(key)}: {key}: not a training experience; valid: {', '.join(sorted(trainable))}"
                )


# --- fan-out over orders and seeds --------------------------------------------------


def order_label(order: Sequence[str]) -> str:
    """A directory-safe name for a training order: ``babyai-easy__textcraft-easy``."""
    return "__".join(re.sub(r"[^\w.-]+", "-", spec) for spec in order)


def run_label(cfg: ExperimentConfig) -> str:
    """The group a run belongs to in comparisons: strategy (and options) and order, never the seed."""
    options = ", ".join(f"{k}={v}" for k, v in sorted(cfg.strategy.options.items()))
    strategy = f"{cfg.strategy.name}({options})" if options else cfg.strategy.name
    return f"{strategy}: {' → '.join(cfg.stream.train)}"


def expand_runs(cfg: ExperimentConfig) -> list[ExperimentConfig]:
    """One config per (order, seed), each with its own ``out`` and a ``label`` for comparisons.

    ``orders: all`` means every permutation of ``stream.train``; a list of
    orders replaces ``stream.train`` order by order. Run directories are
    ``<out>/<order-label>/seed<k>`` (``<out>/seed<k>`` without orders, ``<out>``
    for a single run). When ``stream.test`` is empty, every run tests the same
    experiences (all those trained in any order), so their columns match.
    """
    if cfg.orders is None:
        orders = [None]
    elif cfg.orders == "all":
        orders = [list(p) for p in itertools.permutations(cfg.stream.train)]
    else:
        orders = [list(o) for o in cfg.orders]
    test = list(cfg.stream.test)
    if not test and cfg.orders is not None:
        test = list(dict.fromkeys(s for order in orders for s in order))
    seeds = cfg.seeds if cfg.seeds is not None else [cfg.seed]
    runs = []
    for order in orders:
        stream = cfg.stream if order is None else dataclasses.replace(cfg.stream, train=order, test=test)
        for seed in seeds:
            out = Path(cfg.out)
            if order is not None:
                out = out / order_label(order)
            if cfg.seeds is not None:
                out = out / f"seed{seed}"
            run = dataclasses.replace(cfg, seed=seed, seeds=None, orders=None, out=str(out), stream=stream)
            if cfg.label is None:
                run.label = run_label(run)
            else:
                run.label = f"{cfg.label}: {' → '.join(order)}" if order else cfg.label
            runs.append(run)
    return runs
