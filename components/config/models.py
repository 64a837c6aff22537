"""The stack's keys: one pydantic model per section, each key declared once with `setting()`.

Pure logic: no resources. Every key is camelCase in the stack file (namespace `dsv41-exl3`). A field's
declaration holds its default, bounds, meaning, and the flag or environment variable it renders to; the rules
that span keys are in `rules.py`.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, field_validator
from pydantic.alias_generators import to_camel

from components import capacity
from components.config.declare import setting
from components.verify.verdict import VERIFY_EXPECTED

NAMESPACE = "dsv41-exl3"
# Every default image is pinned by digest (a tag moves; two nodes pulling it minutes apart can run two builds).
# The serving image: the recipe's tag at the digest the launcher's own runbooks pin as "the pinned recipe image"
# (MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks, docs/cooperative-moe-quickstart.md).
RECIPE_IMAGE = (
    "ghcr.io/miaai-lab/deepseek-v4.1-flash-exl3-2x-dgx-sparks:2.9bpw"
    "@sha256:2f0cf3adc0f989c1d446be274df864eb799630175f604c3b22b71b7205971dce"
)
# Prometheus 3.15.0 and node_exporter 1.12.1: their multi-arch index digests (arm64 among them), as pinned alike
# by unrelated public repositories; docs/development.md says how they were chosen and how to move them.
PROMETHEUS_IMAGE = "prom/prometheus:v3.15.0@sha256:efd719c99d83b060d9daefdcf00360461adf279f45ef5391f8d111892118753e"
NODE_EXPORTER_IMAGE = (
    "prom/node-exporter:v1.12.1@sha256:1b4e4438faca4dd7e001dd445d161a4a2091b0fededa84093b3a8dfeae1f1be0"
)
RECIPE_SERVED_NAME = "DeepSeek-v4.1-Flash-EXL3"

# The launcher's rule for --long-prefill-token-threshold: a chunk keeps this many tokens of the
# batch for other requests, so a short chat is not stuck behind a long prefill.
LONG_PREFILL_HEADROOM_TOKENS = 256

# No wait or timeout is longer than a day: one beyond it is a typo (minutes for seconds) that would leave a hung
# step holding the update, and the supervisor away, for days.
DAY_SECONDS = 86400
DAY_MINUTES = 1440

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


class _Model(BaseModel):
    # to_camel turns `_gib` into `Gib`: a key spelled `GiB` carries an explicit alias instead.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _not_placeholder(value: str) -> str:
    if _PLACEHOLDER.match(value):
        raise ValueError("is empty or a placeholder: fill in the real value")
    return value


class Node(_Model):
    """One Spark. The first entry of `nodes` is the head (rank 0)."""

    name: str = setting(meaning="lowercase name; names resources and containers")
    host: str = setting(
        meaning="SSH address the operator reaches: an IP address, or a name this machine resolves (refused when it "
        "does not resolve or resolves only to loopback). The head's address is what the endpoint, `prometheusUrl` "
        "and the supervisor's URL point at and where Prometheus and the head's agent listen; the head's preflight "
        "checks that it is the head's own (see [Addresses](#addresses))"
    )
    port: int = setting(22, "SSH port", ge=1, le=65535, kind="int")
    user: str = setting(meaning="SSH user (must be able to use docker)")
    fabric_ip: str = setting(
        meaning="CX-7 address: `VLLM_HOST_IP`, master address (head), NFS", env="VLLM_HOST_IP", kind="IPv4"
    )
    fabric_interface: str = setting(
        "enp1s0f1np1",
        "`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`",
        env=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    )
    ib_hcas: list[str] = setting(
        meaning="`NCCL_IB_HCA`; empty: no RDMA checks, variable left out",
        env="NCCL_IB_HCA",
        default_factory=lambda: ["rocep1s0f1"],
    )
    gid_index: int | Literal["auto"] = setting(
        "auto",
        "`auto`: resolved on the node from sysfs at deploy time; an int is checked",
        env="NCCL_IB_GID_INDEX",
        kind="`auto` or int",
        note="`auto` resolves it per node",
    )
    gpus: str = setting("all", "docker `--gpus`; empty for none")
    rdma_devices: list[str] = setting(
        meaning="devices passed to the container; empty disables RDMA checks",
        default_factory=lambda: ["/dev/infiniband"],
    )

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
    private_key: SecretStr | None = setting(None, "private key text (`privateKey` or `agentSocket` is required)")
    agent_socket: str | None = setting(None, "ssh-agent socket instead of a key", kind="path")
    # Default: the operator's ~/.ssh/known_hosts (new hosts are accepted once, then pinned).
    known_hosts_file: str | None = setting(
        None,
        "the one known_hosts file every connection checks: the program records a new node's key here on first "
        "use (also at preview) and refuses a changed one; the docker providers and gates read it with ssh (see "
        "[Host keys](#host-keys-and-key-files))",
        kind="path",
        shown="`~/.ssh/known_hosts`",
    )

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
    root: str = setting(
        "/srv/dsv41-exl3",
        "on the head; `model/`, `engram-src/` and the slim `engram-vllm/` built from it below it (`~` expands on "
        "the node). Outside the home by default: "
        "a stock Ubuntu home is 0750, which the workers' root-squashed NFS mount cannot traverse; the preflight "
        "creates it, or prints the one `sudo install -d` line that does. A directory of its own: "
        "config refuses `~`, `/`, `/home/<user>`, system directories, relative paths and a `:` or `,` (the root "
        "is bind-mounted with `docker run -v <root>:/weights`, which splits at them), and staging and the export "
        "refuse, on the node, a root that resolves to `/`, to the SSH user's home or to a path with `:` or `,`",
        kind="path",
    )
    # nfs: workers read the head's read-only export; bind: every node sees the head's filesystem; copy: each
    # worker keeps its own verified copy under copyRoot, filled from the head once and kept.
    share: Literal["nfs", "bind", "copy"] = setting(
        "nfs",
        "`nfs`: read-only export to the workers' fabric IPs + docker NFS volumes; `bind`: nodes share one "
        "filesystem; `copy`: each worker keeps its own verified copy under `weights.copyRoot`, filled from the "
        "head once and kept (see [Copy mode](docs/checks.md#copy-mode-each-worker-loads-its-own-copy))",
    )
    # share: copy. Each worker's own root; `{node}` is the node's name (nodes that share one filesystem). None:
    # the same path as `root`, on each worker's own disk.
    copy_root: str | None = setting(
        None,
        "`share: copy`: the copy root on each worker (on its own disk). `{node}` is replaced by the node's name, "
        "for workers that share a filesystem (two workers given one directory are refused); same rules as "
        "`weights.root`",
        kind="path",
        shown="`weights.root`",
    )
    copy_streams: int = setting(4, "`share: copy`: files copied at once to each worker", ge=1, le=64)
    download_streams: int = setting(
        8,
        "files staging downloads from the hub at once (the upstream launcher's downloader uses 8), each hashed "
        "as it is written; a stopped one resumes where it stopped on the next run. A progress line (bytes, "
        "rate, ETA) shows in the up's output every few seconds",
        ge=1,
        le=64,
    )
    hf_token: SecretStr | None = setting(
        None,
        "Hugging Face token, passed on stdin only, down to the staging program in its container (never "
        "`docker run -e`, which would keep it in the container's `Config.Env` for `docker inspect` to show)",
    )
    hf_endpoint: str | None = setting(None, "a hub mirror (`HF_ENDPOINT`)", kind="URL")
    model_repo: str = setting("Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw", "39 EXL3 shards into `model/`")
    engram_repo: str = setting(
        "deepseek-ai/DeepSeek-V4.1-Flash",
        "shards 47, 48, index, config into `engram-src/`; staging builds `engram-vllm/` beside it (hardlinks of the "
        "shards and config, an index of the `*.engram.embed.weight` / `.scale` tensors only), which every rank "
        "mounts at `/engram-src`, and refuses a repo whose index or shards hold no such tensors",
    )
    revision: str = setting("main", "the Hub branch, tag or commit of both repos")
    stage_timeout_minutes: int = setting(720, "bound on the staging command", ge=1, le=DAY_MINUTES)

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
                "login directory, e.g. use `/srv/dsv41-exl3`"
            )
        parts = path.split("/")
        if path == "~" or path in _SYSTEM_DIRS or (len(parts) == 3 and parts[1] == "home"):
            raise ValueError(
                "must be a directory of its own, e.g. `/srv/dsv41-exl3`: it is exported to the "
                "workers, so a home directory or a system directory would share all of it"
            )
        if ":" in path or "," in path:
            raise ValueError(
                "must not contain `:` or `,`: the root is bind-mounted into the staging, source and copy "
                "containers (`docker run -v <root>:/weights`), and docker's volume syntax splits at "
                "them; use a path without them, e.g. `/srv/dsv41-exl3`"
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


OPEN_ENDPOINT = "none"
"""The `serve.apiKey` value that serves without a key."""
MIN_API_KEY_CHARS = 32
"""A user's `serve.apiKey` shorter than this is refused (a generated one has 51)."""


