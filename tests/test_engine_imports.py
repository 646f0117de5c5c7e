"""The layers stand apart: importing any of dpengine loads neither Textual nor dptui's UI; the
engine core imports neither the run layer nor the event log; the event log imports no run layer."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import dpengine
from import_scan import imports, module_name

ENGINE = Path(dpengine.__file__).parent


def engine_modules() -> list[str]:
    names = []
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_engine_module_imports_without_the_ui():
    modules = engine_modules()
    assert "dpengine.distributed.worker" in modules and "dpengine.run.trainer" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'tui'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=ENGINE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_no_engine_module_imports_the_ui_even_inside_a_function():
    # Importing alone misses a deferred `from tui.cli import main` inside a function.
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("textual", "tui")]
    assert offenders == []


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, at the top or inside a function, relative imports resolved."""
    names = []
    for _, source, taken in imports(module_name(path, ENGINE.parent), path):
        names += [source] + [f"{source}.{t}" for t in taken]  # `from . import x` may name a submodule
    return names


def layer_offenders(folder: Path, forbidden: tuple[str, ...], *, top_only: bool = False) -> list[str]:
    paths = sorted(folder.glob("*.py") if top_only else folder.rglob("*.py"))
    return [
        f"{path.relative_to(ENGINE.parent)}: {name}"
        for path in paths
        if path.name != "__init__.py" or not top_only
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_the_engine_core_imports_neither_the_run_layer_nor_the_event_log():
    # dpengine's top level is the engine, as torch's nn/parallel is: scatter, replicate, apply, gather.
    assert (ENGINE / "data_parallel.py").exists() and (ENGINE / "run" / "trainer.py").exists()
    assert layer_offenders(ENGINE, ("dpengine.run", "dpengine.eventlog", "dpengine.script",
                                    "dpengine.distributed"), top_only=True) == []


def test_the_event_log_imports_no_run_layer():
    assert layer_offenders(ENGINE / "eventlog", ("dpengine.run", "dpengine.script", "dpengine.distributed")) == []


def test_the_layer_check_sees_a_relative_import(tmp_path, monkeypatch):
    # The check itself must catch `from ..run import x` inside a function.
    fake_engine = tmp_path / "dpengine"
    (fake_engine / "eventlog").mkdir(parents=True)
    (fake_engine / "eventlog" / "bad.py").write_text("def f():\n    from ..run.trainer import Trainer\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", fake_engine)
    assert layer_offenders(fake_engine / "eventlog", ("dpengine.run",)) == [
        "dpengine/eventlog/bad.py: dpengine.run.trainer", "dpengine/eventlog/bad.py: dpengine.run.trainer.Trainer"]


def test_the_package_loads_its_exports_on_first_use():
    # `dptui view` imports the event log, which lies in dpengine: that must not import torch (a
    # second and 200 MB), while `from dpengine import DataParallel` and torch.nn.parallel's
    # function names (which shadow submodules of the same name) work as before.
    script = (
        "import sys\n"
        "import dpengine, dpengine.eventlog.reader, dpengine.eventlog.summary, dpengine.run.recorded_run\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import dpengine.parallel_apply, dpengine.replicate, dpengine.data_parallel\n"
        "from dpengine import DataParallel, data_parallel, parallel_apply, replicate, StepRecord\n"
        "import types\n"
        "assert all(isinstance(f, types.FunctionType) for f in (data_parallel, parallel_apply, replicate))\n"
        "assert dpengine.parallel_apply is parallel_apply and dpengine.replicate is replicate\n"
        "assert DataParallel.__module__ == 'dpengine.data_parallel' and 'torch' in sys.modules\n"
        "assert set(dpengine.__all__) <= set(dir(dpengine))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=ENGINE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
