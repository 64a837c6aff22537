"""`dsv41-exl3 status` with the stack's Prometheus: its API as the source, and /metrics as the fallback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from components.http import ConnectionRefusedOrReset, DeadlineExceeded
from components.operator.stack_view import StackView
from components.operator.status import main, prometheus_queries, prometheus_window_s
from tests.operator import stacks
from tests.operator.stacks import API_KEY, SUPERVISOR_STATUS, SUPERVISOR_TOKEN, FakeClock, FakeNodes, metrics_text

pytestmark = pytest.mark.timeout(30)

PROMETHEUS_URL = "http://10.0.0.1:18390"
METRICS_URL = "http://10.0.0.1:8888/metrics"
# The dashboard's expressions (components/observability/dashboard.json) at the default 15 s scrape: rates over 1m.
RUNNING_Q = 'sum(vllm:num_requests_running{job="vllm"})'
WAITING_Q = 'sum(vllm:num_requests_waiting{job="vllm"})'
GENERATED_Q = 'sum(rate(vllm:generation_tokens_total{job="vllm"}[60s]))'
PROMPTED_Q = 'sum(rate(vllm:prompt_tokens_total{job="vllm"}[60s]))'
KV_Q = '(sum(vllm:kv_cache_usage_perc{job="vllm"}) or sum(vllm:gpu_cache_usage_perc{job="vllm"})) * 100'
ESSENTIAL = [RUNNING_Q, WAITING_Q, GENERATED_Q]


def vector(*values: str) -> tuple[int, str]:
    """Prometheus' answer to an instant query: one sample per value (none: an empty result)."""
    result = [{"metric": {}, "value": [1748772000.123, v]} for v in values]
    return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


LOADED = {
    RUNNING_Q: vector("2"),
    WAITING_Q: vector("3"),
    GENERATED_Q: vector("12.5"),
    KV_Q: vector("25"),
    PROMPTED_Q: vector("40"),
}

Answer = tuple[int, str] | BaseException


class FakeApis:
    """`fetch` for status with Prometheus: instant queries answered by expression, then /metrics and the supervisor."""

    def __init__(
        self, prometheus: Mapping[str, Answer] | Answer | None = None, metrics: list[Answer] | None = None
    ) -> None:
        self.prometheus = LOADED if prometheus is None else prometheus
        self.metrics = metrics if metrics is not None else [(200, metrics_text()), (200, metrics_text(generated=1150))]
        self.calls: list[tuple[str, dict[str, str], float]] = []

    def queries(self) -> list[str]:
        return [parse_qs(urlsplit(url).query)["query"][0] for url, _, _ in self.calls if "/api/v1/query" in url]

    def __call__(self, url: str, headers: Any, timeout: float) -> tuple[int, str]:
        self.calls.append((url, dict(headers), timeout))
        answer: Answer
        if url.startswith(f"{PROMETHEUS_URL}/api/v1/query?"):
            query = parse_qs(urlsplit(url).query)["query"][0]
            answer = self.prometheus.get(query, vector()) if isinstance(self.prometheus, Mapping) else self.prometheus
        elif url == METRICS_URL:
            answer = self.metrics.pop(0)
        elif url.endswith("/status"):
            answer = (200, json.dumps(SUPERVISOR_STATUS))
        else:
            raise AssertionError(f"unexpected GET {url}")
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _run(
    capsys: pytest.CaptureFixture[str],
    *args: str,
    http: FakeApis,
    clock: FakeClock | None = None,
    view: StackView | None = None,
) -> tuple[int, str, str]:
    the_view = view or stacks.view(stacks.outputs(prometheusUrl=PROMETHEUS_URL))
    clock = clock or FakeClock()
    code = main(
        ["--stack", stacks.STACK, *args],
        read=lambda name: the_view,
        run=FakeNodes(),
        fetch=http,
        sleep=clock.sleep,
        clock=clock.clock,
    )
    out, err = capsys.readouterr()
    return code, out, err


