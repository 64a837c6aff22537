"""LiveRanks: what is running on the nodes now, compared on every preview and up.

Pulumi keeps the containers it created in its state and, without a refresh, never looks again: a rank that was
stopped by a failed update's preflight, killed by the OOM killer or the watchdog, or removed by hand stays
"created" in the state, and the next `pulumi up` reported success with the model down. This dynamic resource
looks: its `diff` (run by every preview and up) reads each rank's container state over SSH and, when any rank
is not running, asks for its own replacement. Every rank's container names this resource's id as its
`replacement_trigger`, so the whole group is replaced together (a rank restarted alone would block at the
rendezvous of a group that no longer exists), and the gates and the verifier re-run on the new containers.
`read` reports the same observation, so `pulumi refresh` shows the drift too.

A container that runs can still be useless: a hung rank (the head's `/health` stays 200 while completions never
return), a dead one (real vLLM's head answers HTTP 500 "EngineCore encountered an issue" until it exits 0) or a
model that turned to NaN. So when every rank runs, `diff` also sends one 1-token completion with logprobs to the
endpoint (`verify.client.probe_endpoint`, judged by the verifier's own rules, bounded by `PROBE_TIMEOUT_S`). What
the server proves by its own answer (NaN, -inf, bad logprobs, the dead-engine error) is drift at once. What the
network between this machine and the head could cause (an HTTP error such as a proxy's 403/404/429/502/504, a
refused or reset connection, no answer while the engine is not busy) is confirmed first: the same probe is sent
from inside the head's container to the API on its own loopback, over the head's ssh connection
(`head_request.sh` runs `head_request.py` with the image's python3, the API key on stdin), and only drift seen
there too replaces the ranks; otherwise it is a warning. A replacement is a 20-25 minute outage.

When the supervisor runs, it is asked first: its own last probe stands in for this one when it is fresh (at most
`supervisor.probeSeconds` + SUPERVISOR_SLACK_S old by the agent's clock), healthy, and the supervisor is armed,
not paused and has not given up; the preview reports what the supervisor said either way. Ranks are still read.

A healthy deployment costs one `docker inspect` per node and one 1-token completion per preview and up, and
changes nothing. A node that cannot be reached, an endpoint this machine cannot reach, a refused API key or a
busy engine (no answer, but a step or token counter moves, the KV cache usage changes or a request runs: real
vLLM freezes its counters during partial prefills) are reported, not treated as drift: nothing is known about the
ranks then, and replacing a serving deployment on a guess would be worse. A step that hangs leaves vLLM's
`num_requests_running` above 0 and so also looks busy, until vLLM's own execute-model timeout ends the engine;
the next probe finds that.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, get_args
from urllib.parse import urlsplit

import pulumi
import pulumi.dynamic

from components import scripts
from components.contract import Contract, secret
from components.dynamic import StateOnlyProvider, changed_inputs, props_of, read_props, secret_outputs
from components.gates.gates import NORMALIZE, GateRank, rank_source, ssh_of
from components.gates.observations import ContainerState, RankSpec, SourceError
from components.http import ConnectionRefusedOrReset, DeadlineExceeded, exchange
from components.redaction import redact
from components.ssh import SshAccess
from components.verify import client as verify_client
from components.verify.client import (
    GUARD_MARGIN_S,
    HEALTH_TIMEOUT_S,
    Failure,
    Probe,
    ProbeAnswer,
    VerificationTimeout,
    judge_probe,
    probe_endpoint,
    probe_worst_case_seconds,
    run_bounded,
)
from components.verify.verdict import drift_probe_request

SUPERVISOR_TIMEOUT_S = 5.0
# The supervisor's own probe is trusted for this long past its probe interval (its next probe may run late by
# about one probe's bound).
SUPERVISOR_SLACK_S = 30.0
# A 1-token answer takes well under a second on an idle vLLM; a busy one is told apart by its counters, KV cache
# and running requests, so this only bounds how long a preview waits on a hung endpoint (plus two /metrics reads).
PROBE_TIMEOUT_S = 15.0
# The confirmation from the head: head_request.sh runs head_request.py in the head's container (docker exec).
HEAD_SCRIPT = "gates/head_request.sh"
HEAD_PROGRAM = "gates/head_request.py"
# What ssh and docker exec add to the probe's own bound.
HEAD_MARGIN_S = 20.0


# ---------------------------------------------------------------------------------------------
# The boundary: what the program sends and the provider reads back (components/contract.py)


@dataclass(frozen=True, kw_only=True)
class LiveRanksArgs(Contract):
    """Inputs of LiveRanks, each a property by its name (the state of a deployed stack keeps these names)."""

    ranks: tuple[GateRank, ...]
    ssh: SshAccess
    endpoint: str
    """The OpenAI base URL the verifier checks (`.../v1`)."""
    model: str
    api_key: pulumi.Input[str] | None = secret()
    supervisor_url: str | None = None
    """The leading supervisor agent, asked for its last probe before this preview sends its own."""
    supervisor_token: pulumi.Input[str] | None = secret(default=None)
    supervisor_fresh_s: float | None = None
    """`supervisor.probeSeconds`: its last probe counts when at most this plus SUPERVISOR_SLACK_S old."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("live ranks need every rank, at least the head's (rank 0)")

    def __repr__(self) -> str:  # keep the keys and the token out of tracebacks
        nodes = [r.node for r in self.ranks]
        return f"LiveRanksArgs(ranks={nodes!r}, endpoint={self.endpoint!r}, model={self.model!r})"