class Serve(_Model):
    # The flags render in this order (components/serving/spec.py): a rank's argv is a container input, so
    # reordering these fields would replace every running rank on the next upgrade.
    # The recipe image's patched vLLM knows the names below; another image (the sim's vLLM for CPUs) may not.
    quantization: str = setting("exl3", "empty: the flag is left out", flag="--quantization")
    kv_cache_memory_bytes: int = setting(
        2_684_354_560,
        "must hold one `maxModelLen` request and leave the head ≥ 2.0 GiB prefill margin",
        ge=1,
        flag="--kv-cache-memory-bytes",
    )
    max_model_len: int = setting(
        600_000, "above 600000 refused on 2 nodes (1M needs TP=4)", ge=1024, flag="--max-model-len"
    )
    max_num_seqs: int = setting(2, "requests served at once", ge=1, flag="--max-num-seqs")
    max_num_batched_tokens: int = setting(
        1536, "tokens per engine step (the prefill chunk)", ge=1, flag="--max-num-batched-tokens"
    )
    long_prefill_token_threshold: int | None = setting(
        None,
        "refused unless maxNumBatchedTokens - it >= 256 (the launcher's rule: a short request is not stuck "
        "behind a long prefill)",
        ge=1,
        flag="--long-prefill-token-threshold",
        shown="maxNumBatchedTokens - 256 (`1280`)",
        note="derived from the batch size by default",
    )
    gpu_memory_utilization: float = setting(0.88, "", gt=0, le=1, flag="--gpu-memory-utilization")
    tokenizer_mode: str = setting("deepseek_v41", "empty: the flag is left out", flag="--tokenizer-mode")
    tool_call_parser: str = setting("deepseek_v41", "empty: the flag is left out", flag="--tool-call-parser")
    reasoning_parser: str = setting("deepseek_v41", "empty: the flag is left out", flag="--reasoning-parser")
    enable_auto_tool_choice: bool = setting(
        True,
        "with `--tool-call-parser`; without it vLLM answers HTTP 400 to any request with `tools`",
        flag="--enable-auto-tool-choice",
    )
    chat_template: str = setting(
        "/opt/dsv41/chat_template.jinja",
        "a path inside the image (baked into the recipe image); empty: the checkpoint's template",
        flag="--chat-template",
        kind="path",
    )
    served_model_name: str = setting(RECIPE_SERVED_NAME, "the `model` clients send", flag="--served-model-name")
    port: int = setting(8888, "API port on the head", ge=1, le=65535, flag="--port", kind="int")
    enforce_eager: bool = setting(
        False,
        "allowed with a warning: no CUDA graphs, no speculation, 11-13 tok/s",
        flag="--enforce-eager",
    )
    num_speculative_tokens: int = setting(3, "`0` turns speculative decoding off", ge=0, flag="--speculative-config")
    # Rendered per rank (`--master-port`, components/config/flags.py RANK_FLAGS), not with the shared flags.
    master_port: int = setting(29521, "rendezvous port on the head's fabric IP", ge=1, le=65535, kind="int")
    # The Engram row store's cache and pinned scales are anonymous host RAM = GPU memory on GB10.
    engram_cache_gib: float = setting(
        0,
        "the Engram row cache; above 0 warns (unified memory each rank loses)",
        ge=0,
        alias="engramCacheGiB",
        env="DSV41_CACHE_GIB",
    )
    engram_resident_scales: bool = setting(
        False, "pinned Engram scales, ~1.5 GiB per Engram layer; `true` warns", env="DSV41_RESIDENT_SCALES"
    )
    # Rows per expert the fused EXL3 MoE kernel takes; above it the grouped prefill kernels run.
    exl3_temp_rows_fused: int = setting(
        16, "below maxNumSeqs x (numSpeculativeTokens + 1) warns", ge=1, env="EXL3_TEMP_ROWS_FUSED"
    )
    pytorch_cuda_alloc_conf: str = setting(
        "expandable_segments:True",
        "without it long prefill fragments: 244 tok/s at 455k",
        env="PYTORCH_CUDA_ALLOC_CONF",
    )
    extra_args: list[str] = setting(
        meaning="appended to `vllm serve`; `--kv-cache-dtype` and flags the program owns are refused",
        default_factory=list,
    )
    extra_env: dict[str, str] = setting(
        meaning="added to every rank's env (overrides the launcher's values below); an empty value removes a "
        "variable; variables the program renders from keys are refused",
        default_factory=dict,
    )
    api_key: SecretStr | None = setting(
        None,
        "the key every request must carry. Unset: a random key made by the first `pulumi up` and kept in the "
        "stack's state (encrypted), stable across updates, exported as the secret output `apiKey`;"
        f" `{OPEN_ENDPOINT}`: serve without a key (warned at every preview). On the head, "
        "from a file, never argv or the container's env: the program writes it over ssh (on stdin) to "
        "`~/.local/state/<stack prefix>/api-key` on the head (0600), the rank mounts it read-only at "
        "`/run/dsv41-exl3/api-key` and its entrypoint exports it to vLLM's own process, so `docker inspect` shows "
        "the mount's path, not the key, and the head's env is plain (an update's diff shows each change). A new "
        "key replaces every rank. The HF token and the copy token reach their programs on stdin",
        env="VLLM_API_KEY",
        note="vLLM's own process gets it from the key file, never argv or the container's env",
        shown="(generated)",
    )

    @field_validator("api_key")
    @classmethod
    def _strong_key(cls, v: SecretStr | None) -> SecretStr | None:
        # Clients send it in a header: whitespace would be cut or refused on the way, and a short key is a guess.
        key = v.get_secret_value() if v is not None else None
        if key is None or key == OPEN_ENDPOINT:
            return v
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError(
                "contains whitespace or a control character (often a trailing newline from a file): set the key "
                "alone, e.g. `openssl rand -hex 24 | pulumi config set --secret --path serve.apiKey`"
            )
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(
                f"is {len(key)} characters, under {MIN_API_KEY_CHARS}: use a random key, e.g. `openssl rand -hex 24 "
                f"| pulumi config set --secret --path serve.apiKey`, or unset it for a generated one"
            )
        return v

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
    min_mem_available_gib: float = setting(
        111.5,
        "per node, after this stack's old containers are stopped",
        ge=0,
        allow_inf_nan=False,
        alias="minMemAvailableGiB",
    )
    # Checked on the head only, at the weights root: free disk plus what is already staged there.
    min_free_disk_gib: float = setting(
        387, "head: free disk plus what is already staged", ge=0, allow_inf_nan=False, alias="minFreeDiskGiB"
    )


