"""What the weight store stages and how it checks it: pure logic, no resources.

- which files are expected (the staging plan the staging program, `staging/`, enforces on the head),
- the scripts run on a node (stage.sh, export.sh, unexport.sh, check.sh + size_check.sh beside this
  file), rendered with `components.scripts`: the token reaches staging on stdin, never argv,
- the NFS export and the docker volume options a worker mounts,
- the visibility check run from each node's side,
- parsing the staging output back into a manifest.

Everything named on a node carries the stack's prefix (`labels.stack_prefix`): two stacks on one
head keep their own export file and containers, and an export change touches only this stack's entries
(`exportfs -o` / `exportfs -u`, never `exportfs -ra`, which would re-sync every export on the host).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from components import scripts, shipped
from components.weights.staging.plan import MANIFEST_MARKER, MAX_STREAMS

MODEL_DIR = "model"
ENGRAM_DIR = "engram-src"
# The EXL3 2.9bpw checkpoint: every file of the repo, exactly this many top-level shards.
MODEL_SHARD_COUNT = 39
# The base model: only the shards that carry the Engram tables, plus its index and config.
ENGRAM_SHARD_TOTAL = 48
ENGRAM_SHARDS = (47, 48)
ENGRAM_INDEX = "model.safetensors.index.json"
ENGRAM_CONFIG = "config.json"
ENGRAM_EXTRA_FILES = (ENGRAM_INDEX, ENGRAM_CONFIG)
# What every rank mounts at /engram-src: built by staging beside engram-src/ from what it downloaded, hardlinks of
# shards 47 and 48 and config.json (no extra bytes) and an index listing only the Engram embed tables. vLLM's
# default loader loads every shard an index names: given the base repo's native index (48 shards listed, 2
# present) it would pull the whole tree (upstream's scripts/prepare_engram_src.py). Named for its reader, vLLM
# (`engram_table_dir`), and not `engram-src/`, which keeps meaning what the recipe's layout says: the base repo's
# own files and native index, which the staging count check reads.
ENGRAM_VLLM_DIR = "engram-vllm"
ENGRAM_EMBED_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")
# The directories a rank reads (mounted at /model and /engram-src): what a worker's share or copy must hold.
SERVED_DIRS = (MODEL_DIR, ENGRAM_VLLM_DIR)

EXPORTS_DIR = "/etc/exports.d"
# Tests point the exports directory elsewhere; the Pulumi args never carry it.
# The one file every stack shared before names were per stack; migrated when it holds exactly our export.
LEGACY_EXPORTS_NAME = "dsv41-exl3.exports"
EXPORT_OPTIONS = "ro,sync,no_subtree_check"
NFS_MOUNT_OPTIONS = "nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600"
_MOUNT_IN_CHECK = "/w"
_EXPORT_ENTRY = "# export: "
_PREFIX = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")


def _checked_prefix(stack_prefix: str) -> str:
    if not _PREFIX.match(stack_prefix):
        raise ValueError(
            f"stack_prefix={stack_prefix!r} is not a safe node-side name; derive it with components.labels.stack_prefix"
        )
    return stack_prefix


def exports_name(stack_prefix: str) -> str:
    """This stack's file in /etc/exports.d (kept there so the export survives a reboot)."""
    return f"{_checked_prefix(stack_prefix)}.exports"


def stage_container(stack_prefix: str) -> str:
    return f"{_checked_prefix(stack_prefix)}-stage-weights"


def check_container(stack_prefix: str) -> str:
    return f"{_checked_prefix(stack_prefix)}-weights-check"


# The staging program: this package and the files its imports name, one zip application run on the head.
STAGE_PROGRAM = "components.weights.staging.main"


def stage_program_text() -> str:
    """The staging program as one line of base64 (a zip application, the same bytes for the same files), shipped to
    the head on stdin after the token line; stage.sh decodes it to stage_weights.pyz."""
    return shipped.zipapp_text(STAGE_PROGRAM)


