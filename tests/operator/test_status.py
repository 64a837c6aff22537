"""`dsv41-exl3 status`: what each node, vLLM and the supervisor report, the exit code, and no secret shown."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from components.http import ConnectionRefusedOrReset, DeadlineExceeded
from components.operator import status
from components.operator.stack_view import OperatorError, StackView
from components.operator.status import (
    ContainerState,
    MetricsReport,
    NodeReport,
    main,
    metrics_url,
    node_report,
    node_script,
    parse_metrics,
    parse_node_report,
    summarize_metrics,
    watchdog_log,
)
from components.operator.supervisor import format_status
from tests.operator import stacks
from tests.operator.stacks import (
    API_KEY,
    DEAD_TEXT,
    HEAD_CONTAINER,
    MISSING_TEXT,
    RUNNING_TEXT,
    SSH_KEY_BODY,
    SUPERVISOR_STATUS,
    SUPERVISOR_TOKEN,
    SUPERVISOR_URL,
    UNREACHABLE_STDERR,
    WATCHDOG_LINE,
    WORKER_CONTAINER,
    FakeClock,
    FakeHttp,
    FakeNodes,
    done,
    metrics_text,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(30)


def _run(
    capsys: pytest.CaptureFixture[str],
    *args: str,
    view: StackView | None = None,
    nodes: FakeNodes | None = None,
    http: FakeHttp | None = None,
    clock: FakeClock | None = None,
) -> tuple[int, str, str]:
    the_view = view or stacks.view()
    clock = clock or FakeClock()
    code = main(
        ["--stack", stacks.STACK, *args],
        read=lambda name: the_view,
        run=nodes or FakeNodes(),
        fetch=http or FakeHttp(),
        sleep=clock.sleep,
        clock=clock.clock,
    )
    out, err = capsys.readouterr()
    return code, out, err


# --- a node's report ------------------------------------------------------------------------------------------


def test_a_running_rank_reports_its_state_memory_in_gib_and_the_watchdogs_last_line() -> None:
    report = parse_node_report(RUNNING_TEXT)
    assert report.state == ContainerState(
        status="running",
        running=True,
        exit_code=0,
        oom_killed=False,
        started_at="2025-06-01T09:58:12.123456789Z",
        finished_at="0001-01-01T00:00:00Z",
    )
    assert report.running and report.unreachable is None and report.state_error is None
    assert report.mem_available_gib == pytest.approx(4_215_212 / 1024 / 1024)
    assert report.watchdog == WATCHDOG_LINE


def test_a_dead_rank_reports_exit_137_and_oom_killed() -> None:
    report = parse_node_report(DEAD_TEXT)
    assert report.state is not None
    assert (report.state.status, report.state.running, report.state.exit_code, report.state.oom_killed) == (
        "exited",
        False,
        137,
        True,
    )
    assert report.state.finished_at == "2025-06-01T11:02:03.5Z"
    assert not report.running
    assert report.watchdog == "no watchdog log"


def test_a_missing_container_is_no_such_container_and_memory_is_still_read() -> None:
    report = parse_node_report(MISSING_TEXT)
    assert report.state is None and report.state_error == "no such container"
    assert not report.running
    assert report.mem_available_gib == pytest.approx(120_000_000 / 1024 / 1024)


def test_another_docker_failure_is_shown_as_docker_said_it() -> None:
    said = "permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock"
    report = parse_node_report(stacks.node_text(said))
    assert report.state is None and report.state_error == said


def test_a_report_cut_short_is_unreachable_not_a_half_report() -> None:
    report = parse_node_report(RUNNING_TEXT.replace("==end==\n", ""))
    assert report.unreachable == "the node's report was cut short"
    assert not report.running


def test_an_empty_watchdog_log_says_so() -> None:
    assert parse_node_report(stacks.node_text("{}", watchdog="")).watchdog == "watchdog log is empty"


def test_ssh_failing_is_unreachable_with_the_first_line_ssh_printed() -> None:
    report = node_report(lambda argv: done(stderr=UNREACHABLE_STDERR, returncode=255), ["ssh"])
    assert report.unreachable == "ssh: connect to host 10.0.0.2 port 22: No route to host"


def test_ssh_timing_out_or_missing_is_unreachable_too() -> None:
    def hang(argv: list[str]) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, 30)

    def absent(argv: list[str]) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(2, "No such file or directory", "ssh")

    assert node_report(hang, ["ssh"]).unreachable == "no answer within 30 s"
    assert node_report(absent, ["ssh"]).unreachable == "cannot run ssh (No such file or directory)"


def _fake_node(tmp_path: Path, docker: str, log: str | None) -> dict[str, str]:
    """A home and a PATH whose `docker` is a stand-in script, to run the node script here under sh."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\n" + docker)
    (bin_dir / "docker").chmod(stat.S_IRWXU)
    if log is not None:
        path = home / watchdog_log(stacks.STACK)
        path.parent.mkdir(parents=True)
        path.write_text(log)
    else:
        home.mkdir()
    return {"HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _run_script(env: dict[str, str], container: str) -> subprocess.CompletedProcess[str]:
    script = node_script(container, watchdog_log(stacks.STACK))
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=10, check=False)


