"""Whether the serving image has a build for a node's platform, asked before the pull (`dsv41-exl3 doctor`).

A Spark is linux/arm64; an image with only an amd64 build fails its pull after minutes of retries, or runs
under emulation where binfmt is installed. Pure logic beside the node script manifest_check.sh, which prints
the node's docker platform and `docker manifest inspect -v` of the image.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

from components import scripts

SCRIPT = "image/manifest_check.sh"


def registry_on_loopback(image: str) -> bool:
    """docker's own default insecure registries are 127.0.0.0/8: plain HTTP is allowed for those only."""
    first = image.split("/", 1)[0] if "/" in image else ""
    host = first.rsplit(":", 1)[0] if first.count(":") == 1 else first
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def render_manifest_check(image: str) -> str:
    return scripts.render(SCRIPT, {"IMAGE": image, "INSECURE": "1" if registry_on_loopback(image) else "0"})


@dataclass(frozen=True)
class ImageVerdict:
    ok: bool
    detail: str
    fix: str = ""


def _platforms(obj: object) -> list[str]:
    """`docker manifest inspect -v` prints one object (one build) or a list (a manifest list, one per build)."""
    entries = obj if isinstance(obj, list) else [obj]
    found = []
    for entry in entries:
        platform = entry.get("Descriptor", {}).get("platform") if isinstance(entry, dict) else None
        if isinstance(platform, dict) and platform.get("os") and platform.get("architecture"):
            variant = f"/{platform['variant']}" if platform.get("variant") else ""
            found.append(f"{platform['os']}/{platform['architecture']}{variant}")
    return found


def decide(image: str, output: str) -> ImageVerdict:
    """The node's verdict from manifest_check.sh's stdout."""
    lines = output.splitlines()
    platform = next((line.split(" ", 1)[1] for line in lines if line.startswith("platform ")), "")
    if not platform:
        return ImageVerdict(False, f"no platform reported for {image} (output: {output.strip()[:200]!r})")
    rest = lines[lines.index(f"platform {platform}") + 1 :]
    if not rest or rest[0] != "manifest":
        said = " ".join(line.strip() for line in rest[1:] if line.strip()) or "no message"
        return ImageVerdict(
            False,
            f"the registry's manifest of {image} cannot be read from here: {said}",
            "check the image name and tag, and `docker login` to its registry on this node as the SSH user",
        )
    try:
        builds = _platforms(json.loads("\n".join(rest[1:])))
    except json.JSONDecodeError:
        return ImageVerdict(False, f"docker manifest inspect of {image} printed no JSON")
    ours = platform.split("/")[:2]
    if any(b.split("/")[:2] == ours for b in builds):
        return ImageVerdict(True, f"{image} has a {platform} build (builds: {', '.join(builds)})")
    return ImageVerdict(
        False,
        f"{image} has no {platform} build (builds: {', '.join(builds) or 'none listed'}): its pull would fail here",
        f"use an image built for {platform} (a Spark is linux/arm64: the recipe's image is)",
    )


GPU_SCRIPT = "image/gpu_check.sh"
GPU_TIMEOUT_S = 120  # a container start with the NVIDIA runtime: seconds, not minutes


def render_gpu_check(image: str, gpus: str) -> str:
    return scripts.render(GPU_SCRIPT, {"IMAGE": image, "GPUS": gpus, "TIMEOUT_S": GPU_TIMEOUT_S})


def decide_gpu_in_container(image: str, gpus: str, output: str) -> ImageVerdict:
    """gpu_check.sh's stdout: ok when nvidia-smi inside the image lists a GPU; an absent image is not judged."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if lines[:1] == ["absent"]:
        return ImageVerdict(True, f"not checked: {image} is not on the node yet (the up pulls it, then its ranks ask)")
    if not lines or not lines[0].startswith("exit "):
        return ImageVerdict(False, f"no answer from the GPU check (output: {output.strip()[:200]!r})")
    listed = [line for line in lines[1:] if line.startswith("GPU ")]
    if lines[0] == "exit 0" and listed:
        return ImageVerdict(True, f"a container of the image sees {'; '.join(listed)}")
    said = lines[-1] if len(lines) > 1 else lines[0]
    return ImageVerdict(
        False,
        f"docker run --gpus {gpus} {image} nvidia-smi -L: {said}",
        "install the NVIDIA Container Toolkit and register its runtime (`sudo nvidia-ctk runtime configure "
        "--runtime=docker && sudo systemctl restart docker`), then `docker run --rm --gpus all IMAGE nvidia-smi -L`",
    )
