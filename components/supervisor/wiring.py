"""The supervisor's stages: the update lock, held from the program's start (the supervisor, once it exists, leaves
every rank to this update until the program ends), and the agents, installed after the verifier."""

from __future__ import annotations

from collections.abc import Callable

import pulumi

from components.access.wiring import Access
from components.serving.serving import ServingCluster
from components.supervisor.supervisor import Supervisor, SupervisorArgs, SupervisorNode, leader_url, supervisor_token
from components.supervisor.update_lock import LockHeld, UpdateLock, holder_name
from components.verify.verifier import Verifier
from components.wiring import Wiring


def hold_update_lock(w: Wiring, engine_alive: Callable[[], bool]) -> str | None:
    """The agents' token, once this update holds the lock (a preview only reports it); None: no supervisor."""
    s = w.s
    if not s.supervisor.enabled:
        return None
    token = supervisor_token(s, w.stack, w.keys_dir)
    lock = UpdateLock(
        leader_url(s, w.head_address),
        token,
        holder_name(w.stack, pulumi.runtime.is_dry_run()),
        log=pulumi.log.warn,
        engine_alive=engine_alive,
    )
    if pulumi.runtime.is_dry_run():
        lock.report(pulumi.log.info)  # a preview changes nothing on the nodes: it takes no lock
    else:
        try:
            lock.start(report=pulumi.log.info)
        except LockHeld as held:
            raise pulumi.RunError(str(held)) from None
    return token


def wire_supervisor(
    w: Wiring,
    *,
    token: str,
    access: Access,
    image_ids: dict[str, pulumi.Output[str]],
    serving: ServingCluster,
    verifier: Verifier,
) -> Supervisor:
    return Supervisor(
        "supervisor",
        SupervisorArgs(
            settings=w.s,
            stack=w.stack,
            stack_prefix=w.prefix,
            token=token,
            endpoint=w.endpoint,
            head_address=w.head_address,
            generation=serving.generation,
            bounds=w.bounds,
            nodes=[
                SupervisorNode(
                    name=n.name,
                    index=i,
                    connection=access[n.name].connection,
                    docker_provider=access[n.name].docker_provider,
                    image_id=image_ids[n.name],
                )
                for i, n in enumerate(w.s.nodes)
            ],
            after=[verifier],
        ),
        opts=w.opts(),
    )
