"""The weights stage: staged on the head once its preflight passed, then made visible to every node."""

from __future__ import annotations

import pulumi

from components.access.wiring import Access
from components.image.wiring import Images
from components.preflight.wiring import Preflights
from components.weights.weight_store import CopySettings, WeightNode, WeightStore, WeightStoreArgs
from components.wiring import Wiring


def wire_weights(w: Wiring, access: Access, images: Images, preflights: Preflights) -> WeightStore:
    s = w.s
    copy_mode = s.weights.share == "copy"

    def weight_node(name: str) -> WeightNode:
        node = next(n for n in s.nodes if n.name == name)
        return WeightNode(
            name=name,
            connection=access[name].connection,
            fabric_ip=node.fabric_ip,
            host=node.host,
            port=node.port,
            user=node.user,
            copy_root=s.copy_root_of(node) if copy_mode and node is not s.head else None,
            ready=[preflights.passed[name].command],
            docker_provider=access[name].docker_provider,
            image=images[name].image_id,
        )

    return WeightStore(
        "weights",
        WeightStoreArgs(
            head=weight_node(s.head.name),
            workers=[weight_node(n.name) for n in s.workers],
            root=s.weights.root,
            share=s.weights.share,
            staging_image=images[s.head.name].image_id,
            model_repo=s.weights.model_repo,
            engram_repo=s.weights.engram_repo,
            revision=s.weights.revision,
            hf_token=pulumi.Output.secret(s.weights.hf_token.get_secret_value()) if s.weights.hf_token else None,
            hf_endpoint=s.weights.hf_endpoint,
            stage_timeout_s=s.weights.stage_timeout_minutes * 60,
            download_streams=s.weights.download_streams,
            stack_prefix=w.prefix,
            copy=CopySettings(ssh=w.ssh, streams=s.weights.copy_streams, timeout_s=s.weights.stage_timeout_minutes * 60)
            if copy_mode
            else None,
        ),
        opts=w.opts(pulumi.ResourceOptions(depends_on=[preflights.passed[s.head.name].command])),
    )