def engram_shard_name(index: int, total: int = ENGRAM_SHARD_TOTAL) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def staging_plan(
    *, model_repo: str, engram_repo: str, revision: str, download_streams: int | None = None
) -> dict[str, Any]:
    """The plan the staging program enforces: repos, destinations, selected files and count rules, and how many
    files it downloads at once (`weights.downloadStreams`; None leaves the count out: one at a time)."""
    for key, repo in (("model_repo", model_repo), ("engram_repo", engram_repo)):
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise ValueError(f"{key}={repo!r} is not a Hugging Face repo id; use 'org/name'")
    if not revision or any(c.isspace() for c in revision):
        # Invariant: the config refuses such a `weights.revision`; the revision is written into the staging script.
        raise ValueError(f"revision={revision!r} is not a git revision; use a branch, tag or commit")
    if download_streams is not None and not 1 <= download_streams <= MAX_STREAMS:
        # Invariant: the config bounds `weights.downloadStreams` the same way.
        raise ValueError(f"download_streams={download_streams} must be from 1 to {MAX_STREAMS}")
    engram_shards = [engram_shard_name(i) for i in ENGRAM_SHARDS]
    streams = {} if download_streams is None else {"download_streams": download_streams}
    return {
        **streams,
        "revision": revision,
        "repos": [
            {"repo": model_repo, "dest": MODEL_DIR, "files": None, "safetensors_count": MODEL_SHARD_COUNT},
            {
                "repo": engram_repo,
                "dest": ENGRAM_DIR,
                "files": sorted([*engram_shards, *ENGRAM_EXTRA_FILES]),
                "index_file": ENGRAM_INDEX,
                "index_shard_total": ENGRAM_SHARD_TOTAL,
                "required_shards": engram_shards,
                "engram_vllm": {
                    "dest": ENGRAM_VLLM_DIR,
                    "shards": engram_shards,
                    "config": ENGRAM_CONFIG,
                    "suffixes": list(ENGRAM_EMBED_SUFFIXES),
                },
            },
        ],
    }


def root_shell_expr(root: str) -> str:
    """`root` as a shell word that expands on the node: `~` is the remote user's home, not ours."""
    if root == "~":
        return '"$HOME"'
    if root.startswith("~/"):
        rest = root[2:].rstrip("/")
        return '"$HOME"' + (f"/{shlex.quote(rest)}" if rest else "")
    if root.startswith("/"):
        return shlex.quote(root.rstrip("/") or "/")
    raise ValueError(f"weights root={root!r} must be absolute or start with '~/' (e.g. '~/dsv41-exl3')")


def root_value(root: str) -> str:
    """`root` as stage.sh's WEIGHTS_ROOT: validated (as root_shell_expr), trailing slashes dropped; the script
    expands `~` itself, on the node."""
    root_shell_expr(root)
    if root == "~" or root.startswith("~/"):
        rest = root[2:].rstrip("/")
        return f"~/{rest}" if rest else "~"
    return root.rstrip("/") or "/"


