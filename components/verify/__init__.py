"""The verifier resource, its client (talking to the server), its logprob verdict, and the operators' check
(`dsv41-exl3 verify`)."""

from __future__ import annotations


def __getattr__(name: str) -> object:
    # Providers pickled before the layout move name `components.verify` (then a module) as their home.
    import importlib

    try:
        return getattr(importlib.import_module("components.verify.verifier"), name)
    except AttributeError:
        raise AttributeError(f"module 'components.verify' has no attribute {name!r}") from None
