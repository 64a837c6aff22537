"""The real program (this project directory) deployed on the simulated cluster by the Automation API.

The helpers live in `sim/deploy.py` (shared with `make bench`); the tests import them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from components.verify.client import probe_endpoint
from sim.deploy import (
    REPO,
    STEP_TIMEOUT,
    Deployment,
    assert_verified,
    canonical,
    docker_on,
    install_plugins,
    new_deployment,
    remove_deployment,
)

__all__ = [
    "REPO",
    "STEP_TIMEOUT",
    "Deployment",
    "assert_verified",
    "docker_on",
    "ensure_verified",
    "install_plugins",
    "new_deployment",
    "remove_deployment",
]


def ensure_verified(d: Deployment) -> Mapping[str, Any]:
    """The stack verified, as the test before left it, else an up that must verify; its outputs.

    Observed, not assumed: the config is the one the last verifying up deployed, every rank is the container
    that up left, still running, and the endpoint answers a 1-token completion with real logprobs now (the
    preview's own probe). Anything else (a fault test's failed up, a killed rank, a fault switched on in a
    container, a config written and not deployed) costs the up a test used to start with every time."""
    if d.last_verified is not None:
        config, ranks, outputs = d.last_verified
        if (
            config == canonical(d.config)
            and d.rank_states() == ranks
            and all(r.endswith(" true") for r in ranks.values())
        ):
            key = outputs["apiKey"].value if "apiKey" in outputs else None
            probe = probe_endpoint(outputs["endpoint"].value, outputs["model"].value, key, timeout_s=15)
            if probe.state == "healthy":
                return outputs
    outputs = d.up().outputs
    assert_verified(d, outputs)
    return outputs
