"""Supervisor: keeps the group serving between `pulumi up` runs, and brings it back after a reboot.

Per node, a remote.Command installs the agent's files (code from this checkout, config, token; all on stdin)
and a docker.Container of the serving image runs `python3 -m components.supervisor.agent` with restart
`unless-stopped`: docker restarts it after its own crash and when the daemon starts at boot, and the Sparks
have docker on every node already (no systemd unit to install, nothing that differs in the simulated cluster).
The head's agent leads (agent.py); the others only act on their own rank when it asks.

It is created after the verifier: nothing supervises a deployment that never verified.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import io
import json
import shlex
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components import labels, scripts
from components.access.addresses import http_url
from components.config import Settings
from components.gates.decisions import GateBounds
from components.shipped import module_files
from components.supervisor.agent_config import AgentConfig, AgentNode, GuardConfig, LeaderConfig

REPO = Path(__file__).resolve().parents[2]
# The program the agent's container runs; the files shipped with it are what it imports (components/shipped.py):
# its own modules, the verifier's verdict and probe, and the gates' decisions over the ranks' logs.
AGENT_MODULE = "components.supervisor.agent"
CODE_MOUNT = "/opt/dsv41-supervisor"
STATE_MOUNT = "/var/lib/dsv41-supervisor"
SOCKET_MOUNT = "/var/run/docker.sock"
SUPERVISOR_LABEL = "dsv41-exl3.supervisor"
CODE_LABEL = "dsv41-exl3.supervisor-code"
# How often a restart's boot reads every rank's state and new log lines: a fatal line ends it within about this.
BOOT_POLL_S = 1.0
# The container's own bound: the agent is a small Python process, and the head has ~4 GiB to spare.
MEMORY_MB = 256


def supervisor_token(s: Settings, stack: str, keys_dir: str) -> str:
    """The agents' shared bearer token: stable across updates, never in argv or a preview.

    Derived from the stack's SSH private key when the config has one (a second operator's machine derives the
    same); else kept in the stack's private key directory on this machine."""
    if s.ssh.private_key is not None:
        material = s.ssh.private_key.get_secret_value().encode()
        return hashlib.sha256(b"dsv41-exl3 supervisor\0" + stack.encode() + b"\0" + material).hexdigest()
    path = Path(keys_dir) / "supervisor.token"
    if not path.exists():
        import secrets

        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def agent_url(s: Settings, node_index: int) -> str:
    return http_url(s.nodes[node_index].fabric_ip, s.supervisor.port)


def leader_url(s: Settings, head_address: str) -> str:
    """Where the operator's machine (the CLI, the update lock) reaches the leading agent: the head's address
    (components/access/addresses.py), as the endpoint."""
    return http_url(head_address, s.supervisor.port)


def listen_hosts(s: Settings, node_index: int, head_address: str) -> list[str]:
    """Where a node's agent listens: its fabric address (the leader and the exporters reach it there) and, on the
    head, also the head's address, where the operator's machine reaches it. Never every address: the API
    stops and starts ranks (token or not, a port on a docker bridge or a public interface is not needed)."""
    fabric = s.nodes[node_index].fabric_ip
    return list(dict.fromkeys([fabric, head_address])) if node_index == 0 else [fabric]


def agent_config(
    s: Settings,
    stack: str,
    node_index: int,
    *,
    bounds: GateBounds,
    endpoint: str,
    generation: str,
    head_address: str,
) -> AgentConfig:
    """The agent's config file (no secret: the token is a file of its own, the API key is read from the head
    container's env)."""
    node = s.nodes[node_index]
    w, sup = s.watchdog, s.supervisor
    leader = LeaderConfig(
        nodes=tuple(
            AgentNode(
                name=n.name,
                url=agent_url(s, i),
                container=labels.container_name(stack, n.name),
                min_mem_gib=s.min_mem_available_gib_of(n),
            )
            for i, n in enumerate(s.nodes)
        ),
        # The head's own loopback view would do, but the endpoint is what clients see.
        endpoint=endpoint,
        # What the update that installs this config verified (the install runs after the verifier): the leader arms
        # for it when the head runs it, whatever it was armed for before (issue 43).
        generation=generation,
        model=s.serve.served_model_name,
        expected_answer=s.gates.expected_answer,
        probe_seconds=sup.probe_seconds,
        probe_timeout_s=15.0,
        max_restarts=sup.max_restarts,
        window_s=sup.window_hours * 3600,
        backoff_s=sup.backoff_seconds,
        mem_wait_s=sup.mem_wait_seconds,
        bounds=bounds,
        boot_poll_s=BOOT_POLL_S,
        verify_timeout_s=float(s.gates.verify_timeout_seconds),
        notify_command=sup.notify_command,
    )
    return AgentConfig(
        stack=stack,
        node=node.name,
        listen_hosts=tuple(listen_hosts(s, node_index, head_address)),
        listen_port=sup.port,
        token_file=f"{CODE_MOUNT}/token",
        state_dir=STATE_MOUNT,
        docker_socket=SOCKET_MOUNT,
        container=labels.container_name(stack, node.name),
        memory_guard=GuardConfig(
            floor_gib=w.mem_available_floor_gib, sample_s=w.sample_seconds, samples=w.consecutive_samples
        )
        if w.enabled
        else None,
        leader=leader if node_index == 0 else None,
    )


def payload(cfg: AgentConfig, token: str) -> tuple[str, str]:
    """(base64 tar.gz of the agent's files, config and token; hash of the code and config alone)."""
    buf = io.BytesIO()
    digest = hashlib.sha256()
    # gzip's header carries a time: mtime=0 keeps the same files the same payload (no diff at every preview).
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        entries = [(name, (REPO / name).read_bytes()) for name in module_files(AGENT_MODULE)]
        entries.append(("config.json", cfg.to_json().encode()))
        for name, data in entries:
            digest.update(name.encode() + b"\0" + data)
        entries.append(("token", token.encode()))
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode(), digest.hexdigest()[:16]


