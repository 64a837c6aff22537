"""Which files of this checkout a program shipped to a node needs: derived from its imports, never listed by hand.

Pure logic: no resources. `module_files("components.supervisor.agent")` follows every `import components...` and
`from components... import ...` (at any depth, inside functions too) from that module's file, adds each package's
`__init__.py` on the way, and returns the repository-relative paths in a stable order. A new import in anything
the agent runs is shipped with it; a module that imports pulumi or pydantic would be found here and fail the
shipped-code test, not a container at 3 am. `zipapp(entry)` packs those files into one zip application, the
same bytes for the same files, for a program shipped as one file (the staging program).
"""

from __future__ import annotations

import ast
import base64
import io
import stat
import zipfile
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


# A zip entry's time and mode, the same on every machine: the payload is an input of a Pulumi resource, and a
# byte of difference would show as a change at every preview. Stored, not deflated: the bytes then depend on
# the files alone, not on the zlib that compressed them.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_ZIP_MODE = 0o644


def zipapp(entry: str, main_call: str = "main") -> bytes:
    """A zip application of `entry` (run as `python3 app.pyz ARGS`): the files `module_files(entry)` finds and a
    `__main__.py` that exits with `entry.<main_call>()`'s status. The same files give the same bytes."""
    main = f"import sys\n\nfrom {entry} import {main_call}\n\nsys.exit({main_call}())\n"
    entries = [(name, (REPO / name).read_bytes()) for name in module_files(entry)]
    entries.append(("__main__.py", main.encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # unix: the mode below is read as unix permissions on every machine
            info.external_attr = (stat.S_IFREG | _ZIP_MODE) << 16
            zf.writestr(info, data)
    return buf.getvalue()


def zipapp_text(entry: str, main_call: str = "main") -> str:
    """`zipapp(entry, main_call)` as one line of base64: text, for a command's stdin (`base64 -d` on the node)."""
    return base64.b64encode(zipapp(entry, main_call)).decode()