# Where the supervisor (when deployed) is asked for its own last probe: operational, not compared by a diff (a new
# token or address is not a change to what runs), not kept in the outputs.
SUPERVISOR_KEYS = ("supervisor_url", "supervisor_token", "supervisor_fresh_s")
# What a diff compares, and what the outputs echo: the rest.
INPUT_KEYS = tuple(k for k in LiveRanksArgs.field_names() if k not in SUPERVISOR_KEYS)


def args_of(props: Mapping[str, Any]) -> LiveRanksArgs:
    """The inputs back from the engine, or from the state (`read`, a diff's olds). State written before a property
    existed: `ssh` from its flat keys (`ssh_of`); no endpoint or model, nothing of its own to probe (`probe_target`);
    no supervisor to ask (the outputs never keep one)."""
    given = {k: v for k, v in props.items() if v is not None}
    return read_props(LiveRanksArgs, {"endpoint": "", "model": "", **given, "ssh": ssh_of(props).to_props()})


def supervisor_verdict(
    args: LiveRanksArgs, fetch: Callable[[str, str], Any] | None = None, *, report: Callable[[str], None]
) -> Probe | None:
    """The supervisor's own last probe, when it can stand in for this one: fresh (by the agent's clock: at most
    `probeSeconds` + SUPERVISOR_SLACK_S old), healthy, and the supervisor armed, not paused, not given up. A NaN
    or a hang after that probe is caught by the supervisor's next one, which heals it. Anything else: None, and
    LiveRanks probes itself. What the supervisor said is reported either way."""
    url, token, fresh_s = args.supervisor_url, args.supervisor_token, args.supervisor_fresh_s
    if not url or not token or not fresh_s:
        return None
    try:
        status = (fetch or _supervisor_status)(str(url), str(token))
    except (OSError, ValueError, ConnectionRefusedOrReset, DeadlineExceeded) as err:
        report(f"live ranks: the supervisor at {url} did not answer ({type(err).__name__}); probing here")
        return None
    if not isinstance(status, Mapping):
        return None
    last = status.get("last_probe") or {}
    try:
        age = float(status["now"]) - float(last["at"])
    except (KeyError, TypeError, ValueError):
        age = float("inf")
    state = last.get("state") if isinstance(last, Mapping) else None
    held = status.get("paused") or status.get("given_up") or not status.get("armed_generation")
    said = f"supervisor: {status.get('doing') or 'starting'}; its last probe {state or 'none'}"
    said += f" {age:.0f} s ago" if age != float("inf") else ""
    report(f"live ranks: {said}")
    if state == "healthy" and not held and age <= float(fresh_s) + SUPERVISOR_SLACK_S:
        return Probe("healthy", f"{said} (fresh: within {float(fresh_s) + SUPERVISOR_SLACK_S:g} s)")
    return None


