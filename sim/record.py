"""Record what real vLLM does on the simulated cluster, as fixtures the stand-in is held to.

    make record-real            # python -m sim.record [--out tests/support/fixtures/real-vllm]

Deploys one real-vLLM stack with the real program (TP=2 over sim nodes 1-2, the head serving, the worker
`--headless`) and records, into `--out`:

- `boot/`: each rank's argv (docker inspect), environment names (values stay out: they may be secrets) and
  its whole log from start to ready, both streams merged by docker's timestamps;
- `http/`: bodies of a plain and a streamed completion with logprobs and of the error answers the program
  reads (unknown model, a bad field, too many tokens, an unknown path, tools without a parser);
- `metrics/`: `/metrics` idle and after one completion;
- `killed-worker/` (`-streamed/`: the first request after the kill streamed), `stopped-worker/`,
  `stopped-head/`, `killed-head/`: what each rank does, says and exits with when a worker is killed (SIGKILL)
  or stopped (SIGTERM, as the watchdog and `docker stop` do), and the same for the head; `/health` and a
  request's answer after the kill, with the seconds each took.

Each scenario is healed by `pulumi up` before the next; the stack is destroyed at the end (the weights stay).
`tests/sim/test_standin_conformance.py` holds the stand-in to these files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from components.operator import rank_log
from sim.deploy import REPO, Deployment, Tool, docker_on, remove_deployment, tool_deployment

DEFAULT_OUT = REPO / "tests" / "support" / "fixtures" / "real-vllm"
PORT, MASTER_PORT = 18877, 29641

TOOL = Tool("sim.record", "run through `make record-real`", scratch="record", stack="record", passphrase="record-only")


def merged_log(d: Deployment, node: dict[str, Any], since: str | None = None) -> list[tuple[float, str]]:
    """The rank's stdout and stderr in one list ordered by docker's timestamps: (epoch seconds, line)."""
    args = ["logs", "--timestamps", *(["--since", since] if since else []), d.container(node)]
    proc = docker_on(node["index"], *args)
    return rank_log.merged_lines(proc.stdout + proc.stderr)


def write_log(path: Path, lines: list[tuple[float, str]], origin: float) -> None:
    """JSON lines: {"t": seconds since `origin`, "text": the line as the rank printed it} (operator/rank_log.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rank_log.as_jsonl(lines, origin))


def inspect(d: Deployment, node: dict[str, Any]) -> dict[str, Any]:
    proc = docker_on(node["index"], "inspect", d.container(node))
    info: dict[str, Any] = json.loads(proc.stdout)[0]
    return info


def state(d: Deployment, node: dict[str, Any]) -> dict[str, Any]:
    s = inspect(d, node)["State"]
    return {
        "running": s["Running"],
        "exitCode": s["ExitCode"],
        "oomKilled": s["OOMKilled"],
        "startedAt": s["StartedAt"],
        "finishedAt": s["FinishedAt"],
    }


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def answer(resp: requests.Response, elapsed: float) -> dict[str, Any]:
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    return {
        "status": resp.status_code,
        "contentType": resp.headers.get("content-type", ""),
        "seconds": round(elapsed, 3),
        "body": body,
    }