class Watchdog(_Model):
    enabled: bool = setting(True, "the memory watchdog on every node")
    # Below the observed low-water of a healthy head (~2.1 GiB at the end of a 601k prefill,
    # ~4 GiB in normal serving); the launcher arms its own guard at 1.5 GiB.
    mem_available_floor_gib: float = setting(
        1.5,
        "below a healthy head's low-water (see [Memory watchdog]"
        "(docs/checks.md#the-layers-in-the-order-pulumi-up-runs-them))",
        gt=0,
        alias="memAvailableFloorGiB",
    )
    # As the launcher's guard: a sample a second, act on the second low one (a host short of unified memory
    # wedges in seconds), and the watchdog kills rather than waits out a stop grace.
    sample_seconds: int = setting(1, "as the upstream guard", ge=1, le=60)
    consecutive_samples: int = setting(
        2, "acts within about 2 s of the floor, with `docker kill` (no stop grace)", ge=1
    )


class Container(_Model):
    """Limits of every rank's container. The defaults are the recipe launcher's `docker run`."""

    # RLIMIT_MEMLOCK in bytes; -1 is unlimited, which NCCL's RDMA memory registration needs on hardware.
    # A host whose hard limit is lower (a sandbox, a locked-down daemon) sets it here; docker refuses more.
    memlock_bytes: int = setting(
        -1,
        "the rank containers' memlock limit; `-1` is unlimited (the launcher's `--ulimit memlock=-1`, which "
        "NCCL's RDMA registration needs); a host whose hard limit is lower says so here (the simulated "
        "cluster's sandbox allows 8 MiB)",
        ge=-1,
    )
    # The recipe's --ipc=host. vLLM decides which ranks share a node by opening a shared-memory segment another
    # rank made; containers that share one kernel's /dev/shm but not /tmp (the simulated nodes) then wait
    # forever on each other's zmq ipc:// sockets, so the sim gives each rank its own IPC namespace.
    ipc_mode: Literal["host", "private", "shareable"] = setting(
        "host",
        "the rank containers' IPC namespace; `host` is the recipe's `--ipc=host`. The simulated cluster's ranks "
        "share one kernel but not /tmp, so it gives each its own (`private`)",
    )