def test_the_node_script_run_by_sh_prints_what_the_parser_reads(tmp_path: Path) -> None:
    docker = (
        '[ "$1 $2 $3" = "inspect --format {{json .State}}" ] || exit 9\n'
        f'[ "$4" = "{HEAD_CONTAINER}" ] || exit 8\n'
        f"echo '{json.dumps(stacks.RUNNING_STATE)}'\n"
    )
    env = _fake_node(tmp_path, docker, log="older line\n" + WATCHDOG_LINE + "\n")
    ran = _run_script(env, HEAD_CONTAINER)
    assert ran.returncode == 0, ran.stderr
    report = parse_node_report(ran.stdout)
    assert report.running and report.watchdog == WATCHDOG_LINE
    assert report.mem_available_gib is not None and report.mem_available_gib > 0  # this machine's /proc/meminfo


def test_the_node_script_reports_a_missing_container_and_no_watchdog_log(tmp_path: Path) -> None:
    env = _fake_node(tmp_path, 'echo "Error: No such object: $4" >&2; exit 1\n', log=None)
    ran = _run_script(env, WORKER_CONTAINER)
    assert ran.returncode == 0, ran.stderr
    report = parse_node_report(ran.stdout)
    assert report.state_error == "no such container" and report.watchdog == "no watchdog log"


def test_the_watchdog_log_read_is_this_stacks_own() -> None:
    # components/watchdog/watchdog.py: ~/.local/state/<stack prefix>/watchdog.log, one directory per stack.
    assert watchdog_log("dev") == ".local/state/dsv41-exl3-dev/watchdog.log"
    assert "'" in node_script("c", "a dir/watchdog.log")  # a path is quoted, never split


# --- vLLM's metrics -------------------------------------------------------------------------------------------


def test_metrics_are_parsed_past_comments_and_created_series() -> None:
    parsed = parse_metrics(metrics_text(running=2.0, waiting=1.0, kv=0.5, generated=42.0))
    assert parsed["vllm:num_requests_running"] == 2.0
    assert parsed["vllm:num_requests_waiting"] == 1.0
    assert parsed["vllm:kv_cache_usage_perc"] == 0.5
    assert parsed["vllm:generation_tokens_total"] == 42.0
    assert not any(k.endswith("_created") for k in parsed)
    assert parsed["vllm:e2e_request_latency_seconds_count"] == 12.0


def test_metrics_sum_over_label_sets_and_read_quoted_labels() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="a b, {c}=\\"d\\""} 2\n'
        "vllm:num_requests_running 3 1748772000000\n"
        'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
    )
    assert parse_metrics(text) == {"vllm:num_requests_running": 6.0}


def test_the_metrics_url_is_the_endpoints_host_and_port() -> None:
    assert metrics_url("http://10.0.0.1:8888/v1") == "http://10.0.0.1:8888/metrics"
    assert metrics_url("https://head.lan:443/v1/") == "https://head.lan:443/metrics"


def test_the_generation_rate_is_the_counters_growth_over_the_elapsed_time() -> None:
    first = parse_metrics(metrics_text(generated=1000.0))
    second = parse_metrics(metrics_text(running=2.0, waiting=3.0, kv=0.25, generated=1150.0))
    m = summarize_metrics(first, second, 5.0)
    assert m == MetricsReport(
        requests_running=2.0,
        requests_waiting=3.0,
        kv_cache_usage_percent=25.0,
        generation_tokens_per_second=30.0,
        elapsed_seconds=5.0,
    )


