"""The real program (this project directory) deployed on the simulated cluster by the Automation API.

The helpers live in `sim/deploy.py` (shared with `make bench`); the tests import them from here.
"""

from __future__ import annotations

from sim.deploy import (
    REPO,
    STEP_TIMEOUT,
    Deployment,
    assert_verified,
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
    "install_plugins",
    "new_deployment",
    "remove_deployment",
]
