"""Build hook: ship the top-level YAML presets inside the package (everything else is in pyproject.toml).

``strategies/`` and ``streams/`` sit beside ``contrail/`` (configuration
groups, no import name); the wheel carries them as ``contrail/_presets/``,
where `contrail.presets.packaged_root` finds them.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PRESET_GROUPS = ("strategies", "streams")


class BuildPyWithPresets(build_py):
    """``build_py`` that also copies ``<group>/*.yaml`` to ``contrail/_presets/<group>/``."""

    def run(self) -> None:
        super().run()
        root = Path(__file__).resolve().parent
        for group in PRESET_GROUPS:
            target = Path(self.build_lib) / "contrail" / "_presets" / group
            self.mkpath(str(target))
            for preset in sorted((root / group).glob("*.yaml")):
                self.copy_file(str(preset), str(target / preset.name))


setup(cmdclass={"build_py": BuildPyWithPresets})