def _supervisor_status(url: str, token: str) -> Any:
    reply = exchange(
        "GET",
        f"{url}/status",
        headers={"Authorization": f"Bearer {token}"},
        deadline=time.monotonic() + SUPERVISOR_TIMEOUT_S,
    )
    if reply.status != 200:
        raise ValueError(f"HTTP {reply.status}")
    return json.loads(reply.body)


def observe(ranks: Sequence[GateRank], state: Callable[[int], ContainerState]) -> dict[str, str]:
    """Per node, its rank container's status (`running`, `exited`, `missing`, ... or `unreachable: why`).

    Every node is read at once (one ssh each): a preview waits for the slowest node, not for the sum of them."""

    def one(r: GateRank) -> str:
        try:
            s = state(r.rank)
        except SourceError as err:
            return f"unreachable: {err}"
        return s.status if s.exit_code is None or s.running else f"{s.status} ({s.exit_code})"

    if not ranks:
        return {}
    with ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix="live-ranks") as pool:
        return dict(zip((r.node for r in ranks), pool.map(one, ranks), strict=True))


def drifted(observed: Mapping[str, str]) -> list[str]:
    """The nodes whose rank is known not to run. An unreachable node is not drift: nothing is known there."""
    return sorted(n for n, status in observed.items() if status != "running" and not status.startswith("unreachable"))


def down_text(node: str, status: str, head_node: str) -> str:
    """One rank found not running; vLLM's head exits 0 when a rank of its group died, which names the cause."""
    if node == head_node and status == "exited (0)":
        return (
            f"{node} (the head) is {status}: a rank of the group died (vLLM's head exits 0 when its engine "
            "loses a rank; it also does when stopped)"
        )
    return f"{node} is {status}"


def probe_target(deployed: LiveRanksArgs, configured: LiveRanksArgs) -> tuple[str, str, str | None] | None:
    """Endpoint, model and key of what is deployed (the state), else of the config (a stack from before)."""
    args = deployed if deployed.endpoint else configured
    if not args.endpoint or not args.model:
        return None
    return args.endpoint, args.model, str(args.api_key) if args.api_key else None


def head_probe(
    head: RankSpec, ssh_argv: Callable[[int, str], list[str]], target: tuple[str, str, str | None], *, timeout_s: float
) -> Probe:
    """probe_from_head, bounded like `probe` (tests replace this)."""
    try:
        return run_bounded(
            lambda: probe_from_head(head, ssh_argv, target, timeout_s=timeout_s),
            probe_worst_case_seconds(timeout_s) + HEAD_MARGIN_S + GUARD_MARGIN_S,
            f"probe from {head.node}",
        )
    except VerificationTimeout as err:
        return Probe("unknown", str(err))


def probe(target: tuple[str, str, str | None]) -> Probe:
    endpoint, model, key = target
    try:
        return run_bounded(
            lambda: probe_endpoint(endpoint, model, key, timeout_s=PROBE_TIMEOUT_S),
            probe_worst_case_seconds(PROBE_TIMEOUT_S) + GUARD_MARGIN_S,
            f"probe of {endpoint}",
        )
    except VerificationTimeout as err:  # a name look-up that sockets cannot bound
        return Probe("unknown", str(err))


