"""Node access: per node, the SSH connection for remote commands and a docker provider over ssh://.

Every other layer receives these; none builds its own connection. Both check the node's host key:
the connection carries it as `hostKey` (the command provider has no known_hosts file), the docker
provider's ssh reads it from the known_hosts file the program pinned it in (components/host_keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components.config import Node, Ssh
from components.ssh import SshTarget, ssh_options


@dataclass(frozen=True, kw_only=True)
class NodeAccessArgs:
    node: Node
    ssh: Ssh
    host_key: str
    """The node's pinned host key, authorized_keys form (`ssh-ed25519 AAAA...`)."""
    stack_dir: str
    """The stack's private key directory (components/ssh.py `stack_dir`): the docker provider's key lives there."""
    stack_keys: pulumi.Resource
    """StackKeys for stack_dir: the docker provider depends on it, so destroy removes the directory last."""
    # How the command provider dials the node: internal retry bounds, not operator settings (no config key).
    dial_error_limit: int = 3
    per_dial_timeout_s: int = 15


def ssh_target(node: Node, ssh: Ssh, stack_dir: str | None = None) -> SshTarget:
    key = ssh.private_key.get_secret_value() if ssh.private_key else None
    return SshTarget(
        host=node.host,
        port=node.port,
        user=node.user,
        private_key=key,
        agent_socket=ssh.agent_socket,
        known_hosts_file=ssh.known_hosts_file,
        stack_dir=stack_dir,
    )


class NodeAccess(pulumi.ComponentResource):
    """How the program reaches one node."""

    connection: remote.ConnectionArgs
    """SSH connection for pulumi_command.remote (secret: the whole input is), host key pinned."""
    docker_provider: docker.Provider
    """Docker provider talking to this node's daemon through `ssh ... docker system dial-stdio`."""
    target: SshTarget
    """The same node for the gates' log readers."""

    def __init__(self, name: str, args: NodeAccessArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:access:NodeAccess", name, None, opts)
        node, ssh = args.node, args.ssh
        self.target = ssh_target(node, ssh, args.stack_dir)
        self.connection = remote.ConnectionArgs(
            host=node.host,
            port=node.port,
            user=node.user,
            private_key=pulumi.Output.secret(ssh.private_key.get_secret_value()) if ssh.private_key else None,
            agent_socket_path=ssh.agent_socket,
            host_key=args.host_key,
            dial_error_limit=args.dial_error_limit,
            per_dial_timeout=args.per_dial_timeout_s,
        )
        # ssh_opts carry the key's file path (0600, in the stack's private directory), never the key itself.
        self.docker_provider = docker.Provider(
            f"{name}-docker",
            host=f"ssh://{node.user}@{node.host}:{node.port}",
            ssh_opts=ssh_options(self.target),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.stack_keys]),
        )
        self.register_outputs({"host": node.host, "dockerHost": f"ssh://{node.user}@{node.host}:{node.port}"})
