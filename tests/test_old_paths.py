"""State written before the layout move unpickles: every dynamic provider under its old module path."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (old module, class) as the state of a stack deployed at the last flat-layout commit names them.
OLD = [
    ("components.gates", "_GateProvider"),
    ("components.live_ranks", "LiveRanksProvider"),
    ("components.stack_keys", "StackKeysProvider"),
    ("components.verify", "VerifierProvider"),
]
# (module, class) as state written after the layout move names them: the shared provider base moved to
# components/dynamic.py, every provider class stayed where it was.
CURRENT = [
    ("components.gates.gates", "RendezvousGateProvider"),
    ("components.gates.gates", "ReadyGateProvider"),
    ("components.gates.live_ranks", "LiveRanksProvider"),
    ("components.access.stack_keys", "StackKeysProvider"),
    ("components.verify.verifier", "VerifierProvider"),
]
NEW = {
    "_GateProvider": "components.gates.gates",
    "LiveRanksProvider": "components.gates.live_ranks",
    "StackKeysProvider": "components.access.stack_keys",
    "VerifierProvider": "components.verify.verifier",
}


@pytest.mark.parametrize("module, name", OLD)
def test_a_provider_pickled_under_its_old_module_loads_as_the_class_the_program_uses(module: str, name: str) -> None:
    # A fresh interpreter, as `pulumi destroy` starts the dynamic provider: nothing imported beforehand.
    blob = base64.b64encode(f"c{module}\n{name}\n.".encode()).decode()
    code = (
        "import base64, pickle; from pulumi.dynamic.dynamic import *; "
        f"cls = pickle.loads(base64.b64decode('{blob}')); print(cls.__module__, cls.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [NEW[name], name]


@pytest.mark.parametrize("module, name", CURRENT)
def test_a_provider_pickled_by_the_moved_layout_still_loads(module: str, name: str) -> None:
    blob = base64.b64encode(f"c{module}\n{name}\n.".encode()).decode()
    code = (
        "import base64, pickle; from pulumi.dynamic.dynamic import *; "
        f"cls = pickle.loads(base64.b64decode('{blob}')); print(cls.__module__, cls.__name__, cls().delete)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == [module, name]


def test_an_unknown_old_name_still_fails_as_an_attribute_error() -> None:
    import components.gates

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        components.gates.Nope  # noqa: B018


# The gates' logic moved out of components/gates/rank_watch.py into one module per idea; state written before
# names its classes under rank_watch (or the flat components.rank_watch before that).
RANK_WATCH_MOVED = [
    ("RankSpec", "components.gates.observations"),
    ("ReadySettings", "components.gates.decisions"),
    ("RendezvousSettings", "components.gates.decisions"),
    ("ModelsEndpoint", "components.gates.decisions"),
    ("SshRankSource", "components.gates.poll_source"),
    ("StreamRankSource", "components.gates.stream_source"),
    ("FatalPattern", "components.gates.log_patterns"),
]


@pytest.mark.parametrize("old", ["components.gates.rank_watch", "components.rank_watch"])
@pytest.mark.parametrize("name, new", RANK_WATCH_MOVED)
def test_a_gate_class_pickled_under_rank_watch_loads_from_its_new_module(old: str, name: str, new: str) -> None:
    blob = base64.b64encode(f"c{old}\n{name}\n.".encode()).decode()
    code = (
        "import base64, pickle; from pulumi.dynamic.dynamic import *; "
        f"cls = pickle.loads(base64.b64decode('{blob}')); print(cls.__module__, cls.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [new, name]


def test_rank_watch_still_exports_every_public_name_of_the_modules_it_was_split_into() -> None:
    import importlib

    from components.gates import rank_watch

    for module in ("observations", "log_patterns", "decisions", "poll_source", "stream_source"):
        real = importlib.import_module(f"components.gates.{module}")
        for name, value in vars(real).items():
            if not name.startswith("_") and getattr(value, "__module__", None) == real.__name__:
                assert getattr(rank_watch, name) is value, f"{module}.{name}"