class Gates(_Model):
    # Longer than torch's ~600 s store timeout, so vLLM's own DistStoreError usually arrives first.
    rendezvous_timeout_seconds: int = setting(720, "longer than torch's ~600 s store timeout", ge=1, le=DAY_SECONDS)
    # A first boot after an NCCL topology change can spend ~36 min in JIT.
    ready_timeout_seconds: int = setting(
        2700,
        "45 min: a first boot after an NCCL topology change can take ~36. vLLM's own "
        "`VLLM_ENGINE_READY_TIMEOUT_S` is derived: rendezvousTimeoutSeconds + readyTimeoutSeconds + 300 (3720 s), "
        "so the gate is the bound that acts (changing either gate timeout therefore replaces the ranks)",
        ge=1,
        le=DAY_SECONDS,
    )
    # The recipe's launcher calls a hang after 420 s of log silence; weight streaming over NFS is quieter (a real
    # headless worker prints nothing while it loads), so the ready gate counts its containers' memory and block I/O
    # growth as progress too (components/gates/decisions.py, the stall rule).
    stall_seconds: int = setting(
        600,
        "no new log line from any rank, and no progress signal moving (each rank container's memory and block "
        "I/O; each node's NFS reads, fabric rx and MemAvailable: docs/checks.md), for this long fails the update",
        ge=1,
        le=DAY_SECONDS,
    )
    verify_timeout_seconds: int = setting(
        300,
        "the verifier's retry window and the bound of its warm-up request (the judged request: min(120, this))",
        ge=1,
        le=DAY_SECONDS,
    )
    min_decode_tokens_per_second: float | None = setting(
        None, "enables the decode probe; below it the update fails", gt=0, shown="(off)"
    )
    # The word the answer to the recipe's question must hold (any case, as a whole word). Empty: any answer
    # with real logprobs passes, for a model that cannot know it (the sim's random-weight model).
    expected_answer: str = setting(
        VERIFY_EXPECTED,
        "the word the verifier's answer must hold (any case, a whole word); empty: any answer with real "
        "logprobs passes",
    )

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

    enabled: bool = setting(
        True,
        "the [supervisor](docs/checks.md#between-updates-the-supervisor) heals a dead group between updates",
    )
    # Each node's agent listens here on its fabric address, the head's also on its address (token-protected); not
    # serve.port or masterPort.
    port: int = setting(
        18391,
        "each node's agent API on its `fabricIp` (the head's also on the head's address), bearer token; not "
        "`serve.port` or `serve.masterPort`",
        ge=1024,
        le=65535,
        kind="int",
    )
    probe_seconds: int = setting(60, "the endpoint probe's period; ranks are looked at every second", ge=5, le=3600)
    max_restarts: int = setting(
        3, "at most this many group restarts in `windowHours`, then it gives up and says why", ge=1, le=100
    )
    window_hours: float = setting(6, "the window `maxRestarts` counts in", gt=0, le=168)
    # Doubles per restart already in the window: 30 s, 60 s, 120 s...
    backoff_seconds: int = setting(
        30, "before each further restart in the window, doubled per restart already in it", ge=0, le=3600
    )
    # After the ranks stop: how long MemAvailable may take to come back over preflight.minMemAvailableGiB.
    mem_wait_seconds: int = setting(
        300,
        "after stopping the ranks, how long MemAvailable may take to reach `preflight.minMemAvailableGiB` on "
        "every node",
        ge=10,
        le=3600,
    )
    # Run on the head (in the supervisor's container, `sh -c`) with the event as JSON on stdin; "" = none.
    notify_command: str = setting(
        "",
        "one shell line run on the head (in the supervisor's container, `sh -c`) with each event as JSON on "
        "stdin: `armed`, `restarting`, `restarted`, `restart-failed`, `gave-up`, `paused`, `resumed`",
    )

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


