"""Every rank runs the same image build: the pulled image ids compared across nodes.

Each node pulls the mutable `:2.9bpw` tag on its own, so two pulls minutes apart can land two
different builds, and two builds in one tensor-parallel group compute garbage or hang. After the
pulls, the nodes' images are compared and the update fails, naming both nodes and both ids,
before any container is created from them.

What is compared: the registry digest (`repo@sha256:...`) when every node reports one, else the
local image id. The digest is the build's identity across nodes; the local id is not always:
docker's overlay2 and containerd image stores report different `.Id`s for the same pulled image
(the upstream launcher met this, its issue #8).

Pure comparison plus one apply-time check: `checked_image_ids` returns each node's image id as an
output that resolves only when all nodes agree, so a container that takes it as its image waits
for the comparison, and a mismatch fails the update before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi


@dataclass(frozen=True)
class PulledImage:
    """What one node's pull resolved to."""

    image_id: str | None
    repo_digest: str | None = None


class ImageMismatch(Exception):
    """Two nodes hold different builds of the serving image."""


def mismatch(image: str, pulled: Mapping[str, PulledImage]) -> str | None:
    """None when every node holds the same build (or nothing is known yet), else the diagnosis."""
    known = {node: p for node, p in pulled.items() if p.image_id}
    if len(known) < 2:
        return None
    by_digest = all(p.repo_digest for p in known.values())

    def identity(p: PulledImage) -> str:
        return (p.repo_digest if by_digest else p.image_id) or ""

    nodes = list(known)
    first = nodes[0]
    other = next((n for n in nodes[1:] if identity(known[n]) != identity(known[first])), None)
    if other is None:
        return None
    what = "repo digest" if by_digest else "image id"
    repo = image_repo(image)

    def show(node: str) -> str:
        p = known[node]
        extra = f" (image id {p.image_id})" if by_digest else ""
        return f"{node} has {what} {identity(p)}{extra}"

    return (
        f"the nodes hold different builds of {image}: {show(first)}, {show(other)}; every rank must run "
        "the same build (the tag moved between the pulls). Fix: pin one build by digest in `image` "
        f"(e.g. {repo}@sha256:...), or "
        f"remove the image on {other} (docker image rm {image}) so the next `pulumi up` pulls it again"
    )


def image_repo(image: str) -> str:
    """The reference without its digest and tag: `registry:5000/name` of `registry:5000/name:tag@sha256:...`."""
    name = image.split("@", 1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def checked_image_ids(
    image: str,
    image_ids: Mapping[str, pulumi.Input[str]],
    repo_digests: Mapping[str, pulumi.Input[str]],
) -> dict[str, pulumi.Output[str]]:
    """Per node, its image id, resolving only after every node's pull agreed (raises ImageMismatch)."""
    nodes = list(image_ids)
    pairs = pulumi.Output.all(*[pulumi.Output.all(image_ids[n], repo_digests.get(n)) for n in nodes])

    def check(values: list[list[str | None]]) -> dict[str, str | None]:
        pulled = {n: PulledImage(image_id=v[0], repo_digest=v[1]) for n, v in zip(nodes, values, strict=True)}
        problem = mismatch(image, pulled)
        if problem is not None:
            raise ImageMismatch(problem)
        return {n: p.image_id for n, p in pulled.items()}

    agreed = pairs.apply(check)
    return {n: agreed.apply(lambda ids, n=n: ids[n]) for n in nodes}  # type: ignore[misc]
