"""The preflight stage: every node's check phase first (the old ranks keep serving), then its stop phase once
every node passed it and holds the image, so an image change serves on while 22.5 GiB download on each node."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi

from components.access.wiring import Access
from components.config import Node
from components.image.wiring import Images
from components.preflight.preflight import CHECK_COMPONENT, STOP_COMPONENT, Preflight, PreflightArgs, PreflightCheck
from components.preflight.spec import node_spec
from components.wiring import Wiring


@dataclass(frozen=True)
class Preflights:
    checks: dict[str, PreflightCheck]
    passed: dict[str, Preflight]
    """Per node: its stop phase passed; its `gid_index` is the one the rank uses."""


def node_spec_hash(w: Wiring, name: str) -> str:
    node = next(n for n in w.s.nodes if n.name == name)
    return hashlib.sha256(json.dumps([w.generation, node.model_dump(mode="json")]).encode()).hexdigest()[:16]


def _args(w: Wiring, access: Access, n: Node, stop_after: Sequence[pulumi.Resource]) -> PreflightArgs:
    return PreflightArgs(
        spec=node_spec(w.s, w.addresses, w.stack, w.generation, n),
        connection=access[n.name].connection,
        # Re-run exactly when this node's container will be created or replaced.
        rerun_on=[w.generation, node_spec_hash(w, n.name)],
        stop_after=stop_after,
    )


def wire_preflight(w: Wiring, access: Access, images: Images) -> Preflights:
    nodes = w.s.nodes
    checks = {
        n.name: PreflightCheck(
            f"precheck-{n.name}", _args(w, access, n, ()), opts=w.flattened(CHECK_COMPONENT, f"precheck-{n.name}")
        )
        for n in nodes
    }
    stop_after = [*(c.command for c in checks.values()), *images.values()]
    passed = {
        n.name: Preflight(
            f"preflight-{n.name}",
            _args(w, access, n, stop_after),
            opts=w.flattened(STOP_COMPONENT, f"preflight-{n.name}"),
        )
        for n in nodes
    }
    return Preflights(checks=checks, passed=passed)
