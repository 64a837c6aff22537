"""The simulated cluster's images and its registry (stdlib only, as sim/cluster.py).

The registry's storage outside the work tree, each flavour's image name and reference (`standin`, `real`,
`prometheus`), building and pushing them with sim/image/build.sh and sim/image/prometheus.sh, and the digest
the registry serves for a tag.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from sim.cluster_layout import IMAGES, PROMETHEUS_BIN, PROMETHEUS_REPO, REGISTRY_ADDR, REPO, Layout, SimError, cache_dir
from sim.cluster_network import docker_ping
from sim.cluster_procs import daemon_env


def registry_storage() -> Path:
    """The registry's storage, outside the work tree (like the base tarballs): the images in it are keyed by
    their inputs, so a fresh clone's sim pushes nothing it already holds (the real image is ~6 GB)."""
    return cache_dir() / "sim" / "registry"


def prometheus_version() -> str:
    """The Prometheus version of this machine's Debian package (`2.42.0` of `2.42.0+ds`): the sim image's tag."""
    try:
        out = subprocess.run([PROMETHEUS_BIN, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise SimError(f"{PROMETHEUS_BIN}: {exc}; install Debian package prometheus (make sim-up does)") from exc
    words = (out.stdout + out.stderr).split()
    version = words[2] if len(words) > 2 and words[:2] == ["prometheus,", "version"] else ""
    version = version.split("+", 1)[0]
    if not version:
        raise SimError(f"cannot read a version from `{PROMETHEUS_BIN} --version`: {out.stdout[:200]!r}")
    return version


def image_name(flavor: str) -> str:
    """The registry path and tag of a flavour's image: `standin`, `real` (serving) or `prometheus`."""
    return f"{PROMETHEUS_REPO}:{prometheus_version()}" if flavor == "prometheus" else IMAGES[flavor]


def image_ref(flavor: str = "standin") -> str:
    return f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}/{image_name(flavor)}"


def build_image(layout: Layout, flavors: Sequence[str] = ("standin", "real", "prometheus")) -> None:
    """Build and push each flavour's image (each skips when the registry holds its inputs' build); the Prometheus
    image is built on the stand-in image, so after it."""
    for flavor in flavors:
        env = {
            **daemon_env(),
            "SIM_DOCKER_HOST": layout.docker_host(1),
            "SIM_FLAVOR": flavor,
            "SIM_STAMP_DIR": str(registry_storage() / "stamps"),
            "SIM_REGISTRY": f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}",
            "SIM_IMAGE": image_ref(flavor),
        }
        script = "build.sh"
        if flavor == "prometheus":
            script, env["SIM_BASE_IMAGE"] = "prometheus.sh", image_ref("standin")
        before = registry_digest(flavor)
        subprocess.run(["bash", str(REPO / "sim" / "image" / script)], env=env, check=True, timeout=3600)
        if before is not None and registry_digest(flavor) != before:
            # A new build under the same tag: untag the old one on every node, so each pulls the new build
            # (containers keep the image they run). Nodes left on the old build would run two builds at once.
            for i in layout.existing_nodes():
                if docker_ping(layout.socket(i)):
                    subprocess.run(
                        ["docker", "-H", layout.docker_host(i), "image", "rm", "--force", image_ref(flavor)],
                        capture_output=True,
                        timeout=60,
                    )


def registry_digest(flavor: str = "standin") -> str | None:
    """The digest the registry serves for a flavour's tag, or None when it has none yet."""
    host, port = REGISTRY_ADDR
    name, tag = image_name(flavor).rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{host}:{port}/v2/{name}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            digest: str | None = resp.headers.get("Docker-Content-Digest")
            return digest
    except (urllib.error.URLError, OSError):
        return None
