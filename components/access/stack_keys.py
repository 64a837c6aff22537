"""StackKeys: the stack's key directory (components/ssh.py `stack_dir`) lives as long as the stack.

The docker providers' stored `sshOpts` name a key file and control socket there, and `pulumi destroy` and
`pulumi refresh` run without the program, so the program cannot write the file for them: it stays,
private and owner-checked, under $XDG_STATE_HOME across runs and reboots. Every docker provider depends
on this resource, so a destroy deletes it after the containers and providers are gone, and its delete
removes the directory. Created, read and updated, it only records the path; the program writes the key
on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pulumi.dynamic

from components.dynamic import StateOnlyProvider
from components.ssh import remove_stack_dir


@dataclass(frozen=True, kw_only=True)
class StackKeysArgs:
    directory: str


class StackKeysProvider(StateOnlyProvider):
    # Moved (another XDG_STATE_HOME): an in-place update that keeps the old directory, a provider's stored
    # sshOpts may still name it until its own update succeeds.
    input_keys = ("directory",)
    id_prefix = "keys"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return {"directory": props["directory"]}

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        _remove(str(props.get("directory") or ""))


def _remove(directory: str) -> None:
    if not directory:
        return
    left = remove_stack_dir(Path(directory))
    if left:
        pulumi.log.warn(f"stack keys: {directory} kept: it holds files this program did not write: {left}")


class StackKeys(pulumi.dynamic.Resource, module="keys", name="StackKeys"):
    """Removes the stack's key directory when the stack is destroyed."""

    directory: pulumi.Output[str]
    """Where the docker providers' key file and control sockets live."""

    def __init__(self, name: str, args: StackKeysArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(StackKeysProvider(), name, {"directory": args.directory}, opts)
