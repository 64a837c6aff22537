"""Every rank runs the same image build: the comparison, and the deployment failing before any container."""

from __future__ import annotations

from typing import Any

import pulumi
import pytest

from components.config import parse
from components.deployment import deploy
from components.image.image_check import ImageMismatch, PulledImage, checked_image_ids, image_repo, mismatch
from tests.support import recording
from tests.support.graph import CONTAINER, FIXTURES, config

IMAGE = "ghcr.io/miaai-lab/deepseek-v4.1-flash-exl3-2x-dgx-sparks:2.9bpw"
REMOTE_IMAGE = "docker:index/remoteImage:RemoteImage"


def test_two_nodes_with_different_image_ids_fail_naming_both_nodes_and_ids() -> None:
    problem = mismatch(IMAGE, {"spark-a": PulledImage("sha256:aaa"), "spark-b": PulledImage("sha256:bbb")})
    assert problem is not None
    assert "spark-a has image id sha256:aaa" in problem and "spark-b has image id sha256:bbb" in problem
    assert f"docker image rm {IMAGE}" in problem
    assert "ghcr.io/miaai-lab/deepseek-v4.1-flash-exl3-2x-dgx-sparks@sha256:" in problem


def test_repo_digests_decide_when_every_node_has_one() -> None:
    # same build, two image stores (overlay2 vs containerd report different ids): not a mismatch
    same = {"a": PulledImage("sha256:1", f"{IMAGE}@sha256:d1"), "b": PulledImage("sha256:2", f"{IMAGE}@sha256:d1")}
    assert mismatch(IMAGE, same) is None
    moved = {"a": PulledImage("sha256:1", "r@sha256:d1"), "b": PulledImage("sha256:1", "r@sha256:d2")}
    problem = mismatch(IMAGE, moved)
    assert problem is not None
    assert "a has repo digest r@sha256:d1" in problem and "b has repo digest r@sha256:d2" in problem


def test_same_ids_and_unknown_ids_pass() -> None:
    assert mismatch(IMAGE, {"a": PulledImage("sha256:1"), "b": PulledImage("sha256:1")}) is None
    assert mismatch(IMAGE, {"a": PulledImage("sha256:1"), "b": PulledImage(None)}) is None, "preview: not known yet"
    three = {"a": PulledImage("sha256:1"), "b": PulledImage("sha256:1"), "c": PulledImage("sha256:9")}
    problem = mismatch(IMAGE, three)
    assert problem is not None and "a has image id sha256:1" in problem and "c has image id sha256:9" in problem


def test_checked_ids_resolve_per_node_when_they_agree() -> None:
    def program() -> dict[str, Any]:
        ids = checked_image_ids(
            IMAGE, {"a": pulumi.Output.from_input("sha256:1"), "b": "sha256:1"}, {"a": "r@sha256:d", "b": "r@sha256:d"}
        )
        return {"a": ids["a"], "b": ids["b"]}

    assert recording.run(program).outputs == {"a": "sha256:1", "b": "sha256:1"}


NODE_EXPORTER = "observability-node-exporter-"


def _different_pulls(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    node = args.name.removeprefix("image-").removesuffix("-pull")
    return {"imageId": f"sha256:{node}", "repoDigest": f"{IMAGE.split(':')[0]}@sha256:{node}"}


def test_the_deployment_fails_before_any_container_when_two_nodes_pulled_different_builds() -> None:
    loaded = parse(config())
    registered: list[recording.Registration] = []
    with pytest.raises(Exception) as failure:
        recording.run(lambda: deploy(loaded, "dev"), {**FIXTURES, REMOTE_IMAGE: _different_pulls}, into=registered)
    text = str(failure.value)
    cause: BaseException | None = failure.value
    while cause is not None and not isinstance(cause, ImageMismatch):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, ImageMismatch) or "different builds" in text
    message = str(cause) if cause is not None else text
    assert "spark-0 has repo digest" in message and "spark-1 has repo digest" in message
    # The node exporters run their own image (observability.nodeExporterImage), not the serving build: they may
    # start. Every container of the serving image (the ranks, the supervisor's agents, the exporters) may not.
    serving_image = [r for r in registered if r.typ == CONTAINER and not r.name.startswith(NODE_EXPORTER)]
    assert not serving_image, f"no container may start from two builds: {[r.name for r in serving_image]}"


def test_the_deployment_passes_the_agreed_id_to_every_container() -> None:
    def same(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
        return {"imageId": "sha256:one", "repoDigest": "r@sha256:one"}

    rec = recording.run(lambda: deploy(parse(config()), "dev"), {**FIXTURES, REMOTE_IMAGE: same})
    assert {c.inputs["image"] for c in rec.of_type(CONTAINER)} == {"sha256:one"}


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("ghcr.io/o/n:2.9bpw@sha256:" + "a" * 64, "ghcr.io/o/n"),
        ("127.0.0.1:5000/o/n:tag", "127.0.0.1:5000/o/n"),
        ("127.0.0.1:5000/o/n@sha256:" + "b" * 64, "127.0.0.1:5000/o/n"),
        ("prom/prometheus", "prom/prometheus"),
    ],
)
def test_the_fix_names_the_repo_of_a_reference_with_a_digest_or_a_registry_port(image: str, repo: str) -> None:
    assert image_repo(image) == repo
