"""The rendezvous and ready gates, the rank watching they share, and LiveRanks (what runs now)."""

from __future__ import annotations


def __getattr__(name: str) -> object:
    # Providers pickled before the layout move name `components.gates` (then a module) as their home.
    import importlib

    try:
        return getattr(importlib.import_module("components.gates.gates"), name)
    except AttributeError:
        raise AttributeError(f"module 'components.gates' has no attribute {name!r}") from None
