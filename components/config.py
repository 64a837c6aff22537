"""The deployment's settings: one validated model read once from stack config.

Pure logic: no resources. Every key is camelCase in the stack file (namespace
`dsv41-exl3`); every error names the key path, the bad value and the fix, and all
errors are reported together so one edit of the stack file fixes them all.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from components import capacity
from components.redaction import redact

NAMESPACE = "dsv41-exl3"
RECIPE_IMAGE = "ghcr.io/miaai-lab/deepseek-v4.1-flash-exl3-2x-dgx-sparks:2.9bpw"
RECIPE_SERVED_NAME = "DeepSeek-v4.1-Flash-EXL3"

# Keys whose values are credentials: they must be stored encrypted (`--secret`).
SECRET_KEYS = {"ssh.privateKey", "weights.hfToken", "serve.apiKey"}

# Flags the program renders itself from structured keys; passing them through
# `serve.extraArgs` would make two sources of truth that silently disagree.
OWNED_FLAGS = {
    "--tensor-parallel-size": "it is the number of entries in `nodes`",
    "--nnodes": "it is the number of entries in `nodes`",
    "--node-rank": "it is each node's position in `nodes`",
    "--master-addr": "it is the head's `fabricIp`",
    "--master-port": "set `serve.masterPort`",
    "--headless": "workers get it automatically",
    "--port": "set `serve.port`",
    "--served-model-name": "set `serve.servedModelName`",
    "--max-model-len": "set `serve.maxModelLen`",
    "--max-num-seqs": "set `serve.maxNumSeqs`",
    "--max-num-batched-tokens": "set `serve.maxNumBatchedTokens`",
    "--kv-cache-memory-bytes": "set `serve.kvCacheMemoryBytes`",
    "--gpu-memory-utilization": "set `serve.gpuMemoryUtilization`",
    "--enforce-eager": "set `serve.enforceEager: true`",
    "--quantization": "set `serve.quantization`",
    "--tokenizer-mode": "set `serve.tokenizerMode`",
    "--tool-call-parser": "set `serve.toolCallParser`",
    "--reasoning-parser": "set `serve.reasoningParser`",
    "--speculative-config": "set `serve.numSpeculativeTokens`",
    "--api-key": "set `serve.apiKey` as a secret (it is passed by environment, never argv)",
    "--long-prefill-token-threshold": "set `serve.longPrefillTokenThreshold` (derived from the batch size by default)",
    "--enable-auto-tool-choice": "set `serve.enableAutoToolChoice`",
    "--chat-template": "set `serve.chatTemplate`",
    "--pipeline-parallel-size": "the program runs one tensor-parallel group, one rank per node",
    "--data-parallel-size": "the program runs one tensor-parallel group, one rank per node",
    "--hf-token": "set `weights.hfToken` as a secret (argv is visible to every process on the node)",
}

# Every one-dash option of `vllm serve` in vLLM 0.32 (`vllm/engine/arg_utils.py`, `vllm/entrypoints/launchers/
# cli_args.py`, argparse's own -h) and the long option it stands for. argparse reads a one-dash argument as that
# option exactly, the option before a `=` (`-tp=4`), a two-character option with its value attached (`-n2`,
# `-qexl3`), or an unambiguous prefix of one of these (`-t` is `-tp`, `-s` is `-sc`); no option starts with
# `-n` or `-r` but those two, so every `-n...` / `-r...` is --nnodes / --node-rank. `-O` is vLLM's own rewrite
# to --optimization-level, done before argparse.
VLLM_SHORT_OPTIONS = {
    "-h": "--help",
    "-q": "--quantization",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel",
    "-sc": "--speculative-config",
    "-dc": "--diffusion-config",
    "-cc": "--compilation-config",
    "-ac": "--attention-config",
    "-asc": "--api-server-count",
}
# Every data-parallel setting (--data-parallel-rank, -size-local, -address, ...) is owned with --data-parallel-size:
# the program runs one tensor-parallel group, one rank per node.
_DATA_PARALLEL = "--data-parallel-"

# Boolean flags vLLM declares with argparse.BooleanOptionalAction, which also accept `--no-<flag>`.
NEGATABLE_FLAGS = {"--enforce-eager", "--enable-auto-tool-choice"}

# Environment names that hold credentials: `serve.extraEnv` is plain text in the stack file and in
# `docker inspect`, so a credential there is refused (the program passes hfToken and apiKey itself).
_CREDENTIAL_ENV = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_?KEY|CREDENTIALS?)(_|$)", re.IGNORECASE
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Environment variables the program renders from structured keys (or derives); `serve.extraEnv`
# may set any other variable of the rendered set (see docs/checks.md, the upstream launcher's settings).
OWNED_ENV = {
    "NNODES": "it is the number of entries in `nodes` (the Engram row store splits its cache by it)",
    "VLLM_ENGINE_READY_TIMEOUT_S": "it is derived from `gates.rendezvousTimeoutSeconds` + "
    "`gates.readyTimeoutSeconds`, so the ready gate is the bound that acts",
    "DSV41_CACHE_GIB": "set `serve.engramCacheGiB`",
    "DSV41_RESIDENT_SCALES": "set `serve.engramResidentScales`",
    "EXL3_TEMP_ROWS_FUSED": "set `serve.exl3TempRowsFused`",
    "PYTORCH_CUDA_ALLOC_CONF": "set `serve.pytorchCudaAllocConf`",
    "VLLM_HOST_IP": "it is each node's `fabricIp`",
    "NCCL_SOCKET_IFNAME": "set `nodes[].fabricInterface`",
    "GLOO_SOCKET_IFNAME": "set `nodes[].fabricInterface`",
    "NCCL_IB_HCA": "set `nodes[].ibHcas`",
    "NCCL_IB_GID_INDEX": "set `nodes[].gidIndex` (`auto` resolves it per node)",
    "VLLM_API_KEY": "set `serve.apiKey` as a secret",
}

# The launcher's rule for --long-prefill-token-threshold: a chunk keeps this many tokens of the
# batch for other requests, so a short chat is not stuck behind a long prefill.
LONG_PREFILL_HEADROOM_TOKENS = 256

_PLACEHOLDER = re.compile(r"^\s*$|^<.*>$|^CHANGE[-_ ]?ME$", re.IGNORECASE)
# A hostname (RFC 1123 labels) or an IP literal; never `user@host` or `host:port`.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
# A login name as useradd accepts it; a leading '-' would parse as an ssh option.
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
# An RDMA device name as the kernel prints it (/sys/class/infiniband/<name>).
_HCA_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A Hub repo id: owner/name.
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# A Hub revision: a branch, tag or commit (git ref characters, no whitespace or control characters).
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]{0,254}")
# A docker image reference: [registry[:port]/]path[:tag][@digest], lowercase path components.
_IMAGE = re.compile(
    r"([A-Za-z0-9.-]+(:[0-9]+)?/)?[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?"
)
# Roots that are not a dedicated directory: exporting one would share a whole home or filesystem.
_SYSTEM_DIRS = {
    "/",
    "/home",
    "/root",
    "/etc",
    "/usr",
    "/var",
    "/tmp",
    "/var/tmp",
    "/opt",
    "/srv",
    "/mnt",
    "/media",
    "/data",
    "/boot",
    "/dev",
    "/proc",
    "/sys",
    "/run",
    "/bin",
    "/sbin",
    "/lib",
}


class ConfigError(ValueError):
    """All configuration problems found, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in stack config (namespace `{NAMESPACE}`):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


