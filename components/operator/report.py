"""`dsv41-exl3 report [--stack NAME] [--out FILE] [--json]`: one `.tar.gz` an owner attaches to an issue, read only.

What a deployment did, without a secret in it:
- `config.json`: the stack file's config, each value the secrets provider marked `secure` shown as `[secret]`
  (the ciphertext is never copied, nothing is decrypted);
- `versions.json`: the program's version and commit, Python, the Pulumi CLI and its plugins, each node's image id
  as the last verified up recorded it, and vLLM's own version (`GET /version` on the endpoint);
- `history.json`: the stack's last updates, each with its kind, result, start and end, and resource changes;
- `records.json`: the gates' and the verifier's records from the state (when each passed, how long it waited,
  the ready gate's phases with their times, the rendezvous' joins, the verifier's latency); the state keeps no
  duration for staging or the pull, so those phases show only in history.json's update times;
- `boot/<role>.argv.json`, `boot/<role>.log.jsonl`: each rank's argv, its environment's names, and its log since
  it started, in the recording format of `sim/record.py` (operator/rank_log.py), so a GB10 run can join the stand-in's
  conformance fixtures as it is (docs/development.md);
- `supervisor.json`: the supervisor's own status (its decisions and restarts), when the stack has one;
- `memory.json`: each node's MemAvailable now and the watchdog log's last lines.
Every part is searched for every credential the stack holds (the SSH key and each of its lines, the API key, the
HF token, the supervisor's token) before the bundle is written; a part that still holds one is not written.
Exit 0: written (parts that could not be read say why inside); 2: a usage error.
"""

from __future__ import annotations

import io
import json
import platform
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests
import yaml

from components import labels
from components.operator import rank_log
from components.operator.exits import Exit
from components.operator.stack_view import (
    REPO_ROOT,
    OperatorError,
    OperatorParser,
    StackView,
    api_key_of,
    container_of,
    open_stack,
    read_stack,
    secrets_of,
    ssh_target,
)
from components.redaction import redact
from components.ssh import ssh_argv

SECRET = "[secret]"
# How Pulumi marks a secret value in an exported state (sdk/go/common/resource/sig: "secret").
_SECRET_SIG = "4dabf18193072939515e22adb298388d"
# Every dynamic resource's type: `pulumi-python:dynamic/<module>:<Class>` (gates:ReadyGate, verify:Verifier, ...).
_DYNAMIC = "pulumi-python:dynamic"
SSH_TIMEOUT_S = 60
Run = Callable[[list[str], int], subprocess.CompletedProcess[str]]


def run_argv(argv: list[str], timeout_s: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
    )


def masked_config(stack_file: Path) -> dict[str, Any]:
    """The stack file's `config:`, every `secure:` leaf (the secrets provider's marking) as `[secret]`."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"secure"}:
                return SECRET
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    loaded = yaml.safe_load(stack_file.read_text()) or {}
    return {"file": stack_file.name, "config": walk(loaded.get("config") or {})}


def masked_state(value: Any) -> Any:
    """An exported state's values with every secret (Pulumi's signature key) as `[secret]`."""
    if isinstance(value, dict):
        if _SECRET_SIG in value:
            return SECRET
        return {k: masked_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked_state(v) for v in value]
    return value


def gate_records(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The dynamic resources' outputs (the gates, the verifier, live ranks), their inputs' provider code left out."""
    records = []
    for resource in deployment.get("resources") or []:
        kind = str(resource.get("type", ""))
        if not kind.startswith(_DYNAMIC):
            continue
        outputs = {k: v for k, v in (resource.get("outputs") or {}).items() if not k.startswith("__")}
        name = str(resource.get("urn", "")).rsplit("::", 1)[-1]
        records.append({"name": name, "type": kind.rsplit(":", 1)[-1], "outputs": masked_state(outputs)})
    return records


def update_history(stack: Any, limit: int = 10) -> list[dict[str, Any]]:
    return [
        {
            "version": u.version,
            "kind": u.kind,
            "result": u.result,
            "start": str(u.start_time),
            "end": str(u.end_time),
            "resourceChanges": u.resource_changes,
        }
        for u in stack.history(page_size=limit, page=1)
    ]


def _program_commit() -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown (not a git checkout)"


