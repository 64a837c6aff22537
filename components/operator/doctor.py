"""`dsv41-exl3 doctor [--stack NAME] [--json]`: read only, about a minute, before anything is staged or started.

What a first `pulumi up` would find hours in, each check per node with ok / fail and the fix:
- over the stack's own SSH (each node's host key pinned as the program pins it): the preflight's check phase in
  report mode (components/preflight/preflight.sh from the same spec the program runs before every rank,
  spec.node_spec: docker, the head's address, leftover units, containers holding the GPU, disk under the weights
  root, the NFS export path's traversal, the fabric interface, the HCAs and the RoCE v2 GID index, this stack's
  containers, MemAvailable against the floor); then discovery's probe (components/discover/probe.sh, the same
  report and decisions as `discover`): the login shell, docker's storage driver and runtimes, the GPU, MemFree
  against the floor, and on the head with `share: nfs` the NFS server installed and running and `sudo -n` for
  what the export runs; then the serving image's manifest for the node's platform and, where the image is already
  on the node, a container of it seeing the GPU (image/platforms.py);
- from this machine: the hub, per repo of the staging plan (weights/hub_check.py).
Each check is ok, warn (worth fixing, the up would still run) or fail (the up would fail on it).
Exit 0: no check failed; 1: a check failed; 2: a usage error (a bad flag, an unreadable stack).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Literal

import requests

from components import host_keys
from components.access.addresses import AddressError, Addresses, resolve
from components.access.node_access import ssh_target
from components.config import Node, Settings
from components.discover.checks import (
    decide_docker,
    decide_gpu,
    decide_login_shell,
    decide_memfree,
    decide_nfs,
    decide_nfs_server,
    decide_storage_driver,
)
from components.discover.findings import Finding
from components.discover.parse import Probe, ProbeError, parse_probe
from components.discover.report import probe_script
from components.image.platforms import (
    ImageVerdict,
    decide,
    decide_gpu_in_container,
    render_gpu_check,
    render_manifest_check,
)
from components.operator.exits import Exit
from components.operator.stack_view import OperatorError, OperatorParser, read_stack, secrets_of
from components.preflight.spec import CheckResult, node_spec, parse_report, render_command
from components.redaction import redact
from components.serving import spec as serve_spec
from components.ssh import KeyDirError, SshTarget, ssh_argv
from components.weights.hub_check import Get, HubVerdict, check_hub

Status = Literal["ok", "warn", "fail"]
Run = Callable[[list[str], int], subprocess.CompletedProcess[str]]
"""Run argv with a timeout in seconds; its captured output (tests pass a fake)."""
Pin = Callable[[Sequence[host_keys.NodeAddress], str | None], dict[str, host_keys.Pin]]

# Above the preflight's own `timeout` (spec.command_timeout_s) plus ssh's dial.
SSH_TIMEOUT_S = 180


@dataclass(frozen=True)
class Row:
    where: str
    """A node's name, or `hub`."""
    check: str
    status: Status
    detail: str
    fix: str = ""


def run_argv(argv: list[str], timeout_s: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
    )


def _split_fix(text: str) -> tuple[str, str]:
    detail, _, fix = text.partition("; fix: ")
    return detail.strip(), fix.strip()


def preflight_rows(node: str, results: Sequence[CheckResult]) -> list[Row]:
    rows = []
    for r in results:
        parts = [_split_fix(t) for t in r.details]
        detail = "; ".join(d for d, _ in parts if d) or ("ok" if r.ok else "refused")
        fix = "; ".join(f for _, f in parts if f)
        rows.append(Row(node, r.check, "ok" if r.ok else "fail", detail, fix))
    return rows


def finding_row(where: str, check: str, f: Finding) -> Row:
    """One row from a discovery decision: what it could not decide fails, a warning warns."""
    if f.undecided:
        detail = "; ".join([*f.found, *(u.reason for u in f.undecided)])
        return Row(where, check, "fail", detail, "; ".join(u.fix for u in f.undecided))
    if f.warnings:
        return Row(where, check, "warn", "; ".join([*f.found, *f.warnings]))
    return Row(where, check, "ok", "; ".join(f.found) or "ok")


