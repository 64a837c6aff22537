"""The serving stage: every rank's container, each once its node passed its preflight, sees the weights and holds
the image; every worker before the head (serving.py)."""

from __future__ import annotations

import pulumi

from components import labels
from components.access.wiring import Access
from components.gates.live_ranks import LiveRanks
from components.image.wiring import Images
from components.preflight.wiring import Preflights
from components.serving.serving import RankInputs, ServingCluster, ServingClusterArgs
from components.weights.weight_store import WeightStore
from components.wiring import Wiring


def wire_serving(
    w: Wiring,
    *,
    access: Access,
    images: Images,
    image_ids: dict[str, pulumi.Output[str]],
    preflights: Preflights,
    weights: WeightStore,
    live: LiveRanks,
) -> ServingCluster:
    s = w.s
    return ServingCluster(
        "serving",
        ServingClusterArgs(
            settings=s,
            stack=w.stack,
            replace_when=live.id,
            head_connection=access[s.head.name].connection,
            state_dir=labels.state_dir(w.prefix),
            api_key=w.api_key,
            generation=w.generation,
            ranks=[
                RankInputs(
                    node=n,
                    provider=access[n.name].docker_provider,
                    image_id=image_ids[n.name],
                    gid_index=preflights.passed[n.name].gid_index,
                    model_source=weights.model_source[n.name],
                    engram_source=weights.engram_source[n.name],
                    mount_type="bind" if weights.mount_type[n.name] == "bind" else "volume",
                    depends_on=[preflights.passed[n.name].command, weights.visible[n.name], images[n.name]],
                )
                for n in s.nodes
            ],
        ),
        opts=w.opts(),
    )