def versions(view: StackView, stack: Any, get: Callable[..., Any]) -> dict[str, Any]:
    workspace = stack.workspace
    out: dict[str, Any] = {
        "program": _program_commit(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "pulumi": workspace.pulumi_version,
        "plugins": sorted(f"{p.name} {p.version}" for p in workspace.list_plugins()),
        "image": view.settings.image,
        "imageIds": (view.outputs.get("lastVerified") or {}).get("imageIds"),
    }
    endpoint = str(view.outputs.get("endpoint") or "")
    if endpoint:
        key = api_key_of(view)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            reply = get(f"{endpoint.removesuffix('/v1')}/version", headers=headers, timeout=10)
            out["vllm"] = reply.json().get("version") if reply.status_code == 200 else f"HTTP {reply.status_code}"
        except (requests.RequestException, ValueError) as error:
            out["vllm"] = f"not read: {type(error).__name__}"
    return out


def rank_script(container: str, prefix: str) -> str:
    """On a node: the rank's inspect and log, MemAvailable (KiB), the watchdog log's last lines, between markers."""
    return (
        f'c={shlex.quote(container)}; w="$HOME/.local/state/{prefix}/watchdog.log"; '
        'docker inspect "$c" && echo "=== logs" && docker logs --timestamps "$c" 2>&1; '
        "echo '=== memory'; awk '/^MemAvailable:/ {print $2}' /proc/meminfo; "
        "echo '=== watchdog'; tail -n 20 \"$w\" 2>/dev/null || true"
    )


def rank_parts(view: StackView, run: Run) -> tuple[dict[str, str], dict[str, Any]]:
    """boot/<role>.argv.json and boot/<role>.log.jsonl per node (head, worker, worker-2, ...) and memory.json."""
    parts: dict[str, str] = {}
    memory: dict[str, Any] = {}
    logs: dict[str, list[tuple[float, str]]] = {}
    started: list[float] = []
    prefix = labels.stack_prefix("dsv41-exl3", view.name)
    for i, node in enumerate(view.settings.nodes):
        role = "head" if i == 0 else ("worker" if i == 1 else f"worker-{i}")
        container = container_of(view, node)
        try:
            done = run(ssh_argv(ssh_target(view, node.name), rank_script(container, prefix)), SSH_TIMEOUT_S)
        except (subprocess.TimeoutExpired, OSError) as error:
            memory[node.name] = {"error": f"not reached: {type(error).__name__}"}
            continue
        head, _, rest = done.stdout.partition("\n=== logs\n")
        logs_text, _, rest = rest.partition("=== memory\n")
        mem, _, wd = rest.partition("=== watchdog\n")
        try:
            inspected = json.loads(head)[0]
        except (json.JSONDecodeError, IndexError, KeyError):
            memory[node.name] = {"error": f"no container {container}: {done.stderr.strip()[-200:]}"}
            continue
        parts[f"boot/{role}.argv.json"] = json.dumps(rank_log.argv_record(inspected), indent=2, sort_keys=True)
        logs[role] = rank_log.merged_lines(logs_text)
        started.append(rank_log.docker_time(inspected["State"]["StartedAt"]))
        kib = mem.strip()
        memory[node.name] = {
            "memAvailableGiB": round(int(kib) / 1048576, 2) if kib.isdigit() else None,
            "watchdogLog": [line for line in wd.splitlines() if line.strip()],
        }
    origin = min(started) if started else time.time()
    for role, lines in logs.items():
        parts[f"boot/{role}.log.jsonl"] = rank_log.as_jsonl(lines, origin)
    return parts, memory


def supervisor_status(view: StackView, get: Callable[..., Any]) -> dict[str, Any] | None:
    data = view.outputs.get("supervisor")
    if not isinstance(data, dict) or not data.get("url"):
        return None
    try:
        reply = get(f"{data['url']}/status", headers={"Authorization": f"Bearer {data['token']}"}, timeout=10)
        return dict(reply.json()) if reply.status_code == 200 else {"error": f"HTTP {reply.status_code}"}
    except (requests.RequestException, ValueError) as error:
        return {"error": f"not reached: {type(error).__name__}"}


def hidden_forms(view: StackView) -> list[str]:
    """Every credential the stack holds, and each line of a multi-line one (a key's body) long enough to tell."""
    forms = []
    for secret in secrets_of(view):
        forms += [secret, json.dumps(secret)[1:-1]]
        forms += [line.strip() for line in secret.splitlines() if len(line.strip()) >= 16]
    return forms


def collect(view: StackView, stack: Any, run: Run, get: Callable[..., Any]) -> dict[str, str]:
    """Every part of the bundle by its path, each redacted; a read that fails is a part that says why."""
    parts: dict[str, str] = {}

    def part(path: str, build: Callable[[], Any]) -> None:
        try:
            value = build()
        except Exception as error:  # one unreadable part must not cost the others
            value = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        parts[path] = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True, default=str)

    part("config.json", lambda: masked_config(REPO_ROOT / f"Pulumi.{view.name}.yaml"))
    part("versions.json", lambda: versions(view, stack, get))
    part("history.json", lambda: update_history(stack))
    part("records.json", lambda: gate_records(stack.export_stack().deployment))
    ranks, memory = rank_parts(view, run)
    parts.update(ranks)
    part("memory.json", lambda: memory)
    status = supervisor_status(view, get)
    if status is not None:
        part("supervisor.json", lambda: status)
    forms = hidden_forms(view)
    return {path: redact(text, forms, mask=SECRET, key_shapes=True) for path, text in parts.items()}


def write_bundle(path: Path, top: str, parts: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in sorted(parts.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Read only: one .tar.gz of the stack's config (secrets masked), versions, update history, the "
        "gates' records, each rank's log since it started, the supervisor's status and memory, to attach to an issue.",
    )
    parser.add_argument("--stack", help="the stack (default: the selected one)")
    parser.add_argument("--out", type=Path, help="the file to write (default: ./dsv41-exl3-report-STACK-TIME.tar.gz)")
    parser.add_argument("--json", action="store_true", help="print the file and its parts as one JSON object")
    return parser


def main(
    argv: Sequence[str] | None = None,
    prog: str = "dsv41-exl3 report",
    run: Run = run_argv,
    get: Callable[..., Any] = requests.get,
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        view = read_stack(options.stack)
        stack = open_stack(view.name)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    top = f"dsv41-exl3-report-{view.name}-{stamp}"
    out = options.out or Path(f"{top}.tar.gz")
    parts = collect(view, stack, run, get)
    write_bundle(out, top, parts)
    if options.json:
        print(json.dumps({"stack": view.name, "out": str(out), "parts": sorted(parts)}))
    else:
        print(f"report: {out} ({len(parts)} parts: {', '.join(sorted(parts))})")
    return Exit.OK