class _Model(BaseModel):
    # to_camel turns `_gib` into `Gib`: a key spelled `GiB` carries an explicit alias instead.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _not_placeholder(value: str) -> str:
    if _PLACEHOLDER.match(value):
        raise ValueError("is empty or a placeholder: fill in the real value")
    return value


class Node(_Model):
    """One Spark. The first entry of `nodes` is the head (rank 0)."""

    name: str
    host: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str
    fabric_ip: str
    fabric_interface: str = "enp1s0f1np1"
    ib_hcas: list[str] = Field(default_factory=lambda: ["rocep1s0f1"])
    gid_index: int | Literal["auto"] = "auto"
    gpus: str = "all"
    rdma_devices: list[str] = Field(default_factory=lambda: ["/dev/infiniband"])

    _check_text = field_validator("name", "host", "user", "fabric_ip")(_not_placeholder)

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", v):
            raise ValueError("must be lowercase letters, digits and '-' (it names containers and resources)")
        return v

    @field_validator("host")
    @classmethod
    def _host_only(cls, v: str) -> str:
        if "@" in v:
            raise ValueError("must be the host alone: put the login name in `user` (nodes[].user)")
        if v.count(":") == 1:
            raise ValueError("must be the host alone: put the SSH port in `port` (nodes[].port)")
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        if not _HOSTNAME.fullmatch(v):
            raise ValueError("must be a hostname or an IP address (letters, digits, '-' and '.')")
        return v

    @field_validator("user")
    @classmethod
    def _login_name(cls, v: str) -> str:
        if not _USER.fullmatch(v):
            raise ValueError("must be a login name (letters, digits, '_', '.', '-'; not starting with '-')")
        return v

    @field_validator("fabric_ip")
    @classmethod
    def _ipv4(cls, v: str) -> str:
        try:
            ipaddress.IPv4Address(v)
        except ValueError:
            raise ValueError("must be the node's ConnectX-7 IPv4 address, e.g. 192.168.100.1") from None
        return v

    @field_validator("ib_hcas")
    @classmethod
    def _hca_names(cls, v: list[str]) -> list[str]:
        # The preflight writes the names into a shell script and a sysfs path.
        bad = [h for h in v if not _HCA_NAME.fullmatch(h)]
        if bad:
            raise ValueError(
                f"{json.dumps(bad)} is not an RDMA device name: use names as "
                '`ls /sys/class/infiniband` lists them, e.g. ["rocep1s0f1"]'
            )
        return v

    @field_validator("gid_index")
    @classmethod
    def _gid_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= 255:
            raise ValueError("must be `auto` or an index 0-255 from /sys/class/infiniband/<hca>/ports/1/gids")
        return v


