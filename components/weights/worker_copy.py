"""WorkerCopy: one worker's own copy of the staged weights (`weights.share: copy`), a Pulumi dynamic resource.

Why a dynamic resource and not a remote command: the copy needs two ends alive at once, the head's source
(a throwaway container serving the weights root read-only on the fabric) and the worker's copier, and the
source must not outlive the copy. The provider holds the source's stdin open over ssh while the copier runs,
writing a heartbeat line every HEARTBEAT_S, then closes it: the source exits and docker removes it. If the
deployer dies, its ssh goes with it and so does the source; if the deployer's machine or network vanishes
(nothing closes the session on the head), the heartbeats stop and the source ends within a minute
(copy_source.py). The token pairing the two is made per run and sent on stdin only.

`diff` (every preview and up) runs copy_check.sh on the worker: one ssh round trip that reads the copier's
record and stats the files, reading no weights. A missing file, or one whose size or mtime is no longer the
verified one (rewritten in place, truncated), makes the copy run again; it copies only those files. A worker
that cannot be reached is reported, not treated as a change.

`delete` does nothing: destroying the stack, or leaving copy mode, keeps every copy (as it keeps the head's).
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

import pulumi
import pulumi.dynamic

from components.dynamic import changed_inputs, log_progress, plain, secret_or_none, unwrap_secret
from components.ssh import SshAccess, SshTarget, ssh_argv
from components.weights import local_copy as lc
from components.weights import manifest as wm
from components.weights.copy_source import HEARTBEAT_S

# What decides the copy's content: a change re-runs it (images, streams and credentials do not).
COPY_INPUT_KEYS = ("worker", "worker_host", "worker_port", "head_root", "copy_root", "files", "sha256")
# Where the copy is: a change is a new copy (a new resource id), never an update.
WHERE_KEYS = ("worker", "worker_host", "worker_port", "copy_root")
INPUT_KEYS = (
    *COPY_INPUT_KEYS,
    "worker_user",
    "worker_fabric_ip",
    "head",
    "head_host",
    "head_port",
    "head_user",
    "head_fabric_ip",
    "head_image",
    "worker_image",
    "streams",
    "timeout_s",
    "stack_prefix",
    "ssh_private_key",
    "ssh_agent_socket",
    "ssh_known_hosts_file",
)
SECRET_KEYS = ["ssh_private_key"]
SOURCE_START_TIMEOUT_S = 120.0
CHECK_TIMEOUT_S = 30.0
_PROGRESS_INTERVAL_S = 10.0


class CopyFailed(Exception):
    """The copy did not complete; the message names the worker and what the node said."""


@dataclass(frozen=True, kw_only=True)
class WorkerCopyArgs:
    worker: str
    worker_host: str
    worker_port: int
    worker_user: str
    worker_fabric_ip: str
    head: str
    head_host: str
    head_port: int
    head_user: str
    head_fabric_ip: str
    ssh: SshAccess
    head_root: pulumi.Input[str]
    """The head's weights root, absolute (the staging output)."""
    head_image: pulumi.Input[str]
    """The serving image on the head (runs the source)."""
    worker_image: pulumi.Input[str]
    """The serving image on this worker (runs the copier): its id, so the copy waits for the pull."""
    copy_root: str
    """The copy root on this worker, `{node}` already resolved."""
    files: pulumi.Input[Mapping[str, int]]
    sha256: pulumi.Input[Mapping[str, str]]
    streams: int
    timeout_s: int
    stack_prefix: str


def _target(props: Mapping[str, Any], which: str) -> SshTarget:
    key = unwrap_secret(props.get("ssh_private_key"))
    agent = props.get("ssh_agent_socket")
    known = props.get("ssh_known_hosts_file")
    return SshTarget(
        host=str(props[f"{which}_host"]),
        port=int(props[f"{which}_port"]),
        user=str(props[f"{which}_user"]),
        private_key=str(key) if key else None,
        agent_socket=str(agent) if agent else None,
        known_hosts_file=str(known) if known else None,
    )