def test_a_counter_that_went_down_gives_no_rate_rather_than_a_negative_one() -> None:
    m = summarize_metrics(parse_metrics(metrics_text(generated=900.0)), parse_metrics(metrics_text(generated=5.0)), 5)
    assert m.error is None and m.generation_tokens_per_second is None


def test_an_answer_without_vllms_series_is_an_error() -> None:
    m = summarize_metrics({}, {"process_cpu_seconds_total": 3.0}, 5.0)
    assert m.error is not None and "vllm:num_requests_running" in m.error


# --- the command --------------------------------------------------------------------------------------------


def test_everything_up_exits_0_with_a_summary_of_each_section(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    code, out, err = _run(capsys, clock=clock)
    assert (code, err) == (0, "")
    assert (
        'stack opstest: http://10.0.0.1:8888/v1 serving "DeepSeek-v4.1-Flash-EXL3", cluster generation gen-4f2a' in out
    )
    assert 'last verification: 2025-06-01T10:00:00Z in 1.25 s: answer "Paris", logprobs [["Paris", -0.0123]]' in out
    assert f"spark-head: {HEAD_CONTAINER} running since 2025-06-01T09:58:12.123456789Z; MemAvailable 4.0 GiB" in out
    assert f"watchdog: {WATCHDOG_LINE}" in out
    assert "metrics: 1 running, 0 waiting, KV cache 12.5 %, 30.0 generation tok/s over 5.0 s" in out
    assert format_status(SUPERVISOR_STATUS) in out
    assert out.rstrip().endswith("healthy")
    assert clock.slept == [5.0]


def test_the_interval_between_the_two_samples_is_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    code, out, _ = _run(capsys, "--interval", "2", clock=clock)
    assert code == 0 and clock.slept == [2.0]
    assert "75.0 generation tok/s over 2.0 s" in out


def test_one_ssh_per_node_with_the_nodes_container_and_the_stacks_key_file(capsys: pytest.CaptureFixture[str]) -> None:
    nodes = FakeNodes()
    view = stacks.view()
    _run(capsys, nodes=nodes, view=view)
    assert sorted(argv[-2] for argv in nodes.calls) == ["me@10.0.0.1", "me@10.0.0.2"]
    for argv in nodes.calls:
        container = HEAD_CONTAINER if argv[-2] == "me@10.0.0.1" else WORKER_CONTAINER
        assert argv[0] == "ssh" and container in argv[-1]
        key_file = argv[argv.index("-i") + 1]
        assert key_file.startswith(view.stack_dir + "/")
        assert SSH_KEY_BODY not in " ".join(argv)


def test_a_container_name_missing_from_the_outputs_falls_back_to_servings_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nodes = FakeNodes()
    _run(capsys, nodes=nodes, view=stacks.view(stacks.outputs(containers=None)))
    assert any(WORKER_CONTAINER in argv[-1] for argv in nodes.calls if argv[-2] == "me@10.0.0.2")


def test_a_dead_rank_exits_1_and_says_exit_137_oom_killed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, nodes=FakeNodes(**{"10_0_0_2": done(DEAD_TEXT)}))
    assert code == 1
    assert f"spark-worker: {WORKER_CONTAINER} exited (exit 137, OOM killed) at 2025-06-01T11:02:03.5Z" in out
    assert "DOWN: rank not running on spark-worker" in out


def test_a_missing_container_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, nodes=FakeNodes(**{"10_0_0_2": done(MISSING_TEXT)}))
    assert code == 1 and f"spark-worker: {WORKER_CONTAINER}: no such container; MemAvailable 114.4 GiB" in out


def test_an_unreachable_node_is_one_line_and_the_others_are_still_reported(capsys: pytest.CaptureFixture[str]) -> None:
    nodes = FakeNodes(**{"10_0_0_2": done(stderr=UNREACHABLE_STDERR, returncode=255)})
    code, out, err = _run(capsys, nodes=nodes)
    assert code == 1 and err == ""
    assert "  spark-worker: unreachable: ssh: connect to host 10.0.0.2 port 22: No route to host\n" in out
    assert f"spark-head: {HEAD_CONTAINER} running since" in out


@pytest.mark.parametrize(
    "failure, shown",
    [
        (ConnectionRefusedOrReset("ConnectionRefusedError"), "connection refused"),
        (DeadlineExceeded(), "no answer within 10 s"),
        (OSError("no route"), "OSError"),
        ((401, '{"error": "Unauthorized"}'), "HTTP 401"),
    ],
)
def test_metrics_that_cannot_be_read_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], failure: Any, shown: str
) -> None:
    code, out, err = _run(capsys, http=FakeHttp(metrics=[failure, failure]))
    assert code == 1 and err == ""
    assert f"metrics: unavailable ({shown} from http://10.0.0.1:8888/metrics)" in out
    assert "Traceback" not in out