def call(method: str, url: str, **kw: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        resp = requests.request(method, url, timeout=kw.pop("timeout", 60), **kw)
    except requests.RequestException as err:
        return {"error": type(err).__name__, "seconds": round(time.monotonic() - start, 3)}
    return answer(resp, time.monotonic() - start)


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion: status and every `data:` event as sent."""
    start = time.monotonic()
    try:
        with requests.post(url, json={**body, "stream": True}, stream=True, timeout=60) as resp:
            events = [line.decode() for line in resp.iter_lines() if line]
            return {
                "status": resp.status_code,
                "contentType": resp.headers.get("content-type", ""),
                "seconds": round(time.monotonic() - start, 3),
                "events": events,
            }
    except requests.RequestException as err:
        return {"error": type(err).__name__, "seconds": round(time.monotonic() - start, 3)}


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **extra,
    }


def wait_exit(d: Deployment, node: dict[str, Any], seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = state(d, node)
        if not s["running"]:
            return s
        time.sleep(0.5)
    return state(d, node)


def record_boot(d: Deployment, out: Path) -> float:
    head, worker = d.sim["nodes"][0], d.sim["nodes"][1]
    for role, node in (("head", head), ("worker", worker)):
        info = inspect(d, node)
        write_json(out / "boot" / f"{role}.argv.json", rank_log.argv_record(info))
    started = min(rank_log.docker_time(inspect(d, n)["State"]["StartedAt"]) for n in (head, worker))
    for role, node in (("head", head), ("worker", worker)):
        write_log(out / "boot" / f"{role}.log.jsonl", merged_log(d, node), started)
    return started


def record_http(d: Deployment, url: str, model: str, out: Path) -> None:
    base = url.removesuffix("/v1")
    write_json(out / "http" / "models.json", call("GET", f"{url}/models"))
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    (out / "metrics" / "idle.txt").write_text(requests.get(f"{base}/metrics", timeout=30).text)
    write_json(out / "http" / "chat-logprobs.json", call("POST", f"{url}/chat/completions", json=chat(model)))
    write_json(out / "http" / "chat-stream.json", stream(f"{url}/chat/completions", chat(model)))
    (out / "metrics" / "after-two-completions.txt").write_text(requests.get(f"{base}/metrics", timeout=30).text)
    errors = {
        "unknown-model": ("POST", "/chat/completions", chat("no-such-model")),
        "bad-field": ("POST", "/chat/completions", chat(model, temperature="hot")),
        "too-many-tokens": ("POST", "/chat/completions", chat(model, max_tokens=10**7)),
        "tools-without-parser-choice": (
            "POST",
            "/chat/completions",
            chat(
                model,
                tool_choice="required",
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
                ],
            ),
        ),
        "unknown-path": ("GET", "/v1/no-such-path", None),
    }
    for name, (method, path, body) in errors.items():
        target = f"{base}{path}" if path.startswith("/v1/") else f"{url}{path}"
        write_json(out / "http" / f"error-{name}.json", {"request": body, **call(method, target, json=body)})
    write_json(out / "http" / "health.json", call("GET", f"{base}/health"))


def record_killed_worker(d: Deployment, url: str, model: str, out: Path, signal: str, first: str = "plain") -> None:
    head, worker = d.sim["nodes"][0], d.sim["nodes"][1]
    base = url.removesuffix("/v1")
    mark = time.time()
    since = str(int(mark - 1))
    killed_at = time.monotonic()
    if signal == "KILL":
        docker_on(worker["index"], "kill", d.container(worker))
    else:  # docker stop: SIGTERM, SIGKILL after docker's 10 s grace
        docker_on(worker["index"], "stop", "-t", "60", d.container(worker))
    steps: dict[str, Any] = {"worker": {**state(d, worker), "secondsToExit": round(time.monotonic() - killed_at, 3)}}
    time.sleep(5)  # what an idle head does with a dead worker: nothing, as recorded
    steps["headAfter5s"] = state(d, head)
    steps["healthAfter5s"] = call("GET", f"{base}/health", timeout=10)

    # The first request after the kill meets the failure; the second an engine already known dead.
    def plain() -> dict[str, Any]:
        return call("POST", f"{url}/chat/completions", json=chat(model), timeout=60)

    def streamed() -> dict[str, Any]:
        return stream(f"{url}/chat/completions", chat(model))

    order = (
        (("streamed", streamed), ("request", plain))
        if first == "stream"
        else (("request", plain), ("streamed", streamed))
    )
    for key, ask in order:
        steps[key] = ask()
    steps["head"] = wait_exit(d, head, 120)
    steps["head"]["secondsFromKill"] = round(time.monotonic() - killed_at, 3)
    steps["healthAfterHeadExit"] = call("GET", f"{base}/health", timeout=5)
    write_json(out / "sequence.json", steps)
    write_log(out / "head.log.jsonl", merged_log(d, head, since), mark)
    write_log(out / "worker.log.jsonl", merged_log(d, worker, since), mark)


def record_head_ended(d: Deployment, out: Path, signal: str) -> None:
    head, worker = d.sim["nodes"][0], d.sim["nodes"][1]
    mark = time.time()
    since = str(int(mark - 1))
    started = time.monotonic()
    if signal == "KILL":
        docker_on(head["index"], "kill", d.container(head))
    else:
        docker_on(head["index"], "stop", "-t", "60", d.container(head))
    steps: dict[str, Any] = {"head": {**state(d, head), "secondsToExit": round(time.monotonic() - started, 3)}}
    time.sleep(60)  # long enough for a worker that noticed to say so or exit
    steps["workerAfter60s"] = state(d, worker)
    write_json(out / "sequence.json", steps)
    write_log(out / "head.log.jsonl", merged_log(d, head, since), mark)
    write_log(out / "worker.log.jsonl", merged_log(d, worker, since), mark)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.record", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    d, work, _weights = tool_deployment(TOOL, port=PORT, master_port=MASTER_PORT, server="real")
    sim = d.sim
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-record-out-"))
    try:
        print(f"sim.record: deploying {d.name} (real vLLM, 2 ranks)", flush=True)
        up = d.up()
        url = up.outputs["endpoint"].value
        model = call("GET", f"{url}/models")["body"]["data"][0]["id"]
        version = docker_on(
            sim["nodes"][0]["index"],
            "exec",
            d.container(sim["nodes"][0]),
            "python3",
            "-c",
            "import importlib.metadata as m; print(m.version('vllm'))",
        ).stdout.strip()
        record_boot(d, tmp)
        record_http(d, url, model, tmp)
        for name, signal, first in (
            ("killed-worker", "KILL", "plain"),
            ("killed-worker-streamed", "KILL", "stream"),
            ("stopped-worker", "TERM", "plain"),
        ):
            print(f"sim.record: {name}", flush=True)
            record_killed_worker(d, url, model, tmp / name, signal, first)
            d.up()
        print("sim.record: stopped-head", flush=True)
        record_head_ended(d, tmp / "stopped-head", "TERM")
        d.up()
        print("sim.record: killed-head", flush=True)
        record_head_ended(d, tmp / "killed-head", "KILL")
        write_json(
            tmp / "manifest.json",
            {
                "vllm": version,
                "image": d.config["image"],
                "model": model,
                "recordedAt": time.strftime("%Y-%m-%d"),
                "tensorParallelSize": 2,
                "nnodes": 2,
                "serve": {
                    k: d.config["serve"][k]
                    for k in sorted(d.config["serve"])
                    if k in ("extraArgs", "extraEnv", "maxModelLen", "enforceEager", "toolCallParser")
                },
            },
        )
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(tmp, args.out)
        print(f"sim.record: real vLLM {version} recorded into {args.out}")
    finally:
        remove_deployment(d)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
