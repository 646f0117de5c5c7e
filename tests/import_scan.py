"""What a module imports, read from its source (never imported): for the import-graph and the
engine-layering tests."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(name: str, path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module imported from, names taken) for each import in the module, relative ones
    resolved; `import a.b` takes no names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source, [alias.name for alias in node.names]
