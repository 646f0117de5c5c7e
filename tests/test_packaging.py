"""The wheel `pip wheel --no-deps .` builds holds every module of dpengine and tui, every
`.tcss` style sheet (those an app or screen loads too), and the `dptui` command.

Built from a copy of the sources, so the build leaves nothing in the working tree.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tui

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dpengine", "tui")
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=_SKIP)
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the venv's own setuptools (a test extra), no download.
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("dptui-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def source_files(pattern: str) -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob(pattern)
        if "__pycache__" not in path.parts
    }


def styles_loaded() -> set[str]:
    """Every style sheet a dptui app or screen names in CSS_PATH, relative to the sources."""
    found = set()
    for module in pkgutil.walk_packages(tui.__path__, "tui."):
        for cls in vars(importlib.import_module(module.name)).values():
            if not (isinstance(cls, type) and cls.__module__ == module.name and vars(cls).get("CSS_PATH")):
                continue
            paths = cls.CSS_PATH if isinstance(cls.CSS_PATH, list) else [cls.CSS_PATH]
            # As Textual reads them: a relative path is beside the file of the class that names it.
            for path in map(Path, paths):
                full = path if path.is_absolute() else Path(inspect.getfile(cls)).parent / path
                found.add(full.resolve().relative_to(ROOT).as_posix())
    return found


def test_the_wheel_holds_every_module_of_both_packages_and_nothing_else(wheel):
    names = set(wheel.namelist())
    modules = source_files("*.py")
    assert {"tui/script/app.py", "tui/view/replay.py", "dpengine/run/trainer.py",
            "dpengine/eventlog/writer.py", "dpengine/distributed/worker.py"} <= modules
    assert modules - names == set()
    assert {name.split("/")[0] for name in names} == {*PACKAGES, "dptui-0.1.0.dist-info"}


def test_the_wheel_holds_every_style_sheet_the_apps_load(wheel):
    names = set(wheel.namelist())
    loaded = styles_loaded()
    assert "tui/app.tcss" in loaded
    assert loaded <= source_files("*.tcss")  # named and there: else the app fails in the tree too
    assert source_files("*.tcss") - names == set()


def test_the_wheel_installs_the_dptui_command(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(entry_points).decode().splitlines()
    assert "[console_scripts]" in lines and "dptui = tui.cli:main" in lines
