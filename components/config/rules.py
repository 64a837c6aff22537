"""The recipe's rules that span keys, which a schema cannot express: each names the key, the value and the fix."""

from __future__ import annotations

import json
import re

from pydantic.alias_generators import to_camel

from components import capacity
from components.config.flags import OWNED_ENV, OWNED_FLAGS, abbreviates, canonical_flag, owner_of
from components.config.models import LONG_PREFILL_HEADROOM_TOKENS, OPEN_ENDPOINT, Settings

# Environment names that hold credentials: `serve.extraEnv` is plain text in the stack file and in
# `docker inspect`, so a credential there is refused (the program passes hfToken and apiKey itself).
_CREDENTIAL_ENV = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_?KEY|CREDENTIALS?)(_|$)", re.IGNORECASE
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def rules(s: Settings) -> tuple[list[str], list[str]]:
    """The recipe's rules that a schema cannot express. Returns (problems, warnings)."""
    problems: list[str] = []
    warnings: list[str] = []

    for flag in s.serve.extra_args:
        name = canonical_flag(flag)
        if name == "--kv-cache-dtype":
            problems.append(
                f"`serve.extraArgs` contains {flag!r}: do not pass --kv-cache-dtype; vLLM picks fp8_ds_mla "
                "itself for this model (recipe section 3). Remove it."
            )
        elif name is not None and (why := owner_of(name)):
            spelled = "" if flag.split("=", 1)[0] == name else f" (vLLM reads it as {name})"
            problems.append(f"`serve.extraArgs` contains {flag!r}{spelled}: the program renders it; {why}.")
        elif name is not None and name.startswith("--") and (prefixed := abbreviates(name)):
            problems.append(
                f"`serve.extraArgs` contains {flag!r}: argparse takes an unambiguous prefix as the whole flag, "
                f"so this would set {prefixed}, which the program renders; {OWNED_FLAGS[prefixed]}."
            )
    for var, value in s.serve.extra_env.items():
        if not _ENV_NAME.fullmatch(var):
            problems.append(
                f"`serve.extraEnv` key {json.dumps(var)}: not an environment variable name (letters, digits and "
                "'_', not starting with a digit)"
            )
        elif var in OWNED_ENV:
            problems.append(f"`serve.extraEnv` sets {var}: the program renders it; {OWNED_ENV[var]}.")
        elif _CREDENTIAL_ENV.search(var):
            problems.append(
                f"`serve.extraEnv` sets {var}, which names a credential: extraEnv is plain text in the stack file "
                "and in `docker inspect`; use `weights.hfToken` or `serve.apiKey` (stored with --secret), "
                "which the program passes itself"
            )
        if "\n" in value or "\0" in value:
            problems.append(f"`serve.extraEnv.{var}` holds a newline or NUL: an environment value is one line")

    if s.weights.share == "copy":
        roots = [s.copy_root_of(w) for w in s.workers]
        if len(set(roots)) != len(roots):
            problems.append(
                f"`weights.copyRoot` = {json.dumps(s.weights.copy_root)} gives two workers the same directory "
                f"({roots}): when workers share a filesystem, put `{{node}}` in it, e.g. `/var/lib/dsv41-exl3/{{node}}`"
            )
        if not s.workers:
            warnings.append('`weights.share` = "copy" with one node: there is no worker to copy to')
    elif s.weights.copy_root is not None:
        warnings.append(
            f"`weights.copyRoot` is set but `weights.share` = {json.dumps(s.weights.share)}: it is "
            "used only with `share: copy`"
        )

    for i, n in enumerate(s.nodes):
        if n.ib_hcas and not n.rdma_devices:
            problems.append(
                f"`nodes[{i}].ibHcas` = {json.dumps(n.ib_hcas)} with `nodes[{i}].rdmaDevices` = []: NCCL cannot "
                "open an HCA without the RDMA devices in the container; set rdmaDevices (the recipe passes "
                '["/dev/infiniband"]) or `ibHcas: []` to run NCCL over TCP sockets'
            )

    floor = s.watchdog.mem_available_floor_gib
    if floor >= capacity.NODE_USABLE_GIB:
        problems.append(
            f"`watchdog.memAvailableFloorGiB` = {floor:g}: a Spark has ~{capacity.NODE_USABLE_GIB:.0f} GiB in all, "
            "so the watchdog would stop every rank at once; the launcher arms it at 1.5 GiB (a healthy head "
            "dips to ~2.1 GiB at a 601K prefill)"
        )
    elif s.watchdog.enabled and floor >= s.preflight.min_mem_available_gib:
        warnings.append(
            f"`watchdog.memAvailableFloorGiB` = {floor:g} is not below `preflight.minMemAvailableGiB` = "
            f"{s.preflight.min_mem_available_gib:g}: the watchdog may stop ranks the preflight admitted"
        )

    mnbt = s.serve.max_num_batched_tokens
    threshold = s.serve.long_prefill_token_threshold
    if threshold is not None and mnbt - threshold < LONG_PREFILL_HEADROOM_TOKENS:
        fix = (
            f"set it to at most {mnbt - LONG_PREFILL_HEADROOM_TOKENS}, or remove it to derive it"
            if mnbt > LONG_PREFILL_HEADROOM_TOKENS
            else f"raise `serve.maxNumBatchedTokens` above {LONG_PREFILL_HEADROOM_TOKENS} first"
        )
        problems.append(
            f"`serve.longPrefillTokenThreshold` = {threshold} with `serve.maxNumBatchedTokens` = {mnbt}: the "
            f"launcher's rule is maxNumBatchedTokens - threshold >= {LONG_PREFILL_HEADROOM_TOKENS}, so a short "
            f"request is not stuck behind a long prefill; {fix}"
        )
    elif threshold is None and mnbt <= LONG_PREFILL_HEADROOM_TOKENS:
        problems.append(
            f"`serve.maxNumBatchedTokens` = {mnbt}: the long-prefill threshold is derived as "
            f"maxNumBatchedTokens - {LONG_PREFILL_HEADROOM_TOKENS}, which needs more than "
            f"{LONG_PREFILL_HEADROOM_TOKENS}; fix: raise it (the recipe uses 1536)"
        )
    template = s.serve.chat_template
    if template and not template.startswith("/"):
        problems.append(
            f"`serve.chatTemplate` = {json.dumps(template)}: must be an absolute path inside the container "
            "(the recipe image has /opt/dsv41/chat_template.jinja), or empty for the checkpoint's template"
        )
    if s.serve.enable_auto_tool_choice and not s.serve.tool_call_parser:
        problems.append(
            '`serve.enableAutoToolChoice` = true with `serve.toolCallParser` = "": vLLM refuses to start '
            "auto tool choice without a parser; set one (the recipe's is deepseek_v41) or "
            "`serve.enableAutoToolChoice: false`"
        )
    for key, value in (
        ("quantization", s.serve.quantization),
        ("tokenizerMode", s.serve.tokenizer_mode),
        ("toolCallParser", s.serve.tool_call_parser),
        ("reasoningParser", s.serve.reasoning_parser),
    ):
        if value != value.strip() or any(c.isspace() for c in value):
            problems.append(
                f"`serve.{key}` = {json.dumps(value)}: must be one name without spaces, or empty to leave the flag out"
            )
    if not s.serve.pytorch_cuda_alloc_conf.strip():
        problems.append(
            "`serve.pytorchCudaAllocConf` is empty: use the launcher's expandable_segments:True (without it "
            "long prefill fragments: 244 tok/s at 455k)"
        )

    for key in ("name", "host", "fabric_ip"):
        seen: dict[str, int] = {}
        for i, n in enumerate(s.nodes):
            value = getattr(n, key) if key != "host" else f"{n.host}:{n.port}"
            if value in seen:
                problems.append(
                    f"`nodes[{i}].{to_camel(key)}` = {json.dumps(value)} duplicates nodes[{seen[value]}]: "
                    "each Spark must appear once"
                )
            seen.setdefault(value, i)

    problems += port_clashes(s)

    problems += capacity.problems(
        tensor_parallel_size=s.tensor_parallel_size,
        max_model_len=s.serve.max_model_len,
        kv_cache_memory_bytes=s.serve.kv_cache_memory_bytes,
        prometheus_mib=s.observability.memory_mib if s.observing else None,
        node_exporter=bool(s.observability.node_exporter_image),
    )

    if s.serve.engram_cache_gib > 0 or s.serve.engram_resident_scales:
        warnings.append(
            f"`serve.engramCacheGiB` = {s.serve.engram_cache_gib:g} / `serve.engramResidentScales` = "
            f"{str(s.serve.engram_resident_scales).lower()}: the Engram row cache and pinned scales (~1.5 GiB per "
            "Engram layer) are unified memory each rank loses; the head runs at ~4 GiB MemAvailable after "
            "warm-up (the launcher keeps both off)"
        )
    per_step = s.serve.max_num_seqs * (s.serve.num_speculative_tokens + 1)
    if s.serve.exl3_temp_rows_fused < per_step:
        warnings.append(
            f"`serve.exl3TempRowsFused` = {s.serve.exl3_temp_rows_fused} is below maxNumSeqs x "
            f"(numSpeculativeTokens + 1) = {per_step}: a decode step no longer fits one fused MoE launch"
        )
    if s.serve.enforce_eager:
        warnings.append(
            "`serve.enforceEager` is true: no CUDA graphs and no speculative decoding; expect 11-13 tok/s "
            "instead of ~23"
        )
    if s.open_endpoint:
        warnings.append(
            f"`serve.apiKey` = {OPEN_ENDPOINT}: the endpoint serves anyone who reaches port {s.serve.port} of the "
            "head, without a key. Remove the setting to have the program generate one "
            "(`pulumi stack output --show-secrets apiKey`)"
        )
    if s.gates.ready_timeout_seconds < 36 * 60:
        warnings.append(
            f"`gates.readyTimeoutSeconds` = {s.gates.ready_timeout_seconds} is under 36 minutes: a first boot "
            "after an NCCL topology change can spend that long in JIT"
        )
    return problems, warnings


def listener_ports(s: Settings) -> list[tuple[str, int]]:
    """Every port this deployment listens on, on one node at least, with the key that sets it."""
    ports = [("serve.port", s.serve.port), ("serve.masterPort", s.serve.master_port)]
    if s.supervisor.enabled:
        ports.append(("supervisor.port", s.supervisor.port))
    if s.observing:
        ports += [
            ("observability.port", s.observability.port),
            ("observability.exporterPort", s.observability.exporter_port),
        ]
        if s.observability.node_exporter_image:
            ports.append(("observability.nodeExporterPort", s.observability.node_exporter_port))
    return ports


def port_clashes(s: Settings) -> list[str]:
    """One problem per port two listeners would share (the second would fail to bind, at boot or at 3 am)."""
    problems = []
    first: dict[int, str] = {}
    for key, port in listener_ports(s):
        if port in first:
            problems.append(
                f"`{key}` = {port} is also `{first[port]}`: every listener needs a port of its own on the node; "
                f"pick another for `{key}`"
            )
        else:
            first[port] = key
    return problems