def test_a_second_sample_that_fails_makes_the_metrics_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, http=FakeHttp(metrics=[(200, metrics_text()), DeadlineExceeded()]))
    assert code == 1 and "metrics: unavailable (no answer within 10 s" in out


def test_no_endpoint_output_means_no_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeHttp()
    code, out, _ = _run(capsys, http=http, view=stacks.view(stacks.outputs(endpoint=None)))
    assert code == 1 and "metrics: unavailable (no `endpoint` output" in out
    assert not any(url.endswith("/metrics") for url, _, _ in http.calls)


def test_metrics_carry_the_api_key_and_the_supervisor_its_token(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeHttp()
    _run(capsys, http=http)
    metrics_calls = [c for c in http.calls if c[0] == "http://10.0.0.1:8888/metrics"]
    assert len(metrics_calls) == 2
    assert all(c[1] == {"Authorization": f"Bearer {API_KEY}"} and c[2] == 10 for c in metrics_calls)
    assert (f"{SUPERVISOR_URL}/status", {"Authorization": f"Bearer {SUPERVISOR_TOKEN}"}, 10) in http.calls


def test_an_open_endpoint_gets_no_authorization_header(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeHttp()
    _run(capsys, http=http, view=stacks.view(stacks.outputs(apiKey=None)))
    assert all(c[1] == {} for c in http.calls if c[0].endswith("/metrics"))


def test_no_supervisor_output_is_one_line_and_not_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeHttp()
    code, out, _ = _run(capsys, http=http, view=stacks.view(stacks.outputs(supervisor=None)))
    assert code == 0
    assert "supervisor: not deployed (no `supervisor` output" in out
    assert not any(c[0].endswith("/status") for c in http.calls)


def test_an_unreachable_supervisor_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, http=FakeHttp(supervisor=ConnectionRefusedOrReset("ConnectionRefusedError")))
    assert code == 0
    assert f"supervisor: unreachable at {SUPERVISOR_URL} (connection refused)" in out


def test_json_is_one_object_with_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--json", nodes=FakeNodes(**{"10_0_0_2": done(DEAD_TEXT)}))
    data = json.loads(out)
    assert code == 1 and data["healthy"] is False
    assert (data["endpoint"], data["model"], data["clusterGeneration"]) == (
        "http://10.0.0.1:8888/v1",
        "DeepSeek-v4.1-Flash-EXL3",
        "gen-4f2a",
    )
    assert data["verification"]["verifiedAt"] == "2025-06-01T10:00:00Z"
    head, worker = data["nodes"]
    assert head["name"] == "spark-head" and head["running"] is True and head["watchdog"] == WATCHDOG_LINE
    assert worker["state"]["exitCode"] == 137 and worker["state"]["oomKilled"] is True
    assert worker["memAvailableGiB"] == pytest.approx(111.0, abs=0.1)
    assert data["metrics"]["kvCacheUsagePercent"] == 12.5
    assert data["metrics"]["generationTokensPerSecond"] == 30.0
    assert data["supervisor"]["status"] == SUPERVISOR_STATUS


def test_json_reports_an_unreachable_node_and_unavailable_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    nodes = FakeNodes(**{"10_0_0_1": done(stderr=UNREACHABLE_STDERR, returncode=255)})
    _, out, _ = _run(capsys, "--json", nodes=nodes, http=FakeHttp(metrics=[DeadlineExceeded()]))
    data = json.loads(out)
    assert data["nodes"][0]["unreachable"].startswith("ssh: connect to host")
    assert data["nodes"][1]["running"] is True
    assert data["metrics"]["error"] == "no answer within 10 s from http://10.0.0.1:8888/metrics"


@pytest.mark.parametrize("mode", [[], ["--json"]])
@pytest.mark.parametrize("trouble", ["none", "failures", "echoes"])
def test_no_secret_is_ever_printed(capsys: pytest.CaptureFixture[str], mode: list[str], trouble: str) -> None:
    secrets = [API_KEY, SUPERVISOR_TOKEN, SSH_KEY_BODY]
    nodes, http = FakeNodes(), FakeHttp()
    if trouble == "failures":
        nodes = FakeNodes(**{"10_0_0_2": done(stderr=UNREACHABLE_STDERR, returncode=255)})
        http = FakeHttp(metrics=[(401, "")], supervisor=(403, ""))
    elif trouble == "echoes":
        # A node and the supervisor that repeat what they were sent: the output still hides it.
        echoed = stacks.node_text(json.dumps(stacks.RUNNING_STATE), watchdog=f"key {API_KEY} token {SUPERVISOR_TOKEN}")
        nodes = FakeNodes(**{"10_0_0_1": done(echoed)})
        http = FakeHttp(supervisor=(200, json.dumps({**SUPERVISOR_STATUS, "doing": f"token {SUPERVISOR_TOKEN}"})))
    _, out, err = _run(capsys, *mode, nodes=nodes, http=http)
    assert out
    for secret in secrets:
        assert secret not in out and secret not in err
    assert any(API_KEY in c[1].get("Authorization", "") for c in http.calls)  # the key was in play


def test_an_unknown_stack_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def read(name: str) -> StackView:
        raise OperatorError(f"cannot read stack {name!r}: error: no stack named '{name}' found")

    code = main(["--stack", "nope"], read=read, run=FakeNodes(), fetch=FakeHttp())
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == "error: cannot read stack 'nope': error: no stack named 'nope' found\n"


@pytest.mark.parametrize(
    "args, said",
    [
        (["--stack", "s", "--interval", "0"], "--interval 0 must be a number of seconds above 0"),
        (["--stack", "s", "--interval", "nan"], "--interval nan must be a number of seconds above 0"),
        (["--stack", "s", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    def read(name: str) -> StackView:
        raise AssertionError("the stack is not read for a bad argument")

    code = main(args, read=read, run=FakeNodes(), fetch=FakeHttp())
    _, err = capsys.readouterr()
    assert code == 2 and said in err and err.count("\n") == 1


# --- the default fetch and the entry point, on loopback only ----------------------------------------------------


@pytest.fixture
def loopback_metrics() -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append({"path": self.path, "auth": self.headers.get("Authorization", "")})
            body = metrics_text().encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_default_fetch_reads_metrics_over_http(loopback_metrics: tuple[str, list[dict[str, str]]]) -> None:
    url, seen = loopback_metrics
    code, body = status.http_get(f"{url}/metrics", {"Authorization": "Bearer k"}, 5)
    assert code == 200 and parse_metrics(body)["vllm:num_requests_running"] == 1.0
    assert seen == [{"path": "/metrics", "auth": "Bearer k"}]


def test_the_default_fetch_reports_a_closed_port_as_refused(
    capsys: pytest.CaptureFixture[str], loopback_metrics: tuple[str, list[dict[str, str]]]
) -> None:
    url, _ = loopback_metrics
    port = url.rsplit(":", 1)[1]
    view = stacks.view(stacks.outputs(endpoint=f"http://127.0.0.1:{port}/v1", supervisor=None))
    code = main(["--stack", stacks.STACK, "--interval", "0.01"], read=lambda n: view, run=FakeNodes())
    out, _ = capsys.readouterr()
    assert code == 0 and "metrics: 1 running, 0 waiting, KV cache 12.5 %" in out
    closed = stacks.view(stacks.outputs(endpoint="http://127.0.0.1:9/v1", supervisor=None))
    code = main(["--stack", stacks.STACK], read=lambda n: closed, run=FakeNodes(), sleep=lambda s: None)
    out, _ = capsys.readouterr()
    assert code == 1 and "metrics: unavailable (connection refused from http://127.0.0.1:9/metrics)" in out


def test_a_report_is_running_only_when_reachable_and_running() -> None:
    running = parse_node_report(RUNNING_TEXT)
    assert running.running
    assert not NodeReport(state=running.state, unreachable="x").running
    assert not NodeReport().running


@pytest.mark.parametrize("exit_code", ["1; rm -rf /", {"x": 1}, [137], 1.5e300, True])
def test_a_crafted_exit_code_is_read_as_unknown_not_a_traceback(exit_code: object) -> None:
    report = parse_node_report(stacks.node_text(json.dumps({**stacks.DEAD_STATE, "ExitCode": exit_code})))
    assert report.state is not None and isinstance(report.state.exit_code, int)
    assert parse_node_report(stacks.node_text("[1, 2]")).state is None, "not docker's object: not read"
