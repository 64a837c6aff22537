"""Layers of the dsv41-exl3 deployment: one folder per layer, shared pieces flat (docs/development.md: Component tree).

Dynamic providers are pickled into a stack's state by reference (module and class name), and `destroy` and
`refresh` unpickle them without running the program. A stack deployed before the layout move names modules
that moved (`components.live_ranks`, ...), and a resource unchanged since keeps that name: each old path
stays importable as an alias of its new module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

# Old flat module -> where it lives now. `components.gates` and `components.verify` became packages of the
# same name; their __init__ forwards the old names.
MOVED = {
    "components.live_ranks": "components.gates.live_ranks",
    "components.rank_watch": "components.gates.rank_watch",
    "components.stack_keys": "components.access.stack_keys",
    "components.verdict": "components.verify.verdict",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The same objects under the old name: an unpickled class is the class the program uses.
        real = importlib.import_module(MOVED[module.__name__])
        module.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})


if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.append(_OldPaths())
