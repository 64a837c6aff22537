"""The hub as staging will find it, asked from the operator's machine before hours of staging (`dsv41-exl3 doctor`).

For each repo of the staging plan (manifest.staging_plan, the plan the staging program enforces on the head): the
token accepted, the revision resolved to a commit, every planned file listed with its size, and the count rules
(staging/plan.py's own checks, not a second copy). A file above huggingface_hub's plain-HTTP cap (46.57 GiB, its
`MAX_HTTP_DOWNLOAD_SIZE`; the Engram shards are ~95 GiB each) is named with the route staging takes for it.

The listing is the hub's model-info API (`?blobs=true` gives each file's size), read with `requests`; staging asks
the same hub from the head, so a hub reachable here but not there is not seen (the head's preflight covers its
network only when staging runs).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from components.config import Settings
from components.weights.manifest import staging_plan
from components.weights.staging.hub import DEFAULT_ENDPOINT
from components.weights.staging.messages import StageError
from components.weights.staging.plan import HubFile, RepoPlan, check_safetensors_count, select_files

# huggingface_hub's constants.MAX_HTTP_DOWNLOAD_SIZE: its own download refuses a larger file without hf_xet.
PLAIN_HTTP_CAP_BYTES = 50 * 1000 * 1000 * 1000
LARGE_FILE_ROUTE = (
    "plain HTTP with Range resume by staging's own downloader (it sets no size cap; huggingface_hub's "
    "hf_hub_download would refuse these without hf_xet)"
)
TIMEOUT_S = 30
GIB = 1024**3

Get = Callable[..., Any]
"""requests.get's shape: (url, headers=..., timeout=...) -> a response with status_code, json()."""


@dataclass(frozen=True)
class HubVerdict:
    repo: str
    ok: bool
    detail: str
    fix: str = ""


def _listing(info: Any) -> dict[str, HubFile]:
    files: dict[str, HubFile] = {}
    for sibling in info.get("siblings") or []:
        name, size = sibling.get("rfilename"), sibling.get("size")
        if isinstance(name, str) and isinstance(size, int):
            lfs = sibling.get("lfs") or {}
            files[name] = HubFile(size=size, sha256=lfs.get("sha256"), blob_id=sibling.get("blobId"))
    return files


def check_repo(endpoint: str, token: str | None, revision: str, plan: RepoPlan, get: Get) -> HubVerdict:
    repo = plan.repo
    url = f"{endpoint.rstrip('/')}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = get(url, headers=headers, timeout=TIMEOUT_S)
    except requests.RequestException as error:
        return HubVerdict(
            repo,
            False,
            f"{endpoint} did not answer ({type(error).__name__})",
            "check weights.hfEndpoint and the network",
        )
    if resp.status_code in (401, 403):
        why = "refused the token" if token else "needs a token (a gated or private repo)"
        return HubVerdict(
            repo,
            False,
            f"{repo}: the hub {why} (HTTP {resp.status_code})",
            "set weights.hfToken to a token with read access to it (pulumi config set --secret --path weights.hfToken)",
        )
    if resp.status_code == 404:
        return HubVerdict(
            repo,
            False,
            f"{repo}@{revision}: not found on the hub (HTTP 404)",
            "check weights.modelRepo / weights.engramRepo and weights.revision",
        )
    if resp.status_code != 200:
        return HubVerdict(
            repo, False, f"{repo}: the hub answered HTTP {resp.status_code}", "retry; check the hub's status"
        )
    try:
        info = resp.json()
    except ValueError:
        return HubVerdict(repo, False, f"{repo}: the hub's answer is not JSON", "check weights.hfEndpoint")
    tree = _listing(info)
    try:
        selected = select_files(repo, revision, tree, plan.files)
        if plan.safetensors_count is not None:
            check_safetensors_count(repo, "the hub listing", selected, plan.safetensors_count)
    except StageError as error:
        detail, _, fix = str(error).partition("; ")
        return HubVerdict(repo, False, detail, fix)
    total = sum(f.size for f in selected.values())
    large = sorted(name for name, f in selected.items() if f.size > PLAIN_HTTP_CAP_BYTES)
    commit = str(info.get("sha") or revision)
    detail = f"{repo}@{revision} = {commit[:12]}: {len(selected)} files, {total / GIB:.1f} GiB"
    if large:
        detail += f"; {len(large)} above 46.57 GiB ({', '.join(large)}): {LARGE_FILE_ROUTE}"
    return HubVerdict(repo, True, detail)


def check_hub(s: Settings, get: Get = requests.get) -> list[HubVerdict]:
    """One verdict per repo of the staging plan, in the plan's order."""
    w = s.weights
    plan = staging_plan(model_repo=w.model_repo, engram_repo=w.engram_repo, revision=w.revision)
    endpoint = w.hf_endpoint or DEFAULT_ENDPOINT
    token = w.hf_token.get_secret_value() if w.hf_token else None
    return [check_repo(endpoint, token, w.revision, RepoPlan.from_json(r), get) for r in plan["repos"]]