def _drain(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _tail(lines: list[str], n: int = 8) -> str:
    return "\n    ".join(lines[-n:]) or "(nothing on stderr)"


class _Source:
    """The head's source for one copy: started, read until it listens, stopped by closing its stdin."""

    def __init__(self, props: Mapping[str, Any], token: str) -> None:
        worker = str(props["worker"])
        command = lc.render_source_command(
            abs_root=str(props["head_root"]),
            bind=str(props["head_fabric_ip"]),
            image=str(props["head_image"]),
            container=lc.source_container(str(props["stack_prefix"]), worker),
        )
        self.head = str(props["head"])
        self.proc = subprocess.Popen(
            ssh_argv(_target(props, "head"), command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        threading.Thread(
            target=lambda: self.stderr.extend(ln.rstrip() for ln in self.proc.stderr or ()), daemon=True
        ).start()
        config = {
            "token": token,
            "allow": [str(props["worker_fabric_ip"])],
            "dirs": list(wm.SERVED_DIRS),
            "max_lifetime_s": int(props["timeout_s"]) + 600,
        }
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_drain, args=(self.proc.stdout, self._lines), daemon=True).start()
        self._stdin_lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        """While the copy runs: one line every HEARTBEAT_S, so the source knows this session is alive."""
        while not self._stopped.wait(HEARTBEAT_S):
            with self._stdin_lock:
                stdin = self.proc.stdin
                if stdin is None or stdin.closed:
                    return
                try:
                    stdin.write("\n")
                    stdin.flush()
                except (OSError, ValueError):  # the source (or its ssh) is gone: wait_listening / stop say so
                    return

    def wait_listening(self) -> lc.SourceReady:
        seen: dict[str, str] = {}
        deadline = time.monotonic() + SOURCE_START_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.proc.wait(timeout=10)
                time.sleep(0.1)  # let the stderr reader finish
                raise CopyFailed(
                    f"the weights source on the head {self.head} exited ({self.proc.returncode}) "
                    f"before listening:\n    {_tail(self.stderr)}"
                )
            ready = lc.parse_source_line(line, seen)
            if ready is not None:
                return ready
        self.stop()
        raise CopyFailed(
            f"the weights source on the head {self.head} did not listen within "
            f"{SOURCE_START_TIMEOUT_S:.0f}s:\n    {_tail(self.stderr)}"
        )

    def stop(self) -> None:
        self._stopped.set()
        with self._stdin_lock:
            if self.proc.stdin and not self.proc.stdin.closed:
                with contextlib.suppress(OSError):  # a source that already exited: nothing to tell it
                    self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_copy(props: Mapping[str, Any], log: Any = log_progress) -> dict[str, Any]:
    """Copy what the worker lacks; return the outputs (inputs echoed plus the report)."""
    worker = str(props["worker"])
    token = secrets.token_urlsafe(32)
    began = time.monotonic()
    source = _Source(props, token)
    try:
        ready = source.wait_listening()
        command = lc.render_copy_command(
            node=worker,
            copy_root=str(props["copy_root"]),
            source=f"http://{props['head_fabric_ip']}:{ready.port}",
            source_ident=ready.ident,
            bind=str(props["worker_fabric_ip"]),
            image=str(props["worker_image"]),
            container=lc.copier_container(str(props["stack_prefix"])),
            streams=int(props["streams"]),
            expected=lc.expected_json(unwrap_secret(props["files"]), unwrap_secret(props["sha256"])),
            timeout_s=int(props["timeout_s"]),
        )
        proc = subprocess.Popen(
            ssh_argv(_target(props, "worker"), command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin and proc.stdout and proc.stderr
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(proc.stdout or ()), daemon=True).start()
        proc.stdin.write(f'{{"token": "{token}"}}\n' + lc.copier_script())
        proc.stdin.close()
        errors: list[str] = []
        last_progress = 0.0
        for line in proc.stderr:
            errors.append(line.rstrip())
            now = time.monotonic()
            if now - last_progress >= _PROGRESS_INTERVAL_S or "copying" in line:
                log(f"weights copy: {line.rstrip().removeprefix('copy_weights: ')}")
                last_progress = now
        proc.wait(timeout=int(props["timeout_s"]) + 120)
        time.sleep(0.05)
        if proc.returncode != 0:
            raise CopyFailed(f"the weights copy to {worker} failed ({proc.returncode}):\n    {_tail(errors)}")
    finally:
        source.stop()
    report = lc.parse_copy_report("".join(out))
    dropped = report.page_cache
    page_cache = (
        "" if dropped is None else f"; page cache: {dropped.files} files dropped ({dropped.bytes / 2**30:.2f} GiB)"
    )
    if dropped is not None and dropped.failed:
        page_cache += f", {dropped.failed} not (the copier's lines name them)"
    log(
        f"weights copy: {worker}: {len(report.copied)} of {report.files} files copied "
        f"({report.bytes / 2**30:.2f} GiB in {report.seconds:.1f}s){page_cache}"
    )
    return {
        **plain(INPUT_KEYS, props),
        "root": report.root,
        "copied_files": len(report.copied),
        "copied_bytes": report.bytes,
        "copy_seconds": report.seconds,
        "elapsed_s": round(time.monotonic() - began, 3),
        "verified_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def check_copy(props: Mapping[str, Any]) -> dict[str, str]:
    """{path: why} for every file of the worker's copy that is not the verified one (copy_check.sh)."""
    command = lc.render_copy_check(
        copy_root=str(props["copy_root"]), files=unwrap_secret(props["files"]), sha256=unwrap_secret(props["sha256"])
    )
    done = subprocess.run(
        ssh_argv(_target(props, "worker"), command),
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if done.returncode != 0:
        raise CopyFailed(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return lc.parse_copy_check(done.stdout)


class WorkerCopyProvider(pulumi.dynamic.ResourceProvider):
    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        # The id is the copy's absolute root on the worker: an update (a repair) keeps its id, and a preview keeps
        # an updated resource's id known, so the worker's rank, which mounts it, is neither shown nor made to
        # change. Moving the copy replaces this resource (a new id).
        outs = run_copy(props)
        return pulumi.dynamic.CreateResult(id_=str(outs["root"]), outs=outs)

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        changed = changed_inputs(COPY_INPUT_KEYS, olds, news)
        moved = sorted(set(changed) & set(WHERE_KEYS))
        if changed:
            return pulumi.dynamic.DiffResult(changes=True, replaces=moved, delete_before_replace=False)
        try:
            stale = check_copy(news)
        except (CopyFailed, subprocess.TimeoutExpired, OSError, ValueError) as err:
            pulumi.log.warn(f"weights copy: cannot check the copy on {news.get('worker')} ({err}); left as it is")
            stale = {}
        if stale:
            shown = ", ".join(f"{p} ({why})" for p, why in sorted(stale.items())[:5])
            more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
            pulumi.log.warn(
                f"weights copy: on {news.get('worker')}, {len(stale)} file(s) are not the verified "
                f"ones: {shown}{more}; `pulumi up` copies them again"
            )
            return pulumi.dynamic.DiffResult(changes=True, replaces=[], delete_before_replace=False)
        return pulumi.dynamic.DiffResult(changes=bool(changed_inputs(INPUT_KEYS, olds, news)))

    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        if not changed_inputs(COPY_INPUT_KEYS, olds, news):
            try:
                if not check_copy(news):
                    # Only how it is reached changed: the copy is the verified one, nothing to move.
                    return pulumi.dynamic.UpdateResult(outs={**olds, **plain(INPUT_KEYS, news)})
            except (CopyFailed, subprocess.TimeoutExpired, OSError, ValueError):
                pass
        return pulumi.dynamic.UpdateResult(outs=run_copy(news))

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        """The copy stays on the worker: destroy never deletes weights."""


class WorkerCopy(pulumi.dynamic.Resource, module="weights", name="WorkerCopy"):
    """One worker's verified local copy of the staged weights, refreshed when it differs."""

    root: pulumi.Output[str]
    """The copy root on the worker, absolute (also the resource's id, which stays known while a repair is
    previewed)."""
    copied_files: pulumi.Output[int]
    copied_bytes: pulumi.Output[int]
    copy_seconds: pulumi.Output[float]
    verified_at: pulumi.Output[str]

    def __init__(self, name: str, args: WorkerCopyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props: dict[str, Any] = {
            "worker": args.worker,
            "worker_host": args.worker_host,
            "worker_port": args.worker_port,
            "worker_user": args.worker_user,
            "worker_fabric_ip": args.worker_fabric_ip,
            "head": args.head,
            "head_host": args.head_host,
            "head_port": args.head_port,
            "head_user": args.head_user,
            "head_fabric_ip": args.head_fabric_ip,
            # Flat, as state written before SshAccess holds them: a copy re-runs on a change of its inputs.
            "ssh_private_key": secret_or_none(args.ssh.private_key),
            "ssh_agent_socket": args.ssh.agent_socket,
            "ssh_known_hosts_file": args.ssh.known_hosts_file,
            "head_root": args.head_root,
            "head_image": args.head_image,
            "worker_image": args.worker_image,
            "copy_root": args.copy_root,
            "files": args.files,
            "sha256": args.sha256,
            "streams": args.streams,
            "timeout_s": args.timeout_s,
            "stack_prefix": args.stack_prefix,
            "root": None,
            "copied_files": None,
            "copied_bytes": None,
            "copy_seconds": None,
            "elapsed_s": None,
            "verified_at": None,
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=list(SECRET_KEYS))
        super().__init__(WorkerCopyProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