def probe_rows(s: Settings, n: Node, probe: Probe, *, serving: bool) -> list[Row]:
    """The probe's rows for one node. `serving`: this stack's ranks run there (they hold memory by design)."""
    where, user = n.name, n.user
    checks: list[tuple[str, Finding]] = [
        ("login-shell", decide_login_shell(probe)),
        ("storage-driver", decide_storage_driver(probe)),
    ]
    if n.gpus:
        checks += [("docker-runtime", decide_docker(probe, user)), ("gpu", decide_gpu(probe))]
    if not serving:
        checks.append(("memfree", decide_memfree(probe, s.min_mem_available_gib_of(n))))
    if n is s.nodes[0] and s.weights.share == "nfs":
        checks.append(("nfs-server", decide_nfs(probe, user) + decide_nfs_server(probe)))
    rows = [finding_row(where, check, f) for check, f in checks if f != Finding()]
    if not n.gpus:
        rows.append(
            Row(where, "gpu", "ok", "not checked: the node's `gpus` is empty in the stack config (no GPU asked for)")
        )
    return rows


def _said(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {done.returncode}, no message"


def check_node(s: Settings, addresses: Addresses, n: Node, stack: str, run: Run, pin: Pin) -> list[Row]:
    """One node's rows: ssh, each preflight check in the script's order, the image. Stops at what blocks the rest."""
    target = ssh_target(n, s.ssh, None)  # per-run key files: the doctor writes no stack state
    where = n.name
    try:
        pinned = pin([host_keys.NodeAddress(node=n.name, host=n.host, port=n.port)], s.ssh.known_hosts_file)[n.name]
    except host_keys.HostKeyError as error:
        return [Row(where, "ssh", "fail", *_split_fix(" ".join(str(error).split())))]
    key = f"host key {pinned.key.kind} {pinned.key.fingerprint()}" + (" (recorded now)" if pinned.recorded else "")
    rows = [Row(where, "ssh", "ok", f"{n.user}@{n.host}:{n.port}, {key}")]
    spec = replace(node_spec(s, addresses, stack, serve_spec.cluster_generation(s), n), stop=False, report=True)
    try:
        done = run(ssh_argv(target, render_command(spec)), SSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [*rows, Row(where, "preflight", "fail", f"no answer within {SSH_TIMEOUT_S} s", "check the node")]
    except (OSError, KeyDirError) as error:
        return [Row(where, "ssh", "fail", f"cannot run ssh: {error}", "install openssh-client")]
    if done.returncode == 255:
        return [Row(where, "ssh", "fail", _said(done), "check nodes[].host, user, port and ssh.privateKey")]
    if done.returncode != 0:
        return [*rows, Row(where, "preflight", "fail", _said(done), "run the preflight by hand on the node")]
    try:
        results = parse_report(done.stdout, spec)
    except ValueError as error:
        return [*rows, Row(where, "preflight", "fail", str(error))]
    rows += preflight_rows(where, results)
    serving = any(r.check == "own-containers" and r.details for r in results)
    rows += _probe(s, n, target, run, serving=serving)
    rows.append(_image_row(where, target, run, "image", render_manifest_check(s.image), partial(decide, s.image)))
    if n.gpus:
        in_container = partial(decide_gpu_in_container, s.image, n.gpus)
        rows.append(_image_row(where, target, run, "gpu-container", render_gpu_check(s.image, n.gpus), in_container))
    return rows


def _probe(s: Settings, n: Node, target: SshTarget, run: Run, *, serving: bool) -> list[Row]:
    try:
        done = run(ssh_argv(target, probe_script()), SSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Row(n.name, "probe", "fail", f"no answer within {SSH_TIMEOUT_S} s", "check the node")]
    try:
        return probe_rows(s, n, parse_probe(done.stdout), serving=serving)
    except ProbeError as error:
        return [Row(n.name, "probe", "fail", f"{error}: {_said(done)}", "run `dsv41-exl3 discover` on the node")]


def _image_row(
    where: str, target: SshTarget, run: Run, check: str, script: str, verdict_of: Callable[[str], ImageVerdict]
) -> Row:
    try:
        shown = run(ssh_argv(target, script), SSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Row(where, check, "fail", f"no answer within {SSH_TIMEOUT_S} s", "check the registry and docker")
    if shown.returncode != 0:
        return Row(where, check, "fail", _said(shown), "check docker on the node")
    verdict = verdict_of(shown.stdout)
    return Row(where, check, "ok" if verdict.ok else "fail", verdict.detail, verdict.fix)


def hub_rows(verdicts: Sequence[HubVerdict]) -> list[Row]:
    return [Row("hub", v.repo, "ok" if v.ok else "fail", v.detail, v.fix) for v in verdicts]


def doctor(
    s: Settings, stack: str, run: Run = run_argv, pin: Pin = host_keys.pin_all, get: Get = requests.get
) -> list[Row]:
    """Every row: the nodes' in config order, then the hub's; the nodes and the hub are asked at once."""
    try:
        addresses = resolve(s.nodes)
    except AddressError as error:
        return [Row("config", "addresses", "fail", *_split_fix(" ".join(str(error).split())))]
    with ThreadPoolExecutor(max_workers=len(s.nodes) + 1) as pool:
        nodes = [pool.submit(check_node, s, addresses, n, stack, run, pin) for n in s.nodes]
        hub = pool.submit(check_hub, s, get)
        return [row for future in nodes for row in future.result()] + hub_rows(hub.result())


# --- the command -------------------------------------------------------------------------------------------------

MARK = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}


def format_table(stack: str, rows: Sequence[Row]) -> str:
    width = max([len(r.where) for r in rows] + [4])
    check_width = max([len(r.check) for r in rows if r.where != "hub"] + [5])
    lines = [f"doctor: stack {stack}"]
    for r in rows:
        check = r.check if r.where != "hub" else r.check.rsplit("/", 1)[-1]
        lines.append(f"  {MARK[r.status]}  {r.where:<{width}}  {check:<{check_width}}  {r.detail}")
        if r.fix:
            lines.append(f"  {'':4}  {'':<{width}}  {'':<{check_width}}  fix: {r.fix}")
    failed = sum(r.status == "fail" for r in rows)
    warned = sum(r.status == "warn" for r in rows)
    said = [f"{failed} failed"] * bool(failed) + [f"{warned} warned"] * bool(warned)
    lines.append(f"{len(rows)} checks, {', '.join(said) or 'all ok'}")
    return "\n".join(lines)


def as_json(stack: str, rows: Sequence[Row]) -> dict[str, Any]:
    return {"stack": stack, "ok": all(r.status != "fail" for r in rows), "checks": [asdict(r) for r in rows]}


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Read only: every node's preflight checks, the serving image for each node's platform, and the "
        "hub, each with ok / FAIL and the fix, before the first `pulumi up`.",
    )
    parser.add_argument("--stack", help="the stack (default: the selected one)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return parser


def main(
    argv: Sequence[str] | None = None,
    prog: str = "dsv41-exl3 doctor",
    run: Run = run_argv,
    pin: Pin = host_keys.pin_all,
    get: Get = requests.get,
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        view = read_stack(options.stack)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    rows = doctor(view.settings, view.name, run=run, pin=pin, get=get)
    text = json.dumps(as_json(view.name, rows), indent=1) if options.json else format_table(view.name, rows)
    # Nothing a node or the hub echoed back may show a credential, nor a line of a multi-line one (a key's body).
    hidden = [p for x in secrets_of(view) for p in (x, *(ln.strip() for ln in x.splitlines() if len(ln.strip()) >= 16))]
    text = redact(text, hidden, mask="[secret]", key_shapes=True)
    print(text)
    return Exit.OK if all(r.status != "fail" for r in rows) else Exit.FAILED
