"""The key the endpoint requires: never open unless the stack says so.

`serve.apiKey` unset: a random key, made once by the stack's first `pulumi up` (`EndpointKey`), kept in the stack's
state (encrypted there like every secret, the same at every later update and on every operator's machine that
shares the state) and exported as the secret output `apiKey`. It is derived from nothing: another stack, another
cluster or the same SSH key give another key. `serve.apiKey: none`: the endpoint serves without a key, warned at
every preview. Any other value is the user's key.

Stacks deployed before the key was random held one derived from the stack's SSH private key (or kept in a file on
the operator's machine): their next `up` creates the `EndpointKey` (the preview lists it) and moves every client to
the new `apiKey` output, once.
"""

from __future__ import annotations

import secrets
from typing import Any

import pulumi
import pulumi.dynamic

from components.config import Settings
from components.dynamic import new_id

# `sk-` and 48 hex digits: 192 random bits.
KEY_BYTES = 24


def make_key() -> str:
    return f"sk-{secrets.token_hex(KEY_BYTES)}"


class EndpointKeyProvider(pulumi.dynamic.ResourceProvider):
    """A random key made at create, kept as it is for the resource's life: no input changes it."""

    def create(self, _props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        return pulumi.dynamic.CreateResult(id_=new_id("endpoint-key"), outs={"key": make_key()})

    def diff(self, _id: str, _olds: dict[str, Any], _news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        return pulumi.dynamic.DiffResult(changes=False)

    def update(self, _id: str, olds: dict[str, Any], _news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs={"key": olds["key"]})

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        """Nothing exists outside the state."""


class EndpointKey(pulumi.dynamic.Resource, module="keys", name="EndpointKey"):
    """The stack's generated API key (secret in the state and in every output)."""

    key: pulumi.Output[str]

    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(
            EndpointKeyProvider(),
            name,
            {"key": None},
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(additional_secret_outputs=["key"])),
        )


def endpoint_key(s: Settings, parent: pulumi.Resource) -> pulumi.Output[str] | None:
    """The key every request must carry, as a secret; None for an open endpoint (the user's choice)."""
    if s.open_endpoint:
        return None
    if s.serve.api_key is not None:
        return pulumi.Output.secret(s.serve.api_key.get_secret_value())
    return pulumi.Output.secret(EndpointKey("endpoint-key", pulumi.ResourceOptions(parent=parent)).key)
