"""What the weight store stages and how it checks it: pure logic, no resources.

- which files are expected (the staging plan `stage_weights.py` enforces on the head),
- the shell run on the head to stage them (token on stdin, never argv),
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
from pathlib import Path
from typing import Any

from components.weights.stage_weights import MANIFEST_MARKER

MODEL_DIR = "model"
ENGRAM_DIR = "engram-src"
# The EXL3 2.9bpw checkpoint: every file of the repo, exactly this many top-level shards.
MODEL_SHARD_COUNT = 39
# The base model: only the shards that carry the Engram tables, plus its index and config.
ENGRAM_SHARD_TOTAL = 48
ENGRAM_SHARDS = (47, 48)
ENGRAM_INDEX = "model.safetensors.index.json"
ENGRAM_EXTRA_FILES = (ENGRAM_INDEX, "config.json")

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
        raise ValueError(f"stack_prefix={stack_prefix!r} is not a safe node-side name; "
                         "derive it with components.labels.stack_prefix")
    return stack_prefix


def exports_name(stack_prefix: str) -> str:
    """This stack's file in /etc/exports.d (kept there so the export survives a reboot)."""
    return f"{_checked_prefix(stack_prefix)}.exports"


def stage_container(stack_prefix: str) -> str:
    return f"{_checked_prefix(stack_prefix)}-stage-weights"


def check_container(stack_prefix: str) -> str:
    return f"{_checked_prefix(stack_prefix)}-weights-check"


def _refuse_whole_root(node: str) -> str:
    """sh: refuse a `$root` (already resolved with `pwd -P`) that is `/` or the SSH user's home itself.
    The weights root must be a directory of its own: it is exported, and staging removes files it staged there."""
    return f"""home=$(cd "${{HOME:-/nonexistent}}" 2>/dev/null && pwd -P) || home="${{HOME:-}}"
if [ "$root" = / ] || [ "$root" = "$home" ]; then
  echo "weights root $root on "{shlex.quote(node)}" is / or the home directory of $(id -un) itself;" \
    "use a directory of its own, e.g. ~/dsv41-exl3 (weights.root)" >&2
  exit 1
fi
"""


def stage_script_source() -> str:
    """The staging script's text, shipped to the head on stdin."""
    return (Path(__file__).with_name("stage_weights.py")).read_text()


