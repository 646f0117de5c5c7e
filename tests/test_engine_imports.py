"""The engine stands alone: importing any of it loads neither Textual nor dptui's UI."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import dpengine

ENGINE = Path(dpengine.__file__).parent


def engine_modules() -> list[str]:
    names = []
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_engine_module_imports_without_the_ui():
    modules = engine_modules()
    assert "dpengine.distributed.worker" in modules and "dpengine.trainer" in modules
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