class Ssh(_Model):
    private_key: SecretStr | None = None
    agent_socket: str | None = None
    # Default: the operator's ~/.ssh/known_hosts (new hosts are accepted once, then pinned).
    known_hosts_file: str | None = None

    @field_validator("private_key")
    @classmethod
    def _key_text(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and "PRIVATE KEY-----" not in v.get_secret_value():
            raise ValueError(
                "is not a private key's text (a path?): give the key itself, "
                "`pulumi config set --secret --path ssh.privateKey < ~/.ssh/id_ed25519`"
            )
        return v

    @field_validator("agent_socket", "known_hosts_file")
    @classmethod
    def _expanded_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if "$" in v:
            raise ValueError(
                "holds an unexpanded variable: Pulumi stores the text as given; set the value a shell "
                'expanded, e.g. `pulumi config set --path ssh.agentSocket "$SSH_AUTH_SOCK"`'
            )
        if not (v.startswith("/") or v.startswith("~/")):
            raise ValueError("must be an absolute path on this machine (or start with ~/)")
        return v


class Weights(_Model):
    root: str = "~/dsv41-exl3"
    # nfs: workers read the head's read-only export; bind: every node sees the head's filesystem; copy: each
    # worker keeps its own verified copy under copyRoot, filled from the head once and kept.
    share: Literal["nfs", "bind", "copy"] = "nfs"
    # share: copy. Each worker's own root; `{node}` is the node's name (nodes that share one filesystem). None:
    # the same path as `root`, on each worker's own disk.
    copy_root: str | None = None
    copy_streams: int = Field(default=4, ge=1, le=64)
    hf_token: SecretStr | None = None
    hf_endpoint: str | None = None
    model_repo: str = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"
    engram_repo: str = "deepseek-ai/DeepSeek-V4.1-Flash"
    revision: str = "main"
    stage_timeout_minutes: int = Field(default=720, ge=1)

    @field_validator("root", "copy_root")
    @classmethod
    def _dedicated_root(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = v.replace("{node}", "node").rstrip("/") or "/"
        if path.startswith("~") and not (path == "~" or path.startswith("~/")):
            raise ValueError("must be an absolute path or start with `~/` (`~user` is not expanded)")
        if not (path.startswith("/") or path.startswith("~")):
            raise ValueError(
                "must be an absolute path or start with `~/`; a relative path depends on the "
                "login directory, e.g. use `~/dsv41-exl3`"
            )
        parts = path.split("/")
        if path == "~" or path in _SYSTEM_DIRS or (len(parts) == 3 and parts[1] == "home"):
            raise ValueError(
                "must be a directory of its own, e.g. `~/dsv41-exl3`: it is exported to the "
                "workers, so a home directory or a system directory would share all of it"
            )
        if ":" in path or "," in path:
            raise ValueError(
                "must not contain `:` or `,`: the root is bind-mounted into the staging, source and copy "
                "containers (`docker run -v <root>:/weights`), and docker's volume syntax splits at "
                "them; use a path without them, e.g. `~/dsv41-exl3`"
            )
        if any(p in {"", ".", ".."} for p in parts[1:]) or any(c.isspace() or c in "'\"\\$`" for c in path):
            raise ValueError("must be a plain path: no `.`/`..`/empty components, spaces, quotes or `$`")
        return v

    @field_validator("hf_token")
    @classmethod
    def _one_line_token(cls, v: SecretStr | None) -> SecretStr | None:
        # The staging command reads the token as the first line of its stdin.
        if v is not None and any(c in v.get_secret_value() for c in "\r\n"):
            raise ValueError(
                "contains a line break: set the token alone, e.g. "
                "`pulumi config set --secret --path weights.hfToken hf_...` (not `< file` with a newline)"
            )
        return v

    @field_validator("hf_endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError("must be an http(s) URL with its scheme, e.g. `https://huggingface.co`")
        return v

    @field_validator("model_repo", "engram_repo")
    @classmethod
    def _repo_id(cls, v: str) -> str:
        if not _REPO.fullmatch(v):
            hint = " (not a URL)" if "://" in v or v.startswith("huggingface.co") else ""
            raise ValueError(
                f"must be a Hub repo id `owner/name`{hint}, e.g. `Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw`"
            )
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not _REVISION.fullmatch(v) or ".." in v:
            raise ValueError("must be a branch, tag or commit hash (no spaces, newlines or `..`), e.g. `main`")
        return v


class Serve(_Model):
    served_model_name: str = RECIPE_SERVED_NAME
    port: int = Field(default=8888, ge=1, le=65535)
    master_port: int = Field(default=29521, ge=1, le=65535)
    max_model_len: int = Field(default=600_000, ge=1024)
    max_num_seqs: int = Field(default=2, ge=1)
    max_num_batched_tokens: int = Field(default=1536, ge=1)
    kv_cache_memory_bytes: int = Field(default=2_684_354_560, ge=1)
    gpu_memory_utilization: float = Field(default=0.88, gt=0, le=1)
    enforce_eager: bool = False
    # The recipe image's patched vLLM knows these; another image (the sim's vLLM for CPUs) may not. Empty: the
    # flag is left out and vLLM's own default applies.
    quantization: str = "exl3"
    tokenizer_mode: str = "deepseek_v41"
    tool_call_parser: str = "deepseek_v41"
    reasoning_parser: str = "deepseek_v41"
    num_speculative_tokens: int = Field(default=3, ge=0)
    # None: maxNumBatchedTokens - 256 (the launcher's rule; 1280 with 1536).
    long_prefill_token_threshold: int | None = Field(default=None, ge=1)
    # Without it vLLM answers HTTP 400 to every request that carries `tools`.
    enable_auto_tool_choice: bool = True
    # Baked into the recipe image; empty: vLLM's template from the checkpoint.
    chat_template: str = "/opt/dsv41/chat_template.jinja"
    # The Engram row store's cache and pinned scales are anonymous host RAM = GPU memory on GB10.
    engram_cache_gib: float = Field(default=0, ge=0, alias="engramCacheGiB")
    engram_resident_scales: bool = False
    # Rows per expert the fused EXL3 MoE kernel takes; above it the grouped prefill kernels run.
    exl3_temp_rows_fused: int = Field(default=16, ge=1)
    pytorch_cuda_alloc_conf: str = "expandable_segments:True"
    extra_args: list[str] = Field(default_factory=list)
    extra_env: dict[str, str] = Field(default_factory=dict)
    api_key: SecretStr | None = None

    @field_validator("served_model_name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        if not v.strip() or v != v.strip() or any(c.isspace() for c in v):
            raise ValueError("must be a non-empty name without spaces (clients send it as `model`)")
        return v

    @field_validator("extra_env", mode="before")
    @classmethod
    def _env_values_as_text(cls, v: Any) -> Any:
        # YAML reads `X: 1` as a number; an environment variable is text either way.
        if isinstance(v, Mapping):
            return {
                k: json.dumps(x) if isinstance(x, bool | int | float) and not isinstance(x, str) else x
                for k, x in v.items()
            }
        return v


class Preflight(_Model):
    # Not finite (`Infinity` decodes from the stack file) would make a check no node can pass.
    min_mem_available_gib: float = Field(default=111.5, ge=0, allow_inf_nan=False, alias="minMemAvailableGiB")
    # Checked on the head only, at the weights root: free disk plus what is already staged there.
    min_free_disk_gib: float = Field(default=387, ge=0, allow_inf_nan=False, alias="minFreeDiskGiB")


class Watchdog(_Model):
    enabled: bool = True
    # Below the observed low-water of a healthy head (~2.1 GiB at the end of a 601k prefill,
    # ~4 GiB in normal serving); the launcher arms its own guard at 1.5 GiB.
    mem_available_floor_gib: float = Field(default=1.5, gt=0, alias="memAvailableFloorGiB")
    # As the launcher's guard: a sample a second, act on the second low one (a host short of unified memory
    # wedges in seconds), and the watchdog kills rather than waits out a stop grace.
    sample_seconds: int = Field(default=1, ge=1)
    consecutive_samples: int = Field(default=2, ge=1)


class Container(_Model):
    """Limits of every rank's container. The defaults are the recipe launcher's `docker run`."""

    # RLIMIT_MEMLOCK in bytes; -1 is unlimited, which NCCL's RDMA memory registration needs on hardware.
    # A host whose hard limit is lower (a sandbox, a locked-down daemon) sets it here; docker refuses more.
    memlock_bytes: int = Field(default=-1, ge=-1)
    # The recipe's --ipc=host. vLLM decides which ranks share a node by opening a shared-memory segment another
    # rank made; containers that share one kernel's /dev/shm but not /tmp (the simulated nodes) then wait
    # forever on each other's zmq ipc:// sockets, so the sim gives each rank its own IPC namespace.
    ipc_mode: Literal["host", "private", "shareable"] = "host"


class Gates(_Model):
    # Longer than torch's ~600 s store timeout, so vLLM's own DistStoreError usually arrives first.
    rendezvous_timeout_seconds: int = Field(default=720, ge=1)
    # A first boot after an NCCL topology change can spend ~36 min in JIT.
    ready_timeout_seconds: int = Field(default=2700, ge=1)
    # The recipe's launcher calls a hang after 420 s of log silence; weight streaming over NFS is quieter (a real
    # headless worker prints nothing while it loads), so the ready gate counts its containers' memory and block I/O
    # growth as progress too (components/gates/decisions.py, the stall rule).
    stall_seconds: int = Field(default=600, ge=1)
    verify_timeout_seconds: int = Field(default=300, ge=1)
    min_decode_tokens_per_second: float | None = Field(default=None, gt=0)
    # The word the answer to the recipe's question must hold (any case, as a whole word). Empty: any answer
    # with real logprobs passes, for a model that cannot know it (the sim's random-weight model).
    expected_answer: str = "Paris"

    @field_validator("expected_answer")
    @classmethod
    def _one_line_answer(cls, v: str) -> str:
        if v != v.strip() or any(c in v for c in "\r\n\0"):
            raise ValueError(
                "must be one word or phrase on one line, without surrounding spaces "
                "(the recipe's is `Paris`; empty to judge the logprobs alone)"
            )
        return v


class Supervisor(_Model):
    """The head's supervisor: heals a dead group between `pulumi up` runs (components/supervisor/)."""

    enabled: bool = True
    # Each node's agent listens here on its fabric address (token-protected); not serve.port or masterPort.
    port: int = Field(default=18391, ge=1024, le=65535)
    probe_seconds: int = Field(default=60, ge=5, le=3600)
    max_restarts: int = Field(default=3, ge=1, le=100)
    window_hours: float = Field(default=6, gt=0, le=168)
    # Doubles per restart already in the window: 30 s, 60 s, 120 s...
    backoff_seconds: int = Field(default=30, ge=0, le=3600)
    # After the ranks stop: how long MemAvailable may take to come back over preflight.minMemAvailableGiB.
    mem_wait_seconds: int = Field(default=300, ge=10, le=3600)
    # Run on the head (in the supervisor's container, `sh -c`) with the event as JSON on stdin; "" = none.
    notify_command: str = ""

    @field_validator("notify_command")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if any(c in v for c in "\r\n\0"):
            raise ValueError(
                "must be one shell command line (it is run as `sh -c`), e.g. "
                "`curl -fsS -d @- https://ntfy.example/spark`"
            )
        try:
            shlex.split(v)
        except ValueError as error:
            raise ValueError(f"is not a shell command line ({error}); check its quotes") from None
        return v


class Settings(_Model):
    nodes: list[Node]
    ssh: Ssh = Ssh()
    weights: Weights = Weights()
    image: str = RECIPE_IMAGE
    image_pull_timeout_minutes: int = Field(default=90, ge=1)
    serve: Serve = Serve()
    preflight: Preflight = Preflight()
    watchdog: Watchdog = Watchdog()
    container: Container = Container()
    gates: Gates = Gates()
    supervisor: Supervisor = Supervisor()

    @field_validator("image")
    @classmethod
    def _image_reference(cls, v: str) -> str:
        _not_placeholder(v)
        if v != v.strip():
            raise ValueError("has leading or trailing whitespace: docker would look for another image")
        if not _IMAGE.fullmatch(v):
            raise ValueError(
                "must be a docker image reference, e.g. `registry:5000/name:tag` (lowercase "
                f"name), like the recipe's `{RECIPE_IMAGE}`"
            )
        return v

    def copy_root_of(self, node: Node) -> str:
        """`weights.copyRoot` on `node` (`{node}` resolved); `weights.root` when unset."""
        return (self.weights.copy_root or self.weights.root).replace("{node}", node.name)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    @property
    def tensor_parallel_size(self) -> int:
        # One GB10 GPU per Spark: one rank per node.
        return len(self.nodes)


class Loaded(BaseModel):
    """Settings plus the warnings worth showing (not errors)."""

    settings: Settings
    warnings: list[str]


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _lookup(raw: Mapping[str, Any], loc: tuple[int | str, ...]) -> Any:
    cur: Any = raw
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _credential_texts(raw: Mapping[str, Any], secret_tops: frozenset[str]) -> list[str]:
    """Every string stored under a secret key or a key stored encrypted: none may be echoed in an error."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.extend(x for x in (value, json.dumps(value)[1:-1]) if len(x) >= 4)
        elif isinstance(value, Mapping):
            for x in value.values():
                walk(x)
        elif isinstance(value, list):
            for x in value:
                walk(x)

    for top in secret_tops:
        walk(raw.get(top))
    for secret in SECRET_KEYS:
        top, leaf = secret.split(".")
        section = raw.get(top)
        walk(section.get(leaf) if isinstance(section, Mapping) else section)
    return found


def _show(value: Any, key: str, hidden: list[str]) -> str:
    # A credential's key, or a section that holds one given whole (`pulumi config set --secret ssh < key`).
    if any(key == k or k.startswith(key + ".") or key.endswith("." + k.split(".")[-1]) for k in SECRET_KEYS):
        return "[secret]"
    if value is None:
        return "(missing)"
    text = json.dumps(value)
    # Masking by containment, not equality: a key nested in a list or JSON-escaped is still the key.
    if any(h in text for h in hidden) or "PRIVATE KEY" in text:
        return "[secret]"
    return text


def _pydantic_problems(err: ValidationError, raw: Mapping[str, Any], hidden: list[str]) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        # Union errors repeat the location with the member type appended; keep the key path only.
        loc = tuple(p for p in loc if not (isinstance(p, str) and p in {"int", "literal['auto']"}))
        key = _loc(loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "is required"
        elif e["type"] == "extra_forbidden":
            msg = "is not a known key: check the spelling against the README's configuration table"
        problems.append(f"`{key}` = {_show(_lookup(raw, loc), key, hidden)}: {msg}")
    # A union reports each member; one line per key is enough.
    return list(dict.fromkeys(problems))


def canonical_flag(arg: str) -> str | None:
    """The option vLLM's parser reads from one argv element, or None for a value.

    vLLM's FlexibleArgumentParser turns `--max_model_len` into `--max-model-len` and reads
    `--speculative-config.method=x` as part of `--speculative-config`; BooleanOptionalAction flags also
    accept `--no-<flag>`; one-dash aliases take their value attached or are abbreviated (VLLM_SHORT_OPTIONS).
    """
    if arg.startswith("--"):
        name = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if name.startswith("--no-") and "--" + name[5:] in NEGATABLE_FLAGS:
            return "--" + name[5:]
        return name
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
        return _one_dash_option(arg)
    return None


def _one_dash_option(arg: str) -> str:
    """The long option argparse reads a one-dash argument as (see VLLM_SHORT_OPTIONS)."""
    if arg.startswith("-O"):
        return "--optimization-level"
    name = arg.split("=", 1)[0]
    if name in VLLM_SHORT_OPTIONS:
        return VLLM_SHORT_OPTIONS[name]
    read = {VLLM_SHORT_OPTIONS[arg[:2]]} if arg[:2] in VLLM_SHORT_OPTIONS else set()
    read |= {long for short, long in VLLM_SHORT_OPTIONS.items() if short.startswith(name)}
    if len(read) == 1:
        return read.pop()
    if read:  # ambiguous (`-d`, `-p`): argparse refuses it, and vLLM with it
        return name
    # A value attached to a longer alias (`-tp4`): argparse refuses that too, but it is meant for that alias.
    meant = [short for short in VLLM_SHORT_OPTIONS if arg.startswith(short)]
    return VLLM_SHORT_OPTIONS[max(meant, key=len)] if meant else name


def _abbreviates(name: str) -> str | None:
    """The owned flag a strict prefix stands for (argparse's allow_abbrev), if any."""
    matches = sorted(f for f in OWNED_FLAGS if f.startswith(name) and f != name and len(name) > 3)
    return matches[0] if matches else None


def _rules(s: Settings) -> tuple[list[str], list[str]]:
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
        elif name is not None and (name in OWNED_FLAGS or name.startswith(_DATA_PARALLEL)):
            spelled = "" if flag.split("=", 1)[0] == name else f" (vLLM reads it as {name})"
            why = OWNED_FLAGS.get(name, OWNED_FLAGS["--data-parallel-size"])
            problems.append(f"`serve.extraArgs` contains {flag!r}{spelled}: the program renders it; {why}.")
        elif name is not None and name.startswith("--") and (prefixed := _abbreviates(name)):
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

    if s.serve.port == s.serve.master_port:
        problems.append(
            f"`serve.masterPort` = {s.serve.master_port} equals `serve.port`: the rendezvous and the API need "
            "different ports"
        )
    if s.supervisor.enabled and s.supervisor.port in (s.serve.port, s.serve.master_port):
        problems.append(
            f"`supervisor.port` = {s.supervisor.port} is also `serve.port` or `serve.masterPort`: the supervisor's "
            "agents need a port of their own on every node; pick another (default 18391)"
        )

    problems += capacity.problems(
        tensor_parallel_size=s.tensor_parallel_size,
        max_model_len=s.serve.max_model_len,
        kv_cache_memory_bytes=s.serve.kv_cache_memory_bytes,
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
    if s.gates.ready_timeout_seconds < 36 * 60:
        warnings.append(
            f"`gates.readyTimeoutSeconds` = {s.gates.ready_timeout_seconds} is under 36 minutes: a first boot "
            "after an NCCL topology change can spend that long in JIT"
        )
    return problems, warnings


def parse(
    raw: Mapping[str, Any], *, plaintext_keys: frozenset[str] = frozenset(), secret_keys: frozenset[str] = frozenset()
) -> Loaded:
    """Validate raw stack config (the namespace's keys, already JSON-decoded).

    `plaintext_keys` lists top-level keys stored unencrypted; a credential under one is refused.
    `secret_keys` lists top-level keys stored encrypted; no error shows any text under them.
    """
    problems: list[str] = []
    hidden = _credential_texts(raw, secret_keys)
    for secret in sorted(SECRET_KEYS):
        top, leaf = secret.split(".")
        if top in plaintext_keys and isinstance(raw.get(top), Mapping) and raw[top].get(leaf):
            problems.append(
                f"`{secret}` is stored in plain text: store it encrypted with "
                f"`pulumi config set --secret --path {secret} ...`"
            )
    ssh = raw.get("ssh")
    if not isinstance(ssh, Mapping) or not (ssh.get("privateKey") or ssh.get("agentSocket")):
        problems.append(
            "`ssh` has neither `privateKey` nor `agentSocket`: set one, e.g. "
            "`pulumi config set --secret --path ssh.privateKey < ~/.ssh/id_ed25519`"
        )
    if "nodes" not in raw or not raw.get("nodes"):
        problems.append(
            "`nodes` = (missing): list every Spark, the head first, each with name, host, user and fabricIp "
            "(see Pulumi.dev.yaml)"
        )
        raw = {**raw, "nodes": []}
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as err:
        problems += _pydantic_problems(err, raw, hidden)
        raise ConfigError([redact(p, hidden, mask="[secret]") for p in problems]) from None
    if not settings.nodes:
        raise ConfigError(problems)
    rule_problems, warnings = _rules(settings)
    problems += rule_problems
    if problems:
        raise ConfigError([redact(p, hidden, mask="[secret]") for p in problems])
    return Loaded(settings=settings, warnings=warnings)


def read_raw(config: Mapping[str, Any]) -> dict[str, Any]:
    """The namespace's keys from the full config map (`ns:key` -> raw string), JSON-decoded.

    Every key of the namespace is kept, so a misspelt top-level key reaches validation
    and is reported instead of silently falling back to a default.
    """
    raw: dict[str, Any] = {}
    prefix = f"{NAMESPACE}:"
    for full_key, text in config.items():
        if not full_key.startswith(prefix):
            continue
        key = full_key[len(prefix) :]
        try:
            raw[key] = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError:
            raw[key] = text
    return raw


def from_stack() -> Loaded:
    """Read and validate this stack's config. Raises ConfigError before any resource exists."""
    from pulumi.runtime import config as runtime_config

    raw = read_raw({**(runtime_config.get_config_env() or {}), **runtime_config.CONFIG.get()})
    plaintext = frozenset(k for k in raw if not runtime_config.is_config_secret(f"{NAMESPACE}:{k}"))
    return parse(raw, plaintext_keys=plaintext, secret_keys=frozenset(raw) - plaintext)