def engram_shard_name(index: int, total: int = ENGRAM_SHARD_TOTAL) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def staging_plan(*, model_repo: str, engram_repo: str, revision: str) -> dict[str, Any]:
    """The plan `stage_weights.py` enforces: repos, destinations, selected files and count rules."""
    for key, repo in (("model_repo", model_repo), ("engram_repo", engram_repo)):
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise ValueError(f"{key}={repo!r} is not a Hugging Face repo id; use 'org/name'")
    if not revision or any(c.isspace() for c in revision):
        raise ValueError(f"revision={revision!r} is not a git revision; use a branch, tag or commit (default 'main')")
    engram_shards = [engram_shard_name(i) for i in ENGRAM_SHARDS]
    return {
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


def validate_ip(what: str, value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{what}={value!r} is not an IP address; give the node's fabric (CX-7) IP") from None


def stage_stdin(token: str | None, script: str) -> str:
    """What the staging command reads: the token line (empty when anonymous), then the script."""
    if token is not None and ("\n" in token or "\r" in token):
        raise ValueError("hf_token contains a line break; paste the token without newlines")
    return f"{token or ''}\n{script}"


def render_stage_command(*, root: str, image: str, plan: Mapping[str, Any], hf_endpoint: str | None,
                         with_token: bool, timeout_s: int, stack_prefix: str) -> str:
    """Shell run on the head: read the token from stdin, then the script, run it in a throwaway container.

    The token only ever lives in this shell's environment and reaches docker as `-e HF_TOKEN` (by name).
    """
    if timeout_s <= 0:
        raise ValueError(f"stage_timeout_s={timeout_s} must be positive (hours on real hardware)")
    env = ["-e HF_TOKEN"] if with_token else []
    if hf_endpoint:
        env.append(f"-e HF_ENDPOINT={shlex.quote(hf_endpoint)}")
    # The serving image may bake in HF_HUB_OFFLINE=1 (vLLM runs offline) or hf_transfer: staging needs neither.
    # Xet's chunk cache would fill the head's temp dir; HF_HOME lives in the throwaway stage dir.
    env += ["-e HF_HOME=/stage/hf-home", "-e HF_HUB_OFFLINE=0", "-e HF_HUB_ENABLE_HF_TRANSFER=0",
            "-e HF_XET_CHUNK_CACHE_SIZE_BYTES=0", "-e HF_HUB_DISABLE_PROGRESS_BARS=1",
            "-e HF_HUB_DISABLE_TELEMETRY=1"]
    token_line = ('IFS= read -r HF_TOKEN || true\nexport HF_TOKEN' if with_token
                  else 'IFS= read -r _unused || true')
    plan_json = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    name = stage_container(stack_prefix)
    return f"""set -eu
{token_line}
root={root_shell_expr(root)}
mkdir -p "$root"
root=$(cd "$root" && pwd -P)
{_refuse_whole_root("the head")}mkdir -p "$root/{MODEL_DIR}" "$root/{ENGRAM_DIR}"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cat > "$stage/stage_weights.py"
docker rm -f {name} >/dev/null 2>&1 || true
rc=0
timeout --kill-after=60 {timeout_s} docker run --rm --name {name} --network host --user "$(id -u):$(id -g)" \\
  {' '.join(env)} \\
  -v "$root":/weights -v "$stage":/stage --entrypoint python3 {shlex.quote(image)} \\
  /stage/stage_weights.py --plan {shlex.quote(plan_json)} --dest-root /weights --host-root "$root" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  docker rm -f {name} >/dev/null 2>&1 || true
  echo "weights staging timed out after {timeout_s}s on the head; raise stage_timeout_s and re-run (it resumes)" >&2
fi
exit "$rc"
"""


@dataclass(frozen=True, kw_only=True)
class StagedWeights:
    """What staging reported: the absolute root on the head, {relative path: size}, {relative path: sha256}
    and where on the head the staging step's record is (per file: repo, commit, size, sha256)."""

    root: str
    files: dict[str, int]
    sha256: dict[str, str]
    manifest_file: str | None

    def manifest_json(self) -> str:
        return json.dumps(self.files, sort_keys=True)


def parse_stage_output(stdout: str) -> StagedWeights:
    """The manifest line the staging script printed last; anything else on stdout is ignored.

    `sha256` and `manifest_file` are absent from what an older staging script printed (a stack's state
    keeps that output until staging runs again): then empty / None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MANIFEST_MARKER + " ")]
    if not lines:
        raise ValueError(f"weights staging printed no '{MANIFEST_MARKER}' line; see the staging command's stderr")
    raw = json.loads(lines[-1][len(MANIFEST_MARKER) + 1:])
    root, files = raw.get("root"), raw.get("files")
    if not isinstance(root, str) or not root.startswith("/"):
        raise ValueError(f"weights staging reported root={root!r}; expected an absolute path on the head")
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in files.items()):
        raise ValueError("weights staging reported no files or a malformed manifest; re-run staging")
    digests = raw.get("sha256") or {}
    if not isinstance(digests, dict) or not all(
            k in files and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in digests.items()):
        raise ValueError("weights staging reported malformed sha256 digests; re-run staging")
    manifest_file = raw.get("manifest_file")
    if manifest_file is not None and (not isinstance(manifest_file, str) or not manifest_file.startswith("/")):
        raise ValueError(f"weights staging reported manifest_file={manifest_file!r}; expected an absolute path")
    return StagedWeights(root=root, files=dict(sorted(files.items())), sha256=dict(sorted(digests.items())),
                         manifest_file=manifest_file)


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


_AS_ROOT = '''PATH="$PATH:/usr/sbin:/sbin"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"'''


def _exports_file(stack_prefix: str, exports_dir: str) -> str:
    return f"""exports_dir={shlex.quote(exports_dir)}
file="$exports_dir/{exports_name(stack_prefix)}"
"""


def render_export_command(*, head_name: str, abs_root: str, worker_ips: Sequence[str], stack_prefix: str,
                          exports_dir: str = EXPORTS_DIR) -> str:
    """Install this stack's exports file and export exactly its entries; idempotent. Needs root or
    passwordless sudo on the head. Other exports on the host are never re-synced (no `exportfs -ra`)."""
    exports = render_exports(abs_root, worker_ips)
    clients = _export_clients(abs_root, worker_ips)
    add = "".join(f'$SUDO exportfs -o {EXPORT_OPTIONS} {ip}:"$root"\n' for ip in clients)
    return f"""set -eu
{_AS_ROOT}
if ! command -v exportfs >/dev/null 2>&1; then
  echo "exportfs not found on head {head_name}: install nfs-kernel-server, or use share=bind" >&2; exit 1
fi
if command -v systemctl >/dev/null 2>&1 && ! systemctl is-active --quiet nfs-server; then
  echo "nfs-server is not running on head {head_name}: run 'sudo systemctl enable --now nfs-server'" >&2; exit 1
fi
root={shlex.quote(abs_root)}
resolved=$(cd "$root" && pwd -P)
[ "$resolved" = "$root" ] || {{ echo "weights root $root on head {head_name} resolves to $resolved;" \
  "re-run staging" >&2; exit 1; }}
{_refuse_whole_root(f"head {head_name}")}{_exports_file(stack_prefix, exports_dir)}tmp=$(mktemp)
trap 'rm -f "$tmp" "$tmp.legacy"' EXIT
cat > "$tmp" <<'DSV41_EXPORTS'
{exports}DSV41_EXPORTS
# What this stack exported before and exports no more (a worker left, the root moved): withdraw just that.
if [ -f "$file" ]; then
  sed -n 's/^{_EXPORT_ENTRY}//p' "$file" | while IFS=' ' read -r client path; do
    if ! grep -qxF "{_EXPORT_ENTRY}$client $path" "$tmp"; then $SUDO exportfs -u "$client:$path" || true; fi
  done
fi
$SUDO mkdir -p "$exports_dir"
$SUDO install -m 0644 "$tmp" "$file"
{add}# Earlier versions wrote one fixed-name file for every stack: drop it only when it holds exactly this export.
legacy="$exports_dir/{LEGACY_EXPORTS_NAME}"
cat > "$tmp.legacy" <<'DSV41_EXPORTS'
{legacy_exports(abs_root, worker_ips)}DSV41_EXPORTS
if [ "$legacy" != "$file" ] && [ -f "$legacy" ] && cmp -s "$tmp.legacy" "$legacy"; then $SUDO rm -f "$legacy"; fi
"""


def render_unexport_command(*, abs_root: str, worker_ips: Sequence[str], stack_prefix: str,
                            exports_dir: str = EXPORTS_DIR) -> str:
    """Withdraw this stack's export entries and its file (the weights themselves stay on the head)."""
    fallback = "".join(f"{ip} {abs_root}\n" for ip in _export_clients(abs_root, worker_ips))
    return f"""set -eu
{_AS_ROOT}
{_exports_file(stack_prefix, exports_dir)}entries=$(if [ -f "$file" ]; then sed -n 's/^{_EXPORT_ENTRY}//p' "$file"
else cat <<'DSV41_EXPORTS'
{fallback}DSV41_EXPORTS
fi)
if command -v exportfs >/dev/null 2>&1; then
  printf '%s\n' "$entries" | while IFS=' ' read -r client path; do
    [ -n "$client" ] || continue
    $SUDO exportfs -u "$client:$path" || true
  done
fi
$SUDO rm -f "$file"
"""


def nfs_volume_options(*, head_ip: str, device_path: str) -> dict[str, str]:
    """driver_opts of a local-driver docker volume that the worker's daemon mounts over NFS."""
    if not device_path.startswith("/"):
        raise ValueError(f"NFS device path {device_path!r} must be absolute on the head")
    return {"type": "nfs", "o": f"addr={validate_ip('head fabric_ip', head_ip)},{NFS_MOUNT_OPTIONS}",
            "device": f":{device_path}"}


def volume_name(prefix: str, which: str, options: Mapping[str, str]) -> str:
    """Docker volume name; carries a digest of its options so changed options make a new volume
    (docker cannot change a volume's options in place, and cannot remove one a container still uses)."""
    digest = hashlib.sha256(json.dumps(dict(options), sort_keys=True).encode()).hexdigest()[:8]
    safe = re.sub(r"[^a-zA-Z0-9_.-]", "-", f"{prefix}-{which}").strip("-.") or "dsv41-exl3"
    return f"{safe}-{digest}"


# --- visibility check ------------------------------------------------------------------------------


def render_size_check(*, node: str, root: str, files: Mapping[str, int], where: str) -> str:
    """POSIX sh that stats every manifest file under `root` and fails naming the node and the bad files."""
    if not files:
        raise ValueError(f"no manifest files to check on node {node}; staging reported none")
    listing = "".join(f"{size} {path}\n" for path, size in sorted(files.items()))
    q_node, q_where = shlex.quote(node), shlex.quote(where)
    return f"""root={shlex.quote(root)}
bad=""
n=0
while IFS=' ' read -r size path; do
  [ -n "$path" ] || continue
  n=$((n+1))
  actual=$(stat -c %s "$root/$path" 2>/dev/null) || actual=missing
  if [ "$actual" != "$size" ]; then
    echo "  $path: expected $size bytes, found $actual" >&2
    bad="$bad $path"
  fi
done <<'DSV41_FILES'
{listing}DSV41_FILES
if [ -n "$bad" ]; then
  echo "weights not visible on node "{q_node}" ("{q_where}"): missing or wrong size:$bad;" \\
    "check staging and this node's share of the head's weights" >&2
  exit 1
fi
echo "weights visible on node "{q_node}": $n files"
"""


def _outer(inner: str, run: str, *, node: str, timeout_s: int, cleanup: str) -> str:
    return f"""set -eu
{cleanup}rc=0
timeout --kill-after=30 {timeout_s} {run} <<'DSV41_CHECK' || rc=$?
{inner}DSV41_CHECK
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  {cleanup}echo "weights check on node "{shlex.quote(node)}" timed out after {timeout_s}s:" \
    "a hung share (NFS mount)?" >&2
fi
exit "$rc"
"""


def render_bind_check(*, node: str, abs_root: str, files: Mapping[str, int], timeout_s: int = 300) -> str:
    """Check from the node's own filesystem (the head, or a worker that shares the head's filesystem)."""
    inner = render_size_check(node=node, root=abs_root, files=files, where=f"host path {abs_root}")
    return _outer(inner, "sh -s", node=node, timeout_s=timeout_s, cleanup="")


def render_volume_check(*, node: str, image: str, model_volume: str, engram_volume: str,
                        files: Mapping[str, int], stack_prefix: str, timeout_s: int = 300) -> str:
    """Check through the node's docker volumes, exactly as the serving container will mount them."""
    inner = render_size_check(node=node, root=_MOUNT_IN_CHECK, files=files,
                              where=f"volumes {model_volume}, {engram_volume}")
    name = check_container(stack_prefix)
    run = (f"docker run --rm -i --name {name} --network none --entrypoint sh "
           f"-v {shlex.quote(model_volume)}:{_MOUNT_IN_CHECK}/{MODEL_DIR}:ro "
           f"-v {shlex.quote(engram_volume)}:{_MOUNT_IN_CHECK}/{ENGRAM_DIR}:ro {shlex.quote(image)} -s")
    cleanup = f"docker rm -f {name} >/dev/null 2>&1 || true\n"
    return _outer(inner, run, node=node, timeout_s=timeout_s, cleanup=cleanup)
