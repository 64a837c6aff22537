"""Where the project's toolchain lives and which versions it pins: shared by the engine tests' fixtures."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sim.deploy import read_versions  # one reader of toolchain/versions.env

REPO = Path(__file__).resolve().parents[2]
__all__ = ["read_versions", "toolchain_dir"]


def toolchain_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Same path as toolchain/env.sh computes (DSV41_TOOLCHAIN_DIR when that file was sourced)."""
    if env.get("DSV41_TOOLCHAIN_DIR"):
        return Path(env["DSV41_TOOLCHAIN_DIR"])
    cache = env.get("DSV41_CACHE") or str(Path(env.get("HOME", str(Path.home()))) / ".cache" / "dsv41-exl3")
    return Path(cache) / "toolchain" / f"pulumi-v{read_versions()['PULUMI_VERSION']}"
