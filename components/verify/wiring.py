"""The verification stage: the gates after every rank, then the verifier, which fails the update unless real
logprobs come back."""

from __future__ import annotations

import pulumi

from components.gates.wiring import wire_gates
from components.rollback.history import rollback_command
from components.serving.serving import ServingCluster
from components.verify.client import DEFAULT_TIMEOUT_S
from components.verify.verifier import Verifier, VerifierArgs
from components.wiring import Wiring


def wire_verification(w: Wiring, serving: ServingCluster) -> Verifier:
    """All three re-run exactly when a rank's container is created or replaced."""
    g = w.s.gates
    ready = wire_gates(
        w,
        container_names=serving.container_names,
        container_ids=serving.container_ids,
        after=list(serving.containers.values()),
    )
    return Verifier(
        "verify",
        VerifierArgs(
            endpoint=w.endpoint,
            model=w.s.serve.served_model_name,
            rerun_on=serving.container_ids,
            api_key=w.api_key,
            timeout_s=min(DEFAULT_TIMEOUT_S, float(g.verify_timeout_seconds)),
            retry_window_s=float(g.verify_timeout_seconds),
            # The first request after a boot can spend minutes in JIT: warm up within the window, then judge.
            warmup_timeout_s=float(g.verify_timeout_seconds),
            min_decode_tokens_per_second=g.min_decode_tokens_per_second,
            expected_answer=g.expected_answer,
            rollback_command=rollback_command(w.stack),
        ),
        opts=w.opts(pulumi.ResourceOptions(depends_on=[ready])),
    )