class Observability(_Model):
    """Prometheus on the head, the program's exporter on every node, alert rules (components/observability/)."""

    # None: on exactly when the supervisor is (its agents are what the exporter reads).
    enabled: bool | None = setting(
        None,
        "a Prometheus on the head scraping vLLM's `/metrics`, the program's exporter on every node and the node "
        "exporters, with the alert rules of `components/observability/rules.yml`; needs the supervisor",
        shown="`supervisor.enabled`",
    )
    prometheus_image: str = setting(
        PROMETHEUS_IMAGE,
        "the Prometheus server's image, pulled on the head (the simulated cluster builds one from Debian's "
        "`prometheus` package)",
    )
    node_exporter_image: str = setting(
        NODE_EXPORTER_IMAGE,
        "the node exporter's image, pulled on every node; empty: no node exporter",
    )
    port: int = setting(18390, "Prometheus' port on the head's address (`prometheusUrl`)", ge=1024, le=65535)
    exporter_port: int = setting(
        18392, "the program's exporter on each node's `fabricIp`, scraped by the head", ge=1024, le=65535
    )
    node_exporter_port: int = setting(18393, "the node exporter on each node's `fabricIp`", ge=1024, le=65535)
    scrape_seconds: int = setting(15, "Prometheus' scrape and rule evaluation interval", ge=5, le=300)
    retention_hours: int = setting(
        168, "`--storage.tsdb.retention.time`: how long samples are kept on the head", ge=1, le=8760
    )
    retention_mib: int = setting(
        1024,
        "`--storage.tsdb.retention.size`: the samples' bound on the head's disk",
        ge=64,
        le=1048576,
        alias="retentionMiB",
    )
    # Paid from the head's prefill margin with the exporters (components/capacity.py): at the recipe's KV pool
    # the margin leaves ~100 MiB for the whole layer. Go's soft limit (GOMEMLIMIT) keeps Prometheus under it.
    memory_mib: int = setting(
        60,
        "the Prometheus container's memory limit (`--memory`, no swap; `GOMEMLIMIT` at 80%); counted with the "
        "exporters' bounds against the head's prefill margin",
        ge=48,
        le=8192,
        alias="memoryMiB",
    )
    keep_data: bool = setting(
        False, "`destroy` keeps Prometheus' data volume (`<stack prefix>-prometheus-data`) instead of removing it"
    )

    @field_validator("prometheus_image", "node_exporter_image")
    @classmethod
    def _image(cls, v: str) -> str:
        if v and not _IMAGE.fullmatch(v):
            raise ValueError(f"must be a docker image reference, e.g. `{PROMETHEUS_IMAGE}`")
        return v