# --- Prometheus as the source ------------------------------------------------------------------------------------


def test_with_prometheus_the_load_comes_from_its_api_without_metrics_or_waiting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    http, clock = FakeApis(), FakeClock()
    code, out, err = _run(capsys, http=http, clock=clock)
    assert (code, err) == (0, "")
    assert (
        "metrics: 2 running, 3 waiting, KV cache 25.0 %, 12.5 generation tok/s, 40.0 prompt tok/s over 60.0 s "
        "(from prometheus)\n" in out
    )
    assert "note:" not in out
    assert clock.slept == []
    assert not any("/metrics" in url for url, _, _ in http.calls)
    assert sorted(http.queries()) == sorted([RUNNING_Q, WAITING_Q, GENERATED_Q, KV_Q, PROMPTED_Q])


def test_prometheus_is_sent_no_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeApis()
    _run(capsys, http=http)
    prometheus_calls = [c for c in http.calls if c[0].startswith(PROMETHEUS_URL)]
    assert prometheus_calls and all(headers == {} and timeout == 10 for _, headers, timeout in prometheus_calls)
    assert not any(API_KEY in url for url, _, _ in http.calls)


def test_json_names_prometheus_as_the_source(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--json", http=FakeApis())
    metrics = json.loads(out)["metrics"]
    assert code == 0
    assert metrics == {
        "error": None,
        "requestsRunning": 2.0,
        "requestsWaiting": 3.0,
        "kvCacheUsagePercent": 25.0,
        "generationTokensPerSecond": 12.5,
        "promptTokensPerSecond": 40.0,
        "elapsedSeconds": 60.0,
        "source": "prometheus",
        "note": None,
    }


def test_series_of_several_label_sets_are_summed_as_metrics_are(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeApis(prometheus={**LOADED, RUNNING_Q: vector("1", "2"), WAITING_Q: vector("0")})
    _, out, _ = _run(capsys, http=http)
    assert "metrics: 3 running, 0 waiting," in out and "(from prometheus)" in out


def test_no_kv_cache_or_prompt_series_is_still_prometheus_with_a_question_mark(
    capsys: pytest.CaptureFixture[str],
) -> None:
    http = FakeApis(prometheus={RUNNING_Q: vector("1"), WAITING_Q: vector("0"), GENERATED_Q: vector("0")})
    code, out, _ = _run(capsys, http=http)
    assert code == 0
    assert "metrics: 1 running, 0 waiting, KV cache ? %, 0.0 generation tok/s over 60.0 s (from prometheus)" in out
    assert not any(url == METRICS_URL for url, _, _ in http.calls)


def test_the_rate_window_is_1m_or_four_scrapes() -> None:
    assert prometheus_window_s(15) == 60
    assert prometheus_window_s(5) == 60
    assert prometheus_window_s(60) == 240
    assert prometheus_queries(240)["generation_tokens_per_second"] == (
        'sum(rate(vllm:generation_tokens_total{job="vllm"}[240s]))'
    )


def test_a_slow_scrape_widens_the_window_the_report_says(capsys: pytest.CaptureFixture[str]) -> None:
    slow = stacks.view(stacks.outputs(prometheusUrl=PROMETHEUS_URL), observability={"scrapeSeconds": 60})
    answers = {q.replace("[60s]", "[240s]"): a for q, a in LOADED.items()}
    http = FakeApis(prometheus=answers)
    _, out, _ = _run(capsys, http=http, view=slow)
    assert "over 240.0 s (from prometheus)" in out
    assert GENERATED_Q.replace("[60s]", "[240s]") in http.queries()


# --- the fallback to /metrics -------------------------------------------------------------------------------------


def _assert_fell_back(out: str, http: FakeApis, clock: FakeClock, why: str) -> None:
    assert (
        "metrics: 1 running, 0 waiting, KV cache 12.5 %, 30.0 generation tok/s over 5.0 s (from vllm /metrics)" in out
    )
    assert f"  note: Prometheus at {PROMETHEUS_URL} could not be read: {why}; read vLLM's /metrics instead\n" in out
    assert [url for url, _, _ in http.calls].count(METRICS_URL) == 2
    assert clock.slept == [5.0]


@pytest.mark.parametrize(
    "failure, why",
    [
        (ConnectionRefusedOrReset("ConnectionRefusedError"), "connection refused"),
        (DeadlineExceeded(), "no answer within 10 s"),
        (OSError("no route"), "OSError"),
    ],
)
def test_an_unreachable_prometheus_falls_back_to_two_metrics_samples(
    capsys: pytest.CaptureFixture[str], failure: BaseException, why: str
) -> None:
    http, clock = FakeApis(prometheus=failure), FakeClock()
    code, out, err = _run(capsys, http=http, clock=clock)
    assert (code, err) == (0, "")
    _assert_fell_back(out, http, clock, why)
    assert len(http.queries()) == 1  # the first failure is enough


@pytest.mark.parametrize("query", ESSENTIAL)
def test_an_empty_result_for_an_essential_series_falls_back(capsys: pytest.CaptureFixture[str], query: str) -> None:
    http, clock = FakeApis(prometheus={**LOADED, query: vector()}), FakeClock()
    code, out, _ = _run(capsys, http=http, clock=clock)
    assert code == 0
    _assert_fell_back(out, http, clock, f"an empty result for {query}")


def test_a_nan_result_counts_as_empty(capsys: pytest.CaptureFixture[str]) -> None:
    http, clock = FakeApis(prometheus={**LOADED, GENERATED_Q: vector("NaN")}), FakeClock()
    _, out, _ = _run(capsys, http=http, clock=clock)
    _assert_fell_back(out, http, clock, f"an empty result for {GENERATED_Q}")


@pytest.mark.parametrize(
    "answer, why",
    [
        (
            (400, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error at char 4"})),
            "HTTP 400: parse error at char 4",
        ),
        ((503, json.dumps({"status": "error", "errorType": "unavailable"})), "HTTP 503: error"),
        ((502, "<html>Bad Gateway</html>"), "HTTP 502, not a Prometheus API answer"),
        ((200, json.dumps({"status": "success", "data": {}})), "an answer without data.result"),
        (
            (200, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [{"values": []}]}})),
            "a result that is not an instant vector",
        ),
    ],
)
def test_an_error_answer_falls_back_and_says_what_prometheus_said(
    capsys: pytest.CaptureFixture[str], answer: tuple[int, str], why: str
) -> None:
    http, clock = FakeApis(prometheus=answer), FakeClock()
    code, out, _ = _run(capsys, http=http, clock=clock)
    assert code == 0
    _assert_fell_back(out, http, clock, why)


