"""Which files of this checkout a program shipped to a node needs: derived from its imports, never listed by hand.

Pure logic: no resources. `module_files("components.supervisor.agent")` follows every `import components...` and
`from components... import ...` (at any depth, inside functions too) from that module's file, adds each package's
`__init__.py` on the way, and returns the repository-relative paths in a stable order. A new import in anything
the agent runs is shipped with it; a module that imports pulumi or pydantic would be found here and fail the
shipped-code test, not a container at 3 am.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "components"


def _file_of(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports: `from a.b import c` counts `a.b` and, when it is a module, `a.b.c`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if _file_of(f"{node.module}.{a.name}")}
    return {m for m in found if m == ROOT_PACKAGE or m.startswith(ROOT_PACKAGE + ".")}


def module_files(entry: str) -> tuple[str, ...]:
    """Every file the module `entry` needs, as paths relative to the repository, sorted."""
    seen: set[Path] = set()
    todo = [entry]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        # A module's packages run their __init__ first: each is needed too.
        for depth in range(1, len(parts) + 1):
            path = _file_of(".".join(parts[:depth]))
            if path is None:
                raise ImportError(f"{module} (imported on the way from {entry}) is not a file of this checkout")
            if path not in seen:
                seen.add(path)
                todo.extend(_imports(path))
    return tuple(sorted(str(p.relative_to(REPO)) for p in seen))
