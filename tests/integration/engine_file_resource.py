"""A dynamic resource for engine tests: a file with given text. Importable by the dynamic provider process
(PYTHONPATH), so cloudpickle stores the provider class by reference."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult


class FileProvider(ResourceProvider):
    def create(self, props: dict[str, Any]) -> CreateResult:
        Path(props["path"]).write_text(props["text"])
        return CreateResult(id_=uuid.uuid4().hex, outs=dict(props))

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        changed = [k for k in ("path", "text") if olds.get(k) != news.get(k)]
        return DiffResult(changes=bool(changed), replaces=["path"] if "path" in changed else [])

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        Path(news["path"]).write_text(news["text"])
        return UpdateResult(outs=dict(news))

    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        return ReadResult(id_=id_, outs=dict(props))

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        Path(props["path"]).unlink(missing_ok=True)


class ScratchFile(Resource):
    path: pulumi.Output[str]
    text: pulumi.Output[str]

    def __init__(self, name: str, path: str, text: str, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(FileProvider(), name, {"path": path, "text": text}, opts)
