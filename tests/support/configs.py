"""Stack configs tests start from: two Sparks as the recipe has them, the worker with its own NIC and GID."""

from __future__ import annotations

from typing import Any


def two_sparks(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "nodes": [
            {"name": "spark-head", "host": "10.0.0.1", "user": "me", "fabricIp": "192.168.100.1"},
            {
                "name": "spark-worker",
                "host": "10.0.0.2",
                "user": "me",
                "fabricIp": "192.168.100.2",
                "fabricInterface": "enp1s0f0np0",
                "ibHcas": ["rocep1s0f0"],
                "gidIndex": 3,
            },
        ],
        "ssh": {"privateKey": "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----"},
    }
    for key, value in overrides.items():
        raw[key] = value
    return raw
