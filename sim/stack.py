"""The program's stack config for the running simulated cluster: one function for `make demo` and the tests.

Only config differs between the sim and hardware (never a code path): loopback nodes without GPU or RDMA,
`weights.share: bind` (every sim node sees the host's filesystem), the stand-in image from the loopback
registry, the hub stand-in, memory thresholds scaled to a 2-core, 24 GiB machine, and the container's
memlock limit at this host's hard limit (a sandbox refuses unlimited).

    python -m sim.stack init --stack sim     # create or select the stack and write its whole config
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

from sim import cluster

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "dsv41-exl3"
DEMO_WEIGHTS_ROOT = "/var/tmp/dsv41-exl3-sim-weights"


def read_sim() -> dict[str, Any]:
    path = cluster.default_layout().state / "sim.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: start the simulated cluster first (`make sim-up`)")
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def host_memlock_bytes() -> int:
    """The hard RLIMIT_MEMLOCK of this host: -1 when unlimited (as on a DGX Spark's docker)."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return -1 if hard == resource.RLIM_INFINITY else int(hard)


def sim_config(sim: dict[str, Any], *, weights_root: str, nodes: int | None = None, port: int = 8888,
               master_port: int = 29521, extra_env: dict[str, str] | None = None,
               copy_root: str | None = None) -> dict[str, Any]:
    """The namespace's keys (plain JSON values) for a stack on the running sim; ssh.privateKey is separate."""
    chosen = sim["nodes"][:nodes] if nodes else sim["nodes"]
    return {
        "nodes": [
            {"name": f"node-{n['index']}", "host": n["ip"], "port": sim["ssh"]["port"], "user": sim["ssh"]["user"],
             "fabricIp": n["ip"], "fabricInterface": "lo", "ibHcas": [], "gpus": "", "rdmaDevices": []}
            for n in chosen
        ],
        "ssh": {"knownHostsFile": sim["ssh"]["known_hosts"]},
        # copy_root: each worker keeps its own copy there (`{node}`: the sim's nodes share one filesystem).
        "weights": {"root": weights_root, "hfEndpoint": sim["hub"],
                    **({"share": "copy", "copyRoot": copy_root} if copy_root else {"share": "bind"})},
        "image": sim["image"],
        "imagePullTimeoutMinutes": 5,
        "serve": {
            "port": port,
            "masterPort": master_port,
            # The stand-in binds the API to the head's loopback address, as vLLM binds the head's host.
            "extraArgs": ["--host", chosen[0]["ip"]],
            "extraEnv": {"SIM_LOAD_SECONDS": "5", **(extra_env or {})},
        },
        "container": {"memlockBytes": host_memlock_bytes()},
        "preflight": {"minMemAvailableGiB": 1, "minFreeDiskGiB": 1},
        "watchdog": {"enabled": True, "memAvailableFloorGiB": 0.5},
        "gates": {"rendezvousTimeoutSeconds": 60, "readyTimeoutSeconds": 300, "stallSeconds": 30,
                  "verifyTimeoutSeconds": 60},
    }


def _paths(prefix: str, value: Any) -> dict[str, str]:
    """`--path` keys for a section: a map becomes one key per leaf (so a secret can sit beside plain leaves,
    as `pulumi config set --secret --path` puts it), a list of strings one key per item; anything else (the
    node list, with its empty lists) one JSON value."""
    out: dict[str, str] = {}
    if isinstance(value, dict) and value:
        for k, v in value.items():
            out.update(_paths(f"{prefix}.{k}", v))
        return out
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            out[f"{prefix}[{i}]"] = v
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def config_values(config: dict[str, Any], private_key: str) -> dict[str, Any]:
    """Automation API config values (set with path=True), the SSH key as a secret under `ssh.privateKey`."""
    from pulumi import automation as auto

    values = {k: auto.ConfigValue(v) for k, v in _paths(NAMESPACE, config).items()}
    values = {k.replace(f"{NAMESPACE}.", f"{NAMESPACE}:", 1): v for k, v in values.items()}
    values[f"{NAMESPACE}:ssh.privateKey"] = auto.ConfigValue(private_key, secret=True)
    return values


def init_stack(name: str, config: dict[str, Any], private_key: str, *, env: dict[str, str] | None = None,
               pulumi_root: Path | None = None) -> Any:
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
    args = parser.parse_args(argv)
    sim = read_sim()
    key = Path(sim["ssh"]["key"]).read_text()
    init_stack(args.stack, sim_config(sim, weights_root=args.weights_root), key)
    print(f"stack {args.stack}: config written for the simulated cluster ({len(sim['nodes'])} nodes)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