def test_json_of_a_fallback_has_the_source_and_the_note(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "--json", http=FakeApis(prometheus=DeadlineExceeded()))
    metrics = json.loads(out)["metrics"]
    assert metrics["source"] == "vllm /metrics" and metrics["error"] is None
    assert metrics["generationTokensPerSecond"] == 30.0 and metrics["elapsedSeconds"] == 5.0
    assert metrics["note"] == (
        f"Prometheus at {PROMETHEUS_URL} could not be read: no answer within 10 s; read vLLM's /metrics instead"
    )


def test_when_the_fallback_fails_too_both_reasons_are_shown_and_it_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    refused = ConnectionRefusedOrReset("ConnectionRefusedError")
    code, out, _ = _run(capsys, http=FakeApis(prometheus=refused, metrics=[refused]))
    assert code == 1
    assert f"metrics: unavailable (connection refused from {METRICS_URL})\n" in out
    assert f"  note: Prometheus at {PROMETHEUS_URL} could not be read: connection refused;" in out
    assert "DOWN: metrics unavailable" in out


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_no_secret_is_printed_on_either_path(capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    echo = (400, json.dumps({"status": "error", "error": f"echo {API_KEY} {SUPERVISOR_TOKEN}"}))
    for http in (FakeApis(), FakeApis(prometheus=echo)):
        _, out, err = _run(capsys, *mode, http=http)
        assert API_KEY not in out + err and SUPERVISOR_TOKEN not in out + err


# --- without Prometheus: as before --------------------------------------------------------------------------------


def test_without_a_prometheus_output_the_two_metrics_samples_are_read_as_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    http, clock = FakeApis(prometheus=AssertionError("Prometheus is not deployed")), FakeClock()
    code, out, _ = _run(capsys, "--interval", "2", http=http, clock=clock, view=stacks.view())
    assert code == 0
    assert (
        "metrics: 1 running, 0 waiting, KV cache 12.5 %, 75.0 generation tok/s over 2.0 s (from vllm /metrics)\n"
        in (out)
    )
    assert "note:" not in out
    assert [url for url, _, _ in http.calls if not url.endswith("/status")] == [METRICS_URL] * 2
    assert all(
        headers == {"Authorization": f"Bearer {API_KEY}"} for url, headers, _ in http.calls if url == METRICS_URL
    )
    assert clock.slept == [2.0]
    _, out, _ = _run(capsys, "--json", http=FakeApis(), view=stacks.view())
    metrics = json.loads(out)["metrics"]
    assert (metrics["source"], metrics["note"], metrics["promptTokensPerSecond"]) == ("vllm /metrics", None, None)


def test_an_empty_prometheus_output_is_no_prometheus(capsys: pytest.CaptureFixture[str]) -> None:
    http = FakeApis(prometheus=AssertionError("not asked"))
    _, out, _ = _run(capsys, http=http, view=stacks.view(stacks.outputs(prometheusUrl="")))
    assert "(from vllm /metrics)" in out and "note:" not in out and http.queries() == []


def test_metrics_with_a_prompt_counter_report_its_rate_too(capsys: pytest.CaptureFixture[str]) -> None:
    def with_prompt(generated: float, prompted: float) -> tuple[int, str]:
        return 200, metrics_text(generated=generated) + f'vllm:prompt_tokens_total{{engine="0"}} {prompted}\n'

    http = FakeApis(metrics=[with_prompt(1000, 500), with_prompt(1150, 1500)])
    _, out, _ = _run(capsys, http=http, view=stacks.view())
    assert "30.0 generation tok/s, 200.0 prompt tok/s over 5.0 s (from vllm /metrics)" in out


# --- the default fetch against a Prometheus API on loopback ------------------------------------------------------


@pytest.fixture
def loopback_prometheus() -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            query = parse_qs(parts.query).get("query", [""])[0]
            seen.append({"path": parts.path, "query": query, "auth": self.headers.get("Authorization", "")})
            status, body = LOADED.get(query, vector()) if parts.path == "/api/v1/query" else (404, "not found")
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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


def test_the_default_fetch_queries_a_real_prometheus_api(
    capsys: pytest.CaptureFixture[str], loopback_prometheus: tuple[str, list[dict[str, str]]]
) -> None:
    url, seen = loopback_prometheus
    # The endpoint's port is closed: reading /metrics would fail, so the line below is Prometheus' alone.
    outputs = stacks.outputs(endpoint="http://127.0.0.1:9/v1", supervisor=None, prometheusUrl=url + "/")
    code = main(["--stack", stacks.STACK], read=lambda n: stacks.view(outputs), run=FakeNodes(), sleep=lambda s: None)
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert "metrics: 2 running, 3 waiting, KV cache 25.0 %, 12.5 generation tok/s, 40.0 prompt tok/s" in out
    assert sorted(s["query"] for s in seen) == sorted(LOADED)
    assert all(s["path"] == "/api/v1/query" and s["auth"] == "" for s in seen)