def notify_program(command: str) -> str:
    """The first word of supervisor.notifyCommand: what must exist in the image."""
    words = shlex.split(command) if command.strip() else []
    return words[0] if words else ""


def install_command(prefix: str, node: str, action: str, *, image: str = "", notify: str = "") -> str:
    script = scripts.render(
        "supervisor/install.sh",
        {
            "ACTION": action,
            "SHARE_DIR": f".local/share/{prefix}/supervisor-{node}",
            "STATE_DIR": f".local/state/{prefix}/supervisor-{node}",
            "IMAGE": image,
            "NOTIFY": notify,
        },
    )
    return scripts.sh_command(script, timeout_s=120, name="components/supervisor/install.sh")


@dataclass(frozen=True, kw_only=True)
class SupervisorNode:
    name: str
    index: int
    connection: pulumi.Input[remote.ConnectionArgs]
    docker_provider: docker.Provider
    image_id: pulumi.Input[str]


@dataclass(frozen=True, kw_only=True)
class SupervisorArgs:
    settings: Settings
    stack: str
    stack_prefix: str
    token: str
    endpoint: str
    head_address: str
    """The head's address (components/access/addresses.py): the operator's URL and the head agent's listener."""
    generation: pulumi.Input[str]
    """The ranks' generation label this update deploys; the agents are installed only once the verifier passed it."""
    bounds: GateBounds
    """The gates' bounds a restart's boot waits by, as the update's gates do."""
    nodes: Sequence[SupervisorNode]
    after: Sequence[pulumi.Resource]
    """The verifier: the supervisor starts only on a deployment that verified."""


class Supervisor(pulumi.ComponentResource):
    containers: dict[str, docker.Container]
    url: str
    """The leading agent's API (dsv41-exl3 supervisor status|pause|resume)."""

    def __init__(self, name: str, args: SupervisorArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:supervisor:Supervisor", name, None, opts)
        s = args.settings
        self.containers = {}
        for node in args.nodes:
            built = pulumi.Output.from_input(args.generation).apply(
                functools.partial(
                    _payload_for, s, args.stack, node.index, args.bounds, args.endpoint, args.head_address, args.token
                )
            )
            files: pulumi.Output[str] = built.apply(lambda b: b[0])
            code_hash: pulumi.Output[str] = built.apply(lambda b: b[1])
            notify = notify_program(s.supervisor.notify_command) if node.index == 0 else ""
            command = pulumi.Output.from_input(node.image_id).apply(
                functools.partial(_install_with_image, args.stack_prefix, node.name, notify)
            )
            install = remote.Command(
                f"{name}-{node.name}-files",
                connection=node.connection,
                create=command,
                update=command,
                delete=install_command(args.stack_prefix, node.name, "remove"),
                # Secret: it holds the token; the code's hash (a label below) shows a change in a preview.
                stdin=pulumi.Output.secret(files),  # type: ignore[arg-type]  # the SDK's stub infers Never for an Output
                add_previous_output_in_env=False,
                opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
            )
            paths = install.stdout.apply(_paths)
            self.containers[node.name] = docker.Container(
                f"{name}-{node.name}",
                name=f"{args.stack_prefix}-supervisor-{node.name}",
                image=node.image_id,
                entrypoints=["python3", "-u", "-m", AGENT_MODULE, f"{CODE_MOUNT}/config.json"],
                working_dir=CODE_MOUNT,
                envs=[f"PYTHONPATH={CODE_MOUNT}", "PYTHONDONTWRITEBYTECODE=1"],
                network_mode="host",
                # Back after its own crash and after the node's docker starts at boot; `docker stop` (the
                # operator's, or destroy) keeps it down.
                restart="unless-stopped",
                memory=MEMORY_MB,
                memory_swap=MEMORY_MB,  # no swap; docker's default (twice the limit) would show in every diff
                mounts=[
                    docker.ContainerMountArgs(target=CODE_MOUNT, source=paths["dir"], type="bind", read_only=True),
                    docker.ContainerMountArgs(target=STATE_MOUNT, source=paths["state"], type="bind"),
                    docker.ContainerMountArgs(target=SOCKET_MOUNT, source=paths["socket"], type="bind"),
                ],
                labels=[
                    docker.ContainerLabelArgs(label=SUPERVISOR_LABEL, value=args.stack),
                    docker.ContainerLabelArgs(label=CODE_LABEL, value=code_hash),
                ],
                log_opts={"max-size": "10m", "max-file": "3"},
                must_run=True,
                opts=pulumi.ResourceOptions(
                    parent=self, provider=node.docker_provider, depends_on=[install], delete_before_replace=True
                ),
            )
        self.url = leader_url(s, args.head_address)
        self.register_outputs({"url": self.url})


def _payload_for(
    s: Settings,
    stack: str,
    index: int,
    bounds: GateBounds,
    endpoint: str,
    head_address: str,
    token: str,
    generation: str,
) -> tuple[str, str]:
    cfg = agent_config(
        s, stack, index, bounds=bounds, endpoint=endpoint, generation=generation, head_address=head_address
    )
    return payload(cfg, token)


def _install_with_image(prefix: str, node: str, notify: str, image: str) -> str:
    return install_command(prefix, node, "install", image=image, notify=notify)


def _paths(stdout: str) -> dict[str, str]:
    line = [x for x in stdout.splitlines() if x.startswith("{")][-1]
    data = json.loads(line)
    return {k: str(data[k]) for k in ("dir", "state", "socket")}
