"""The image stage: the serving image pulled on every node, and the one build every rank must run."""

from __future__ import annotations

import pulumi

from components.access.wiring import Access
from components.image.image_check import checked_image_ids
from components.image.node_image import NodeImage, NodeImageArgs
from components.wiring import Wiring

Images = dict[str, NodeImage]


def wire_images(w: Wiring, access: Access) -> Images:
    s = w.s
    return {
        n.name: NodeImage(
            f"image-{n.name}",
            NodeImageArgs(
                image=s.image,
                provider=access[n.name].docker_provider,
                pull_timeout_minutes=s.image_pull_timeout_minutes,
            ),
            opts=w.opts(),
        )
        for n in s.nodes
    }


def verified_image_ids(w: Wiring, images: Images) -> dict[str, pulumi.Output[str]]:
    """Per node, the pulled image's id, once every node holds the same build of the mutable tag: compared after
    the pulls, before any container."""
    return checked_image_ids(
        w.s.image,
        {n.name: images[n.name].image_id for n in w.s.nodes},
        {n.name: images[n.name].repo_digest for n in w.s.nodes},
    )