InputRunner = Callable[[list[str], bytes, float], "subprocess.CompletedProcess[bytes]"]


def _run_with_input(argv: list[str], data: bytes, timeout_s: float) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=data, capture_output=True, timeout=timeout_s, check=False)


def probe_from_head(
    head: RankSpec,
    ssh_argv: Callable[[int, str], list[str]],
    target: tuple[str, str, str | None],
    *,
    timeout_s: float,
    runner: InputRunner = _run_with_input,
) -> Probe:
    """The same 1-token probe sent from inside the head's container to the API port on its own loopback, over
    the head's ssh connection (`ssh_argv`: the rank source's), judged by the same rules."""
    endpoint, model, key = target
    port = urlsplit(endpoint).port or 80
    where = f"from inside {head.container} on {head.node}, 127.0.0.1:{port}"
    request = {
        "port": port,
        "body": drift_probe_request(model),
        "api_key": key,
        "timeout_s": timeout_s,
        "gap_s": verify_client.BUSY_CHECK_GAP_S,
        "health_timeout_s": HEALTH_TIMEOUT_S,
    }
    data = (json.dumps(request) + "\n" + scripts.script_path(HEAD_PROGRAM).read_text()).encode()
    argv = ssh_argv(head.rank, scripts.render(HEAD_SCRIPT, {"CONTAINER": head.container}))
    try:
        done = runner(argv, data, probe_worst_case_seconds(timeout_s) + HEAD_MARGIN_S)
    except subprocess.TimeoutExpired:
        return Probe(
            "unknown",
            f"the probe {where} did not finish within {probe_worst_case_seconds(timeout_s) + HEAD_MARGIN_S:g} s",
        )
    except OSError as err:
        return Probe("unknown", f"cannot run ssh: {err}")
    out = (done.stdout.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
    answer = _head_answer(out, where)
    if answer is None:
        said = [
            ln
            for ln in done.stderr.decode("utf-8", "replace").strip().splitlines()
            if ln.strip() and not ln.startswith(f"components/{HEAD_SCRIPT}: exited")
        ]
        stderr = (said or ["no message"])[-1][:300]
        return Probe("unknown", redact(f"the probe {where} could not run (exit {done.returncode}): {stderr}", [key]))
    if answer.status is None and answer.failure is None:
        return Probe("unknown", f"the probe {where} answered {out[:200]!r}, not a probe result")
    found = judge_probe(answer, timeout_s)
    return Probe(found.state, redact(found.seen, [key]))


def _head_answer(line: str, where: str) -> ProbeAnswer | None:
    """head_request.py's JSON line as a ProbeAnswer; None when the line is not one."""
    try:
        seen = json.loads(line)
    except ValueError:
        return None
    if not isinstance(seen, dict):
        return None
    failure = next((f for f in get_args(Failure) if f == seen.get("failure")), None)
    status = seen.get("status")
    metrics = seen.get("metrics")
    first, second = metrics if isinstance(metrics, list) and len(metrics) == 2 else [None, None]
    return ProbeAnswer(
        status=status if isinstance(status, int) else None,
        body=str(seen.get("body") or "").encode(),
        failure=failure,
        detail=f"{seen.get('detail') or ''} {where}".strip(),
        metrics=(first if isinstance(first, str) else None, second if isinstance(second, str) else None),
    )


def confirmed(operator: Probe, head: Callable[[], Probe]) -> Probe:
    """A drift finding that the network between this machine and the head could cause stands only when the head
    itself sees drift too; otherwise it is a warning (a proxy's 403/404/429/502/504, a firewall, a route)."""
    if operator.state != "drift" or not operator.confirm:
        return operator
    there = head()
    if there.state == "drift":
        return Probe("drift", f"{operator.seen}; from the head itself too: {there.seen}")
    if there.state == "healthy":
        return Probe(
            "unknown",
            f"{operator.seen}, but from the head itself it {there.seen}: the network or a proxy "
            "between this machine and the head, not the ranks; not treated as drift",
        )
    return Probe("unknown", f"{operator.seen}, and the head could not confirm it ({there.seen}): not treated as drift")


class LiveRanksProvider(StateOnlyProvider):
    input_keys = INPUT_KEYS
    normalize = NORMALIZE
    id_prefix = "live"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        # The inputs only: created before the containers it watches, it observes on every diff and read.
        return {**{k: props.get(k) for k in INPUT_KEYS}, "observed": {}, "endpoint_observed": None}

    def _observe(self, args: LiveRanksArgs) -> dict[str, str]:
        return observe(args.ranks, rank_source(args.ranks, args.ssh).state)

    def _probe(
        self, observed: Mapping[str, str], deployed: LiveRanksArgs, news: LiveRanksArgs
    ) -> tuple[str, Probe] | None:
        """Only when every rank runs: a rank known down already decides, an unreachable node leaves it open."""
        target = probe_target(deployed, news)
        if target is None or any(status != "running" for status in observed.values()):
            return None
        trusted = supervisor_verdict(news, report=pulumi.log.info)
        if trusted is not None:
            return target[0], trusted
        head = min(news.ranks, key=lambda r: r.rank)
        found = confirmed(
            probe(target),
            lambda: head_probe(head, rank_source(news.ranks, news.ssh).argv, target, timeout_s=PROBE_TIMEOUT_S),
        )
        return target[0], found

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        args = args_of(news)
        observed = self._observe(args)
        down = drifted(observed)
        for node, status in sorted(observed.items()):
            if status.startswith("unreachable"):
                pulumi.log.warn(f"live ranks: node {node} {status}; cannot tell whether its rank runs")
        replace = pulumi.dynamic.DiffResult(changes=True, replaces=["observed"], delete_before_replace=True)
        if down:
            head = args.ranks[0].node
            pulumi.log.warn(
                "live ranks: "
                + ", ".join(down_text(n, observed[n], head) for n in down)
                + ": every rank is replaced together and verified again"
            )
            return replace
        probed = self._probe(observed, args_of(olds), args)
        if probed is not None and probed[1].state == "drift":
            pulumi.log.warn(
                f"live ranks: every rank runs, but {probed[0]} {probed[1].seen}: every rank is "
                "replaced together and verified again"
            )
            return replace
        if probed is not None and probed[1].state == "unknown":
            pulumi.log.warn(f"live ranks: {probed[0]} {probed[1].seen}")
        # New ranks, endpoint or SSH settings: stored in place (the containers follow their own inputs).
        return pulumi.dynamic.DiffResult(changes=bool(changed_inputs(INPUT_KEYS, olds, news, NORMALIZE)))

    def read(self, id_: str, props: dict[str, Any]) -> pulumi.dynamic.ReadResult:
        stored = args_of(props)
        observed = self._observe(stored)
        probed = self._probe(observed, stored, stored)
        seen = probed[1].seen if probed is not None else "not probed: not every rank runs"
        return pulumi.dynamic.ReadResult(id_=id_, outs={**props, "observed": observed, "endpoint_observed": seen})


class LiveRanks(pulumi.dynamic.Resource, module="drift", name="LiveRanks"):
    """Replaced (and with it every rank) when a preview or up finds a rank container not running, or the
    endpoint not answering with real logprobs."""

    observed: pulumi.Output[dict[str, str]]
    """Per node, its rank's container status as last read (by `pulumi refresh`)."""
    endpoint_observed: pulumi.Output[str | None]
    """What the endpoint answered the 1-token probe when last read (by `pulumi refresh`)."""

    def __init__(self, name: str, args: LiveRanksArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props = {**props_of(args), "observed": None, "endpoint_observed": None}
        secret = pulumi.ResourceOptions(additional_secret_outputs=secret_outputs(args))
        super().__init__(LiveRanksProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
