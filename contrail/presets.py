"""Preset YAML files and the search path that finds them.

A preset is a YAML mapping in a configuration group: ``streams/NAME.yaml``
(a `StreamSpec`) or ``strategies/NAME.yaml`` (a `StrategySpec`). An
experiment names one (``stream: paper5``) instead of spelling it out. The
groups are plain folders, not Python packages: nothing in them is imported.

A name is looked up, first match wins, in:

1. every ``--preset-dir`` given (``preset_dirs``), then every folder of
   ``$CONTRAIL_PRESET_PATH`` (``os.pathsep``-separated); each is a root
   holding ``streams/`` and ``strategies/``;
2. the experiment file's own folder, then the folder above it (so
   ``experiments/x.yaml`` finds ``streams/`` beside ``experiments/``, as in
   this repository's layout);
3. the presets shipped with contrail: ``contrail/_presets/`` inside an
   installed wheel (the build copies the top-level ``strategies/`` and
   ``streams/`` there), else the source checkout's top-level folders (an
   editable install or running from a clone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["ENV_VAR", "GROUPS", "PresetPlace", "find", "offers", "packaged_root", "search_path"]

ENV_VAR = "CONTRAIL_PRESET_PATH"
GROUPS = {"stream": "streams", "strategy": "strategies"}  # experiment section -> group folder


@dataclass(frozen=True)
class PresetPlace:
    """One root of the search path, with a label saying why it is searched."""

    label: str
    root: Path

    def file(self, section: str, name: str) -> Path:
        """Where preset ``name`` of ``section`` would be in this place."""
        return self.root / GROUPS[section] / f"{name}.yaml"

    def names(self, section: str) -> list[str]:
        """The presets of ``section`` this place offers."""
        return sorted(p.stem for p in (self.root / GROUPS[section]).glob("*.yaml"))


def packaged_root() -> Path:
    """The root of the presets shipped with contrail (see the module docstring)."""
    package = Path(__file__).resolve().parent
    installed = package / "_presets"
    if installed.is_dir():
        return installed
    checkout = package.parent
    if any((checkout / group).is_dir() for group in GROUPS.values()):
        return checkout
    return installed  # neither exists: a broken install offers no presets (and says so)


def search_path(experiment_file: str | Path | None = None, preset_dirs: Sequence[str | Path] = ()) -> list[PresetPlace]:
    """The places searched for presets, in order; duplicates (the same folder twice) dropped."""
    places = [PresetPlace(f"--preset-dir {d}", Path(d)) for d in preset_dirs]
    places += [PresetPlace(f"${ENV_VAR} {d}", Path(d)) for d in os.environ.get(ENV_VAR, "").split(os.pathsep) if d]
    if experiment_file is not None:
        folder = Path(experiment_file).resolve().parent
        places += [PresetPlace(f"beside {experiment_file}", folder),
                   PresetPlace(f"above {experiment_file}", folder.parent)]
    places.append(PresetPlace("packaged", packaged_root()))
    unique: list[PresetPlace] = []
    seen: set[Path] = set()
    for place in places:
        key = place.root.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(place)
    return unique


def find(section: str, name: str, places: Sequence[PresetPlace]) -> Path | None:
    """The first file of preset ``name`` of ``section`` along ``places``; None when no place has it."""
    for place in places:
        path = place.file(section, name)
        if path.is_file():
            return path
    return None


def offers(section: str, places: Sequence[PresetPlace]) -> str:
    """What each place offers, for an unknown-name message: ``packaged: paper5, quickstart; ...``."""
    parts = []
    for place in places:
        names = place.names(section)
        if names or place.label == "packaged" or place.label.startswith(("--preset-dir", "$")):
            parts.append(f"{place.label}: {', '.join(names) or '(none)'}")
    return "; ".join(parts)
