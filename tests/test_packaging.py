"""The wheel carries the YAML presets inside the package and no top-level strategies/streams import names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "contrail", "strategies", "streams")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout's packaged files (builds leave no build/ or egg-info in the tree)."""
    copy = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, copy / name, ignore=shutil.ignore_patterns("__pycache__", "_presets"))
        else:
            shutil.copy2(origin, copy / name)
    return copy


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> zipfile.ZipFile:
    """The wheel pip builds from the copy."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(out), str(source)], check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("contrail-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_carries_every_preset(wheel):
    names = set(wheel.namelist())
    for group in ("strategies", "streams"):
        shipped = {f"contrail/_presets/{group}/{p.name}" for p in (ROOT / group).glob("*.yaml")}
        assert shipped and shipped <= names
        for preset in (ROOT / group).glob("*.yaml"):
            assert wheel.read(f"contrail/_presets/{group}/{preset.name}") == preset.read_bytes()


def test_the_wheel_has_no_top_level_preset_import_names(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert tops == {"contrail", "contrail-0.1.0.dist-info"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["contrail"]


def test_the_wheel_carries_the_license(wheel):
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith(".dist-info/LICENSE")
               for name in wheel.namelist())
    assert b"Apache License" in (ROOT / "LICENSE").read_bytes()[:200]


def test_an_installed_wheel_finds_its_presets(wheel, tmp_path):
    """Unpacked as site-packages would hold it, contrail.presets reads contrail/_presets."""
    wheel.extractall(tmp_path)
    script = ("from contrail import presets; place = presets.search_path()[-1]; "
              "print(place.root); print(','.join(place.names('stream')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    root, names = done.stdout.split()
    assert Path(root) == tmp_path / "contrail" / "_presets"
    assert "paper5" in names.split(",")


def test_an_editable_install_reads_the_checkout_s_presets(source, tmp_path):
    """``pip install -e``: the package is the checkout, and the presets are its top-level folders."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The new environment sees this one's packages (the build needs its setuptools): --system-site-packages
    # would show it the base interpreter's instead when this environment is itself a venv.
    inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    Path(inner, "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "-e", str(source)], check=True, capture_output=True, timeout=300)
    script = "from contrail import presets; print(presets.packaged_root()); print(presets.__file__)"
    done = subprocess.run([str(python), "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    root, module = done.stdout.split()
    assert Path(root) == source and Path(module) == source / "contrail" / "presets.py"
    assert not (source / "contrail" / "_presets").exists()  # nothing copied into the checkout


def test_importing_contrail_asks_torch_for_huge_pages_unless_the_user_said_otherwise():
    def value(environment):
        code = "import os, contrail; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
        return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                              check=True).stdout.strip()

    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert value(base) == "1"
    assert value({**base, "THP_MEM_ALLOC_ENABLE": "0"}) == "0"