def validate_ip(what: str, value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{what}={value!r} is not an IP address; give the node's fabric (CX-7) IP") from None


def stage_stdin(token: str | None, program: str) -> str:
    """What the staging command reads: the token line (empty when anonymous), then the program
    (`stage_program_text`: base64)."""
    # Invariant: components/config refuses a `weights.hfToken` with a line break (it would end the token line early).
    if token is not None and ("\n" in token or "\r" in token):
        raise ValueError("hf_token contains a line break; paste the token without newlines")
    return f"{token or ''}\n{program}"


def render_stage_command(
    *,
    root: str,
    image: str,
    plan: Mapping[str, Any],
    hf_endpoint: str | None,
    with_token: bool,
    timeout_s: int,
    stack_prefix: str,
) -> str:
    """stage.sh, rendered: read the token from stdin, then the program, run it in a throwaway container.

    The token only ever lives in an unexported variable of that shell and reaches the staging program on its
    stdin: never argv, never an environment variable (the container's Config.Env shows in `docker inspect`).
    """
    if timeout_s <= 0:
        raise ValueError(f"stage_timeout_s={timeout_s} must be positive (hours on real hardware)")
    return scripts.render(
        "weights/stage.sh",
        {
            "WEIGHTS_ROOT": root_value(root),
            "MODEL_DIR": MODEL_DIR,
            "ENGRAM_DIR": ENGRAM_DIR,
            "WITH_TOKEN": 1 if with_token else 0,
            "HF_ENDPOINT": hf_endpoint or "",
            "IMAGE": image,
            "CONTAINER": stage_container(stack_prefix),
            "PLAN": json.dumps(plan, sort_keys=True, separators=(",", ":")),
            "TIMEOUT_S": timeout_s,
        },
    )


@dataclass(frozen=True, kw_only=True)
class PageCacheDropped:
    """What staging (on the head) or a worker's copy dropped from the page cache after its check: files advised
    (hard links once), their bytes, and how many files it could not advise."""

    files: int
    bytes: int
    failed: int


@dataclass(frozen=True, kw_only=True)
class StagedWeights:
    """What staging reported: the absolute root on the head, {relative path: size}, {relative path: sha256},
    where on the head the staging step's record is (per file: repo, commit, size, sha256), and what it dropped
    from the page cache (None: an older staging script, which dropped nothing)."""

    root: str
    files: dict[str, int]
    sha256: dict[str, str]
    manifest_file: str | None
    page_cache: PageCacheDropped | None = None

    def manifest_json(self) -> str:
        return json.dumps(self.files, sort_keys=True)


def parse_stage_output(stdout: str) -> StagedWeights:
    """The manifest line the staging script printed last; anything else on stdout is ignored.

    `sha256`, `manifest_file` and `page_cache` are absent from what an older staging script printed (a stack's
    state keeps that output until staging runs again): then empty / None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MANIFEST_MARKER + " ")]
    if not lines:
        raise ValueError(f"weights staging printed no '{MANIFEST_MARKER}' line; see the staging command's stderr")
    raw = json.loads(lines[-1][len(MANIFEST_MARKER) + 1 :])
    root, files = raw.get("root"), raw.get("files")
    if not isinstance(root, str) or not root.startswith("/"):
        raise ValueError(f"weights staging reported root={root!r}; expected an absolute path on the head")
    if (
        not isinstance(files, dict)
        or not files
        or not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in files.items())
    ):
        raise ValueError("weights staging reported no files or a malformed manifest; re-run staging")
    digests = raw.get("sha256") or {}
    if not isinstance(digests, dict) or not all(
        k in files and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in digests.items()
    ):
        raise ValueError("weights staging reported malformed sha256 digests; re-run staging")
    manifest_file = raw.get("manifest_file")
    if manifest_file is not None and (not isinstance(manifest_file, str) or not manifest_file.startswith("/")):
        raise ValueError(f"weights staging reported manifest_file={manifest_file!r}; expected an absolute path")
    return StagedWeights(
        root=root,
        files=dict(sorted(files.items())),
        sha256=dict(sorted(digests.items())),
        manifest_file=manifest_file,
        page_cache=parse_page_cache(raw.get("page_cache")),
    )


def served_files(files: Mapping[str, int]) -> dict[str, int]:
    """The staged files a rank reads: `model/` and the slim Engram directory, never `engram-src/` (the base repo's
    own files, whose native index would make vLLM's loader look for all 48 shards)."""
    served = {p: s for p, s in sorted(files.items()) if p.split("/", 1)[0] in SERVED_DIRS}
    if f"{ENGRAM_VLLM_DIR}/{ENGRAM_INDEX}" not in served:
        raise ValueError(
            f"weights staging reported no {ENGRAM_VLLM_DIR}/{ENGRAM_INDEX} (the output of a staging run before the "
            f"slim Engram directory existed); run staging again: `pulumi up` (it builds {ENGRAM_VLLM_DIR}/ from "
            f"the {ENGRAM_DIR}/ already staged, downloading nothing)"
        )
    return served


def parse_page_cache(raw: Any) -> PageCacheDropped | None:
    """`page_cache` as staging (or a worker's copy) reports it; absent from what an older script printed."""
    if raw is None:
        return None

    def count(key: str) -> int:
        value = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"the weights step reported page_cache={raw!r}; expected counts of files, bytes and failed"
            )
        return value

    return PageCacheDropped(files=count("files"), bytes=count("bytes"), failed=count("failed"))


def parse_manifest(manifest_json: str) -> dict[str, int]:
    raw = json.loads(manifest_json)
    if not isinstance(raw, dict):
        raise ValueError("weights manifest is not a JSON object of {path: size}")
    return {str(k): int(v) for k, v in raw.items()}


# --- NFS share -------------------------------------------------------------------------------------


def _export_clients(abs_root: str, worker_ips: Sequence[str]) -> list[str]:
    if not abs_root.startswith("/") or '"' in abs_root or "\n" in abs_root:
        raise ValueError(f"weights root {abs_root!r} cannot be exported; use an absolute path without quotes")
    if not worker_ips:
        raise ValueError("share='nfs' needs at least one worker to export the weights to")
    return [validate_ip("worker fabric_ip", ip) for ip in worker_ips]


def render_exports(abs_root: str, worker_ips: Sequence[str]) -> str:
    """This stack's exports file: <root> read-only, to each worker's fabric IP only (never a wildcard).
    A comment line per entry says what this file exported, so the next change withdraws exactly those."""
    clients = _export_clients(abs_root, worker_ips)
    entries = "".join(f"{_EXPORT_ENTRY}{ip} {abs_root}\n" for ip in clients)
    line = " ".join(f"{ip}({EXPORT_OPTIONS})" for ip in clients)
    return f'# managed by dsv41-exl3 (pulumi): the weights, read-only, to the workers\n{entries}"{abs_root}" {line}\n'


def legacy_exports(abs_root: str, worker_ips: Sequence[str]) -> str:
    """What the fixed-name file of earlier versions held for this export, byte for byte."""
    line = " ".join(f"{ip}({EXPORT_OPTIONS})" for ip in _export_clients(abs_root, worker_ips))
    return f'# managed by dsv41-exl3 (pulumi): the weights, read-only, to the workers\n"{abs_root}" {line}\n'


def render_export_command(
    *, head_name: str, abs_root: str, worker_ips: Sequence[str], stack_prefix: str, exports_dir: str = EXPORTS_DIR
) -> str:
    """export.sh, rendered: install this stack's exports file and export exactly its entries; idempotent. Needs
    root or passwordless sudo on the head. Other exports on the host are never re-synced (no `exportfs -ra`)."""
    clients = _export_clients(abs_root, worker_ips)
    return scripts.render(
        "weights/export.sh",
        {
            "HEAD_NAME": head_name,
            "WEIGHTS_ROOT": abs_root,
            "CLIENTS": " ".join(clients),
            "OPTIONS": EXPORT_OPTIONS,
            "EXPORTS_DIR": exports_dir,
            "EXPORTS_FILE": f"{exports_dir}/{exports_name(stack_prefix)}",
            "EXPORTS": scripts.text_value(render_exports(abs_root, worker_ips)),
            "EXPORT_ENTRY": _EXPORT_ENTRY,
            "LEGACY_FILE": f"{exports_dir}/{LEGACY_EXPORTS_NAME}",
            "LEGACY": scripts.text_value(legacy_exports(abs_root, worker_ips)),
        },
    )


def render_unexport_command(
    *, abs_root: str, worker_ips: Sequence[str], stack_prefix: str, exports_dir: str = EXPORTS_DIR
) -> str:
    """unexport.sh, rendered: withdraw this stack's export entries and its file (the weights stay on the head)."""
    fallback = "".join(f"{ip} {abs_root}\n" for ip in _export_clients(abs_root, worker_ips))
    return scripts.render(
        "weights/unexport.sh",
        {
            "EXPORTS_FILE": f"{exports_dir}/{exports_name(stack_prefix)}",
            "EXPORT_ENTRY": _EXPORT_ENTRY,
            "FALLBACK": scripts.text_value(fallback),
        },
    )


def nfs_volume_options(*, head_ip: str, device_path: str) -> dict[str, str]:
    """driver_opts of a local-driver docker volume that the worker's daemon mounts over NFS."""
    if not device_path.startswith("/"):
        raise ValueError(f"NFS device path {device_path!r} must be absolute on the head")
    return {
        "type": "nfs",
        "o": f"addr={validate_ip('head fabric_ip', head_ip)},{NFS_MOUNT_OPTIONS}",
        "device": f":{device_path}",
    }


def volume_name(prefix: str, which: str, options: Mapping[str, str]) -> str:
    """Docker volume name; carries a digest of its options so changed options make a new volume
    (docker cannot change a volume's options in place, and cannot remove one a container still uses)."""
    digest = hashlib.sha256(json.dumps(dict(options), sort_keys=True).encode()).hexdigest()[:8]
    safe = re.sub(r"[^a-zA-Z0-9_.-]", "-", f"{prefix}-{which}").strip("-.") or "dsv41-exl3"
    return f"{safe}-{digest}"


# --- visibility check ------------------------------------------------------------------------------


def render_size_check(*, node: str, root: str, files: Mapping[str, int], where: str) -> str:
    """size_check.sh, rendered: stat every manifest file under `root`, fail naming the node and the bad files."""
    if not files:
        raise ValueError(f"no manifest files to check on node {node}; staging reported none")
    listing = "".join(f"{size} {path}\n" for path, size in sorted(files.items()))
    return scripts.render(
        "weights/size_check.sh",
        {"NODE": node, "WEIGHTS_ROOT": root, "WHERE": where, "FILES": scripts.text_value(listing)},
    )


def _check(*, node: str, mode: str, size_check: str, timeout_s: int, volume: Mapping[str, str]) -> str:
    keys = ("CONTAINER", "IMAGE", "MODEL_VOLUME", "ENGRAM_VOLUME", "MOUNT", "MODEL_DIR", "ENGRAM_VLLM_DIR")
    return scripts.render(
        "weights/check.sh",
        {
            "NODE": node,
            "MODE": mode,
            "TIMEOUT_S": timeout_s,
            "SIZE_CHECK": scripts.text_value(size_check),
            **{k: volume.get(k, "") for k in keys},
        },
    )


def render_bind_check(*, node: str, abs_root: str, files: Mapping[str, int], timeout_s: int = 300) -> str:
    """Check from the node's own filesystem (the head, or a worker that shares the head's filesystem)."""
    inner = render_size_check(node=node, root=abs_root, files=files, where=f"host path {abs_root}")
    return _check(node=node, mode="bind", size_check=inner, timeout_s=timeout_s, volume={})


def render_volume_check(
    *,
    node: str,
    image: str,
    model_volume: str,
    engram_volume: str,
    files: Mapping[str, int],
    stack_prefix: str,
    timeout_s: int = 300,
) -> str:
    """Check through the node's docker volumes, exactly as the serving container will mount them: the files a rank
    reads (`model/` and the slim Engram directory; the engram volume is that directory)."""
    inner = render_size_check(
        node=node, root=_MOUNT_IN_CHECK, files=served_files(files), where=f"volumes {model_volume}, {engram_volume}"
    )
    return _check(
        node=node,
        mode="volume",
        size_check=inner,
        timeout_s=timeout_s,
        volume={
            "CONTAINER": check_container(stack_prefix),
            "IMAGE": image,
            "MODEL_VOLUME": model_volume,
            "ENGRAM_VOLUME": engram_volume,
            "MOUNT": _MOUNT_IN_CHECK,
            "MODEL_DIR": MODEL_DIR,
            "ENGRAM_VLLM_DIR": ENGRAM_VLLM_DIR,
        },
    )
