"""A recording mock engine: what the program registered, with its options and edges.

Pulumi's mocks do not expose dependencies, parents or resource options, so this
monitor records the raw RegisterResource requests (the pattern of the SDK's own
tests) and answers them like the stock MockMonitor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
from google.protobuf import json_format
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import rpc
from pulumi.runtime.mocks import _sync_await  # noqa: PLC2701 - the SDK's sync bridge for mocks
from pulumi.runtime.settings import SETTINGS
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _ensure_event_loop  # noqa: PLC2701 - the loop _sync_await runs

SECRET_SIG = rpc._special_sig_key  # noqa: SLF001 - the wire marker of a secret value
SECRET_VALUE = rpc._special_secret_sig  # noqa: SLF001


def wire_secret(value: Any) -> dict[str, Any]:
    """A secret value as the engine receives and stores it."""
    return {SECRET_SIG: SECRET_VALUE, "value": value}


@dataclass
class Registration:
    typ: str
    name: str
    urn: str
    parent: str
    dependencies: list[str]
    property_dependencies: dict[str, list[str]]
    provider: str
    delete_before_replace: bool
    retain_on_delete: bool
    custom_timeouts: dict[str, str]
    replacement_trigger: Any
    inputs: dict[str, Any]
    raw_inputs: dict[str, Any] = field(repr=False)
    aliases: list[dict[str, Any]] = field(default_factory=list)
    """Each alias as sent: `{"urn": ...}` or `{"spec": {"parentUrn": ...}}`."""
    additional_secret_outputs: list[str] = field(default_factory=list)
    """The outputs the program asked the state to keep secret (`additionalSecretOutputs`), in its order."""

    def stored(self) -> dict[str, Any]:
        """The inputs as the engine keeps them: on the wire, secrets still marked, without the pickled provider."""
        return {k: v for k, v in self.raw_inputs.items() if k != "__provider"}

    def secret_paths(self) -> set[str]:
        """Top-level input keys whose value (or part of it) is marked secret on the wire."""
        found: set[str] = set()

        def walk(key: str, v: Any) -> None:
            if isinstance(v, dict):
                if v.get(SECRET_SIG) == SECRET_VALUE:
                    found.add(key)
                for x in v.values():
                    walk(key, x)
            elif isinstance(v, list):
                for x in v:
                    walk(key, x)

        for k, v in self.raw_inputs.items():
            walk(k, v)
        return found


class Outputs(pulumi.runtime.Mocks):
    """Default answers: id = name, outputs = inputs plus per-type fixtures."""

    def __init__(self, fixtures: dict[str, Callable[[pulumi.runtime.MockResourceArgs], dict[str, Any]]]) -> None:
        self.fixtures = fixtures

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        extra = dict(self.fixtures.get(args.typ, lambda a: {})(args))
        # A fixture may give the id a provider returns (`__id`), when the program reads it.
        return extra.pop("__id", f"{args.name}-id"), {**args.inputs, **extra}

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        return {}, None


class RecordingMonitor(pmocks.MockMonitor):
    def __init__(self, mocks: pulumi.runtime.Mocks) -> None:
        super().__init__(mocks)
        self.registrations: list[Registration] = []

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - gRPC method name
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            raw = json_format.MessageToDict(request.object)
            ct = request.customTimeouts
            self.registrations.append(
                Registration(
                    typ=request.type,
                    name=request.name,
                    urn=response.urn,
                    parent=request.parent,
                    dependencies=list(request.dependencies),
                    property_dependencies={k: list(v.urns) for k, v in request.propertyDependencies.items()},
                    provider=request.provider,
                    delete_before_replace=request.deleteBeforeReplace,
                    retain_on_delete=request.retainOnDelete,
                    custom_timeouts={"create": ct.create, "update": ct.update, "delete": ct.delete},
                    replacement_trigger=(
                        json_format.MessageToDict(request.replacement_trigger)
                        if request.HasField("replacement_trigger")
                        else None
                    ),
                    inputs=rpc.deserialize_properties(request.object),
                    raw_inputs=raw,
                    aliases=[json_format.MessageToDict(a) for a in request.aliases],
                    additional_secret_outputs=list(request.additionalSecretOutputs),
                )
            )
        return response


@dataclass
class Recorded:
    registrations: list[Registration]
    outputs: dict[str, Any]
    secret_outputs: set[str] = field(default_factory=set)
    """Output keys whose value is a secret."""

    def of_type(self, typ: str) -> list[Registration]:
        return [r for r in self.registrations if r.typ == typ]

    def named(self, name: str) -> Registration:
        (r,) = [r for r in self.registrations if r.name == name]
        return r

    def by_urn(self, urn: str) -> Registration:
        (r,) = [r for r in self.registrations if r.urn == urn]
        return r

    def ancestors(self, reg: Registration) -> list[Registration]:
        out = []
        while reg.parent and not reg.parent.endswith("::stack-stack"):
            try:
                reg = self.by_urn(reg.parent)
            except ValueError:
                break
            out.append(reg)
        return out

    def depends_on(self, reg: Registration, other: Registration) -> bool:
        """True when `reg` waits for `other`, or for a resource inside `other` (a component's
        dependency reaches the engine as its children)."""
        deps = set(reg.dependencies)
        for urns in reg.property_dependencies.values():
            deps.update(urns)
        if other.urn in deps:
            return True
        for urn in deps:
            try:
                dep = self.by_urn(urn)
            except ValueError:
                continue
            if other.urn in {a.urn for a in self.ancestors(dep)}:
                return True
        return False


def run(
    program: Callable[[], dict[str, Any] | None],
    fixtures: dict[str, Callable[[pulumi.runtime.MockResourceArgs], dict[str, Any]]] | None = None,
    *,
    preview: bool = False,
    stack: str = "test",
    into: list[Registration] | None = None,
) -> Recorded:
    """Run `program` under the recording mock; return every registration and the resolved outputs."""
    mocks = Outputs(fixtures or {})
    monitor = RecordingMonitor(mocks)
    if into is not None:
        monitor.registrations = into  # the caller sees what was registered even if the program raises
    pulumi.runtime.set_mocks(mocks, project="dsv41-exl3", stack=stack, preview=preview, monitor=monitor)
    SETTINGS.rpc_manager.clear()
    SETTINGS.outputs.clear()
    outputs: dict[str, Any] = {}
    secret_outputs: set[str] = set()

    def body() -> None:
        result = program() or {}
        for k, v in result.items():
            output = pulumi.Output.from_input(v)
            outputs[k] = _sync_await(output.future())
            if _sync_await(output.is_secret()):
                secret_outputs.add(k)

    # The SDK's own barrier: returns once every registration and output has settled.
    try:
        _sync_await(run_pulumi_func(body))
    except BaseException:
        _cancel_leftovers()
        raise
    return Recorded(monitor.registrations, outputs, secret_outputs)


def _cancel_leftovers() -> None:
    """A failed program returns at its first failed RPC, leaving its other tasks pending on the loop every run
    shares: the next run would advance them (against its own monitor), and the exceptions they then set would be
    reported as never retrieved, on stderr, when collected at the process's exit. Cancel and drain them now."""
    loop = _ensure_event_loop()
    current = asyncio.current_task(loop) if loop.is_running() else None
    pending = [task for task in asyncio.all_tasks(loop) if not task.done() and task is not current]
    for task in pending:
        task.cancel()
    if pending:
        _sync_await(asyncio.gather(*pending, return_exceptions=True))