class Settings(_Model):
    nodes: list[Node] = setting(
        meaning="the Sparks; the first is the head (rank 0). Node count = tensor-parallel size: 2, 4 or 8"
    )
    ssh: Ssh = Ssh()
    weights: Weights = Weights()
    image: str = setting(RECIPE_IMAGE, "the serving image, pulled on every node")
    image_pull_timeout_minutes: int = setting(90, "create timeout of each node's pull (22.5 GiB)", ge=1, le=DAY_MINUTES)
    serve: Serve = Serve()
    preflight: Preflight = Preflight()
    watchdog: Watchdog = Watchdog()
    container: Container = Container()
    gates: Gates = Gates()
    supervisor: Supervisor = Supervisor()
    observability: Observability = Observability()

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
    def open_endpoint(self) -> bool:
        """`serve.apiKey: none`: the endpoint serves without a key (unset is a generated key, never open)."""
        key = self.serve.api_key
        return key is not None and key.get_secret_value() == OPEN_ENDPOINT

    @property
    def observing(self) -> bool:
        """Whether the observability layer is deployed: `observability.enabled`, by default `supervisor.enabled`."""
        enabled = self.observability.enabled
        return self.supervisor.enabled if enabled is None else enabled and self.supervisor.enabled

    @property
    def tensor_parallel_size(self) -> int:
        # One GB10 GPU per Spark: one rank per node.
        return len(self.nodes)

    @property
    def observability_head_gib(self) -> float:
        """What the observability layer's containers may take on the head, by their memory bounds (0 when the layer
        is not deployed). They start after the ranks loaded, so a rank's start must leave room for them."""
        if not self.observing:
            return 0.0
        return (
            capacity.observability_head_mib(self.observability.memory_mib, bool(self.observability.node_exporter_image))
            / 1024
        )

    def min_mem_available_gib_of(self, node: Node) -> float:
        """The MemAvailable `node` needs before its rank starts: `preflight.minMemAvailableGiB`, plus on the head the
        observability layer's bounds (counted again when its containers already run: ~0.1 GiB, on the safe side).
        The preflight and the supervisor's restart check this figure; a rank's own start checks the key alone (a
        rank's container spec must not depend on the observability layer)."""
        extra = self.observability_head_gib if node.name == self.head.name else 0.0
        return self.preflight.min_mem_available_gib + extra
