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

from components.contract import Contract, secret
from components.dynamic import changed_inputs, log_progress, plain, props_of, read_props, secret_outputs
from components.ssh import SshAccess, SshTarget, ssh_argv
from components.weights import local_copy as lc
from components.weights.copy_source import HEARTBEAT_S

SOURCE_START_TIMEOUT_S = 120.0
CHECK_TIMEOUT_S = 30.0
_PROGRESS_INTERVAL_S = 10.0


class CopyFailed(Exception):
    """The copy did not complete; the message names the worker and what the node said."""


# ---------------------------------------------------------------------------------------------
# The boundary: what the program sends and the provider reads back (components/contract.py)


@dataclass(frozen=True, kw_only=True)
class WorkerCopyArgs(Contract):
    """Inputs of WorkerCopy, each a property by its name and flat (the state of a deployed stack keeps these
    names: a copy runs again when its inputs change)."""

    # What decides the copy's content (COPY_INPUT_KEYS).
    worker: str
    worker_host: str
    worker_port: int
    head_root: pulumi.Input[str]
    """The head's weights root, absolute (the staging output)."""
    copy_root: str
    """The copy root on this worker, `{node}` already resolved."""
    files: pulumi.Input[Mapping[str, int]]
    sha256: pulumi.Input[Mapping[str, str]]
    # How both ends are reached and how the copy runs.
    worker_user: str
    worker_fabric_ip: str
    head: str
    head_host: str
    head_port: int
    head_user: str
    head_fabric_ip: str
    head_image: pulumi.Input[str]
    """The serving image on the head (runs the source)."""
    worker_image: pulumi.Input[str]
    """The serving image on this worker (runs the copier): its id, so the copy waits for the pull."""
    streams: int
    timeout_s: int
    stack_prefix: str
    # The stack's `ssh` section (components/ssh.py SshAccess), flat as the state of a deployed copy holds it.
    ssh_private_key: pulumi.Input[str] | None = secret()
    ssh_agent_socket: str | None
    ssh_known_hosts_file: str | None

    def __repr__(self) -> str:  # keep the key out of tracebacks
        return f"WorkerCopyArgs(worker={self.worker!r}, head={self.head!r}, copy_root={self.copy_root!r})"

    def manifest(self) -> tuple[Mapping[str, int], Mapping[str, str]]:
        """`files` and `sha256` as the provider reads them: plain objects, path -> size and path -> digest."""
        files, sha256 = self.files, self.sha256
        if not isinstance(files, Mapping) or not isinstance(sha256, Mapping):
            raise ValueError(
                f"WorkerCopy needs files and sha256 as objects, got {type(files).__name__} and {type(sha256).__name__}"
            )
        return files, sha256

    def ssh(self) -> SshAccess:
        return SshAccess(
            private_key=self.ssh_private_key,
            agent_socket=self.ssh_agent_socket,
            known_hosts_file=self.ssh_known_hosts_file,
        )

    def head_target(self) -> SshTarget:
        return self.ssh().target(self.head_host, self.head_port, self.head_user)

    def worker_target(self) -> SshTarget:
        return self.ssh().target(self.worker_host, self.worker_port, self.worker_user)


# Every input: a change of any is stored (an update), and what the outputs echo.
INPUT_KEYS = WorkerCopyArgs.field_names()
# What decides the copy's content: a change re-runs it (images, streams and credentials do not).
COPY_INPUT_KEYS = ("worker", "worker_host", "worker_port", "head_root", "copy_root", "files", "sha256")
# Where the copy is: a change is a new copy (a new resource id), never an update.
WHERE_KEYS = ("worker", "worker_host", "worker_port", "copy_root")


def _drain(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _tail(lines: list[str], n: int = 8) -> str:
    return "\n    ".join(lines[-n:]) or "(nothing on stderr)"


class _Source:
    """The head's source for one copy: started, read until it listens, stopped by closing its stdin."""

    def __init__(self, args: WorkerCopyArgs, token: str) -> None:
        command = lc.render_source_command(
            abs_root=str(args.head_root),
            bind=args.head_fabric_ip,
            image=str(args.head_image),
            container=lc.source_container(args.stack_prefix, args.worker),
        )
        self.head = args.head
        self.proc = subprocess.Popen(
            ssh_argv(args.head_target(), command),
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
        config = lc.source_config(token=token, worker_fabric_ip=args.worker_fabric_ip, timeout_s=args.timeout_s)
        self.proc.stdin.write(config.to_line() + "\n")
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
    args = read_props(WorkerCopyArgs, props)
    worker = args.worker
    token = secrets.token_urlsafe(32)
    began = time.monotonic()
    files, sha256 = args.manifest()
    config = lc.copier_config(token=token, files=files, sha256=sha256)  # before the source: refused, nothing runs
    source = _Source(args, token)
    try:
        ready = source.wait_listening()
        command = lc.render_copy_command(
            node=worker,
            copy_root=args.copy_root,
            source=f"http://{args.head_fabric_ip}:{ready.port}",
            source_ident=ready.ident,
            bind=args.worker_fabric_ip,
            image=str(args.worker_image),
            container=lc.copier_container(args.stack_prefix),
            streams=args.streams,
            timeout_s=args.timeout_s,
        )
        proc = subprocess.Popen(
            ssh_argv(args.worker_target(), command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin and proc.stdout and proc.stderr
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(proc.stdout or ()), daemon=True).start()
        proc.stdin.write(lc.copier_stdin(config))
        proc.stdin.close()
        errors: list[str] = []
        last_progress = 0.0
        for line in proc.stderr:
            errors.append(line.rstrip())
            now = time.monotonic()
            if now - last_progress >= _PROGRESS_INTERVAL_S or "copying" in line:
                log(f"weights copy: {line.rstrip().removeprefix('copy_weights: ')}")
                last_progress = now
        proc.wait(timeout=args.timeout_s + 120)
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


def check_copy(args: WorkerCopyArgs) -> dict[str, str]:
    """{path: why} for every file of the worker's copy that is not the verified one (copy_check.sh)."""
    files, sha256 = args.manifest()
    command = lc.render_copy_check(copy_root=args.copy_root, files=files, sha256=sha256)
    done = subprocess.run(
        ssh_argv(args.worker_target(), command),
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
        args = read_props(WorkerCopyArgs, news)
        try:
            stale = check_copy(args)
        except (CopyFailed, subprocess.TimeoutExpired, OSError, ValueError) as err:
            pulumi.log.warn(f"weights copy: cannot check the copy on {args.worker} ({err}); left as it is")
            stale = {}
        if stale:
            shown = ", ".join(f"{p} ({why})" for p, why in sorted(stale.items())[:5])
            more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
            pulumi.log.warn(
                f"weights copy: on {args.worker}, {len(stale)} file(s) are not the verified "
                f"ones: {shown}{more}; `pulumi up` copies them again"
            )
            return pulumi.dynamic.DiffResult(changes=True, replaces=[], delete_before_replace=False)
        return pulumi.dynamic.DiffResult(changes=bool(changed_inputs(INPUT_KEYS, olds, news)))

    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        if not changed_inputs(COPY_INPUT_KEYS, olds, news):
            args = read_props(WorkerCopyArgs, news)
            try:
                if not check_copy(args):
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
        props = {
            **props_of(args),
            "root": None,
            "copied_files": None,
            "copied_bytes": None,
            "copy_seconds": None,
            "elapsed_s": None,
            "verified_at": None,
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=secret_outputs(args))
        super().__init__(WorkerCopyProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
