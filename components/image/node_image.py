"""NodeImage: the serving image pulled on one node through that node's docker provider."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_docker as docker


@dataclass(frozen=True, kw_only=True)
class NodeImageArgs:
    image: str
    provider: docker.Provider
    pull_timeout_minutes: int


class NodeImage(pulumi.ComponentResource):
    """The image on one node. Kept on destroy: re-pulling 22.5 GiB costs more than the disk."""

    image_id: pulumi.Output[str]
    """The local image id (sha256:...) the node's container runs."""
    repo_digest: pulumi.Output[str]
    """The registry digest that was pulled."""

    def __init__(self, name: str, args: NodeImageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:image:NodeImage", name, None, opts)
        timeout = f"{args.pull_timeout_minutes}m"
        image = docker.RemoteImage(
            f"{name}-pull",
            name=args.image,
            keep_locally=True,
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                retain_on_delete=True,
                custom_timeouts=pulumi.CustomTimeouts(create=timeout, update=timeout),
            ),
        )
        self.image_id = image.image_id
        self.repo_digest = image.repo_digest
        self.register_outputs({"imageId": self.image_id, "repoDigest": self.repo_digest})
