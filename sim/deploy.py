"""The real program (this project directory) deployed on the simulated cluster by the Automation API.

Shared by the end-to-end tests (`tests/integration/program_support.py` re-exports these names) and `make bench`;
`tool_deployment` is the setup the one-stack tools (`make bench-heal`, `bench-image`, `bench-observability`,
`record-real`) start from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pulumi import automation as auto

from sim import stack as sim_stack
from sim.cluster_layout import default_layout

REPO = Path(__file__).resolve().parents[1]
STEP_TIMEOUT = 120


def read_versions(path: Path = REPO / "toolchain" / "versions.env") -> dict[str, str]:
    versions: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key] = value
    return versions


def install_plugins(pulumi_root: Path, env: dict[str, str], versions: dict[str, str]) -> None:
    """The project's providers into this PULUMI_HOME at the exact versions the SDKs request."""
    for name, key in (("docker", "DOCKER_PROVIDER_VERSION"), ("command", "COMMAND_PROVIDER_VERSION")):
        binary = pulumi_root / "bin" / f"pulumi-resource-{name}"
        proc = subprocess.run(
            [
                str(pulumi_root / "bin" / "pulumi"),
                "plugin",
                "install",
                "resource",
                name,
                versions[key],
                "--file",
                str(binary),
                "--exact",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        )
        if proc.returncode != 0:
            raise AssertionError(f"plugin install {name}: {proc.stdout}{proc.stderr}")


def program_env(pulumi_root: Path, base: Path, passphrase: str) -> dict[str, str]:
    """Environment for the real program's stacks: a file backend and a PULUMI_HOME (with both providers)
    under `base`, never a download."""
    (base / "backend").mkdir(parents=True, exist_ok=True)
    (base / "pulumi-home").mkdir(exist_ok=True)
    env = {
        "PULUMI_BACKEND_URL": f"file://{base / 'backend'}",
        "PULUMI_HOME": str(base / "pulumi-home"),
        "PULUMI_CONFIG_PASSPHRASE": passphrase,
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_IGNORE_AMBIENT_PLUGINS": "true",
        "PATH": os.pathsep.join(
            [str(pulumi_root / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
    }
    install_plugins(pulumi_root, env, read_versions())
    return env


def docker_on(index: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The docker CLI against sim node `index`'s own daemon (the tests' view, not the program's)."""
    return subprocess.run(
        ["docker", "-H", default_layout().docker_host(index), *args],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )


@dataclass
class Deployment:
    """One stack of the real program on the sim, its config as plain JSON, and the outputs of each run."""

    stack: auto.Stack
    sim: dict[str, Any]
    config: dict[str, Any]
    private_key: str
    env: dict[str, str]
    pulumi_root: Path
    lines: list[str] = field(default_factory=list)
    ops: dict[str, set[str]] = field(default_factory=dict)
    """From the last preview or up's engine events: resource name -> the step ops planned for it."""
    fields: dict[str, set[str]] = field(default_factory=dict)
    """From the same events: resource name -> the input fields whose difference planned the step."""
    last_verified: tuple[str, dict[int, str], Mapping[str, Any]] | None = None
    """The last up that verified: the config it deployed (canonical JSON), each rank's container id and running
    state just after it, and its outputs (the end-to-end tests' `ensure_verified` compares them with now)."""

    @property
    def name(self) -> str:
        return self.stack.name

    def container(self, node: dict[str, Any]) -> str:
        return f"dsv41-exl3-{self.name}-node-{node['index']}"

    def write_config(self, config: dict[str, Any]) -> None:
        self.config = config
        sim_stack.init_stack(self.name, config, self.private_key, env=self.env, pulumi_root=self.pulumi_root)

    def with_env(self, **extra: str) -> dict[str, Any]:
        """This deployment's config with serve.extraEnv entries added (a value of "" removes the entry)."""
        cfg: dict[str, Any] = json.loads(json.dumps(self.config))
        env = cfg["serve"]["extraEnv"]
        for k, v in extra.items():
            if v:
                env[k] = v
            else:
                env.pop(k, None)
        return cfg

    def up(self, **kwargs: Any) -> auto.UpResult:
        self.lines = []
        self.last_verified = None
        result = self.stack.up(on_output=self.lines.append, color="never", **kwargs)
        if verification_of(self, result.outputs) is None:
            self.last_verified = (canonical(self.config), self.rank_states(), result.outputs)
        return result

    def rank_states(self) -> dict[int, str]:
        """Each rank's container id and whether it runs (`<id> true`), by node index ("" where there is none)."""
        return {
            n["index"]: docker_on(
                n["index"], "inspect", "-f", "{{.Id}} {{.State.Running}}", self.container(n)
            ).stdout.strip()
            for n in self.sim["nodes"]
        }

    def up_fails(self, **kwargs: Any) -> tuple[str, float]:
        """Runs an up that must fail; returns the whole output and its wall time."""
        start = time.monotonic()
        self.lines = []
        try:
            self.stack.up(on_output=self.lines.append, color="never", **kwargs)
        except auto.CommandError as err:
            return str(err) + "\n".join(self.lines), time.monotonic() - start
        raise AssertionError("the up succeeded; it had to fail:\n" + "\n".join(self.lines[-40:]))

    def _record(self, event: Any) -> None:
        pre = getattr(event, "resource_pre_event", None)
        # The dynamic providers' default provider is re-registered whenever a dynamic resource changes; it
        # holds nothing on any node.
        if (
            pre is not None
            and pre.metadata.op not in ("same", "read")
            and "::pulumi:providers:pulumi-python::" not in pre.metadata.urn
        ):
            name = pre.metadata.urn.split("::")[-1]
            self.ops.setdefault(name, set()).add(str(pre.metadata.op.value))
            self.fields.setdefault(name, set()).update(pre.metadata.diffs or [])

    def preview(self) -> auto.PreviewResult:
        self.lines, self.ops, self.fields = [], {}, {}
        return self.stack.preview(diff=True, on_output=self.lines.append, on_event=self._record, color="never")

    def refresh(self) -> auto.RefreshResult:
        """`pulumi refresh`: the state reads back what runs on the nodes (the program does not run)."""
        self.lines = []
        return self.stack.refresh(on_output=self.lines.append, color="never")

    def cli(self, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess[str]:
        """The project's pulumi CLI on this stack, as an operator runs it."""
        proc = subprocess.run(
            [str(self.pulumi_root / "bin" / "pulumi"), *args, "--stack", self.name, "--non-interactive"],
            cwd=REPO,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"pulumi {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc


def canonical(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def verification_of(d: Deployment, outputs: Mapping[str, Any]) -> str | None:
    """None when the outputs say the stack verified with real logprobs at the expected endpoint, else why not."""
    verification = outputs["verification"].value if "verification" in outputs else None
    if not verification:
        return f"no verification in the outputs: {sorted(outputs)}"
    # The stack's expected answer: the recipe's Paris, or none for real vLLM's random-weight model.
    expected = d.config.get("gates", {}).get("expectedAnswer", "Paris")
    if expected not in verification["answer"]:
        return f"the verified answer does not say {expected!r}: {verification}"
    if not (verification["logprobs"] and all(-9999.0 < x["logprob"] <= 0 for x in verification["logprobs"])):
        return f"the verified logprobs are not real: {verification}"
    head = d.sim["nodes"][0]["ip"]
    endpoint = f"http://{head}:{d.config['serve']['port']}/v1"
    if outputs["endpoint"].value != endpoint:
        return f"endpoint {outputs['endpoint'].value!r}, expected {endpoint!r}"
    return None


def assert_verified(d: Deployment, outputs: Mapping[str, Any]) -> None:
    why = verification_of(d, outputs)
    if why is not None:
        raise AssertionError(why)


def new_deployment(
    sim: dict[str, Any],
    name: str,
    env: dict[str, str],
    pulumi_root: Path,
    *,
    weights_root: Path,
    configure: Callable[[dict[str, Any]], None] | None = None,
    **config_kw: Any,
) -> Deployment:
    config = sim_stack.sim_config(sim, weights_root=str(weights_root), **config_kw)
    if configure:
        configure(config)
    key = Path(sim["ssh"]["key"]).read_text()
    stack = sim_stack.init_stack(name, config, key, env=env, pulumi_root=pulumi_root)
    return Deployment(stack=stack, sim=sim, config=config, private_key=key, env=env, pulumi_root=pulumi_root)


@dataclass(frozen=True)
class Tool:
    """A one-stack tool on the running sim, as `tool_deployment` names its messages, directories and stack."""

    name: str
    """Its module (`bench.heal`): what its messages start with."""
    hint: str
    """How to run it with the toolchain, said when the toolchain is missing."""
    scratch: str
    """Its scratch directories: `dsv41-<scratch>-*` in the temp dir, `dsv41-<scratch>-weights-*` in /var/tmp."""
    stack: str
    """Its stack: `<stack>-<6 hex>`."""
    passphrase: str = "bench-only"


class ToolDeployment(NamedTuple):
    """A stack `tool_deployment` made, and its two scratch directories (the caller removes them)."""

    d: Deployment
    work: Path
    weights: Path


def tool_deployment(tool: Tool, **deployment_kw: Any) -> ToolDeployment:
    """The setup a one-stack tool on the running sim starts from: the toolchain of toolchain/env.sh
    (DSV41_TOOLCHAIN_DIR; else SystemExit naming the tool and its hint), the sim's sim.json, a work directory (the
    stack's backend and PULUMI_HOME) and a weights root, and a new stack of the real program on them.
    `deployment_kw` go to new_deployment (ports, server, supervisor, ...)."""
    pulumi_root = Path(os.environ.get("DSV41_TOOLCHAIN_DIR") or "")
    if not os.access(pulumi_root / "bin" / "pulumi", os.X_OK):
        raise SystemExit(f"{tool.name}: DSV41_TOOLCHAIN_DIR/bin/pulumi is missing; {tool.hint}")
    sim = json.loads((default_layout().state / "sim.json").read_text())
    work = Path(tempfile.mkdtemp(prefix=f"dsv41-{tool.scratch}-"))
    weights = Path(tempfile.mkdtemp(prefix=f"dsv41-{tool.scratch}-weights-", dir="/var/tmp"))
    d = new_deployment(
        sim,
        f"{tool.stack}-{uuid.uuid4().hex[:6]}",
        program_env(pulumi_root, work, tool.passphrase),
        pulumi_root,
        weights_root=weights,
        **deployment_kw,
    )
    return ToolDeployment(d, work, weights)


def remove_deployment(d: Deployment) -> None:
    """Destroy the stack and remove it (and its Pulumi.<stack>.yaml); the weights stay, as in real use."""
    try:
        d.stack.destroy(on_output=lambda _l: None, color="never")
    finally:
        d.stack.workspace.remove_stack(d.name, force=True)


def build_image_variant(image: str, on_index: int, tag_suffix: str, pad_mb: int = 0) -> str:
    """A new build of `image` (one more label, a new image id) on one sim node's docker only, not pushed.

    `pad_mb`: a layer of that many MiB of random bytes, so that pulling the build takes measurable time."""
    tag = f"{image}-{tag_suffix}"
    steps = [f"FROM {image}", f"LABEL dsv41-exl3.test-build={tag_suffix}"]
    if pad_mb:
        steps.append(f"RUN head -c {pad_mb}M /dev/urandom > /dsv41-pad")
    built = subprocess.run(
        ["docker", "-H", default_layout().docker_host(on_index), "build", "-q", "-t", tag, "-"],
        input="\n".join(steps) + "\n",
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    if built.returncode != 0:
        raise RuntimeError(f"docker build of {tag} on node {on_index} failed: {built.stdout}{built.stderr}")
    return tag
