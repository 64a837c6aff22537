"""The observability stage: Prometheus on the head, an exporter and a node exporter on every node, beside the
supervisor after the verifier (the exporter asks its agent at every scrape)."""

from __future__ import annotations

import pulumi

from components.access.wiring import Access
from components.observability.observability import Observability, ObservabilityArgs, ObservedNode
from components.serving.serving import ServingCluster
from components.supervisor.supervisor import agent_url
from components.verify.verifier import Verifier
from components.wiring import Wiring


def wire_observability(
    w: Wiring,
    *,
    token: str,
    access: Access,
    image_ids: dict[str, pulumi.Output[str]],
    serving: ServingCluster,
    verifier: Verifier,
) -> Observability:
    s = w.s
    return Observability(
        "observability",
        ObservabilityArgs(
            settings=s,
            stack=w.stack,
            stack_prefix=w.prefix,
            token=token,
            generation=serving.generation,
            api_key=w.api_key,
            nodes=[
                ObservedNode(
                    name=n.name,
                    index=i,
                    connection=access[n.name].connection,
                    docker_provider=access[n.name].docker_provider,
                    image_id=image_ids[n.name],
                    agent_url=agent_url(s, i),
                )
                for i, n in enumerate(s.nodes)
            ],
            head_address=w.head_address,
            # Beside the supervisor, not after its agents: the exporter asks its agent at every scrape
            # (dsv41_agent_up 0 until it answers, alerting after 2 m), so the layer's chain does not
            # lengthen every up's (measured: 0.8 s of a no-op up's 5 s ran after the verifier).
            after=[verifier],
        ),
        opts=w.opts(),
    )
