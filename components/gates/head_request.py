"""LiveRanks' drift probe sent from the head itself: run by the serving image's python3 inside the head's container.

Self-contained (stdlib only): `head_request.sh` ships this file's text and runs it with `docker exec -i`, so the
request goes to the API on the container's own loopback, past every network and proxy between the operator and
the head. It reads one JSON line on stdin (`port`, `body`: the request, `api_key` (the key travels on stdin, never
in argv), `timeout_s`, `gap_s`, `health_timeout_s`), sends the 1-token request, and prints one JSON line: the
HTTP `status` and `body`, or a `failure` (`refused`, `reset`, `timeout`, `protocol`, `network`) with its
`detail`; after a timeout, `metrics`: `/metrics` read twice `gap_s` apart (null when it did not answer). The
operator's side judges it with the verifier's rules (`components/verify/client.py` `judge_probe`).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from typing import Any

LOOPBACK = "127.0.0.1"


def _metrics(port: int, timeout_s: float) -> str | None:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        text = reply.read().decode("utf-8", "replace")
        return text if reply.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def ask(spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec["port"])
    timeout_s = float(spec["timeout_s"])
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if spec.get("api_key"):
        headers["Authorization"] = f"Bearer {spec['api_key']}"
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(spec["body"]).encode(), headers=headers)
        reply = conn.getresponse()
        return {"status": reply.status, "body": reply.read().decode("utf-8", "replace")}
    except ConnectionRefusedError as err:
        return {"failure": "refused", "detail": f"{type(err).__name__} on {LOOPBACK}:{port}"}
    except (ConnectionResetError, BrokenPipeError) as err:
        return {"failure": "reset", "detail": f"{type(err).__name__} on {LOOPBACK}:{port}"}
    except TimeoutError:
        first = _metrics(port, float(spec["health_timeout_s"]))
        time.sleep(float(spec["gap_s"]))
        second = _metrics(port, float(spec["health_timeout_s"]))
        return {"failure": "timeout", "metrics": [first, second]}
    except http.client.HTTPException as err:
        return {"failure": "protocol", "detail": repr(err)}
    except OSError as err:
        return {"failure": "network", "detail": str(err)}
    finally:
        conn.close()


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    print(json.dumps(ask(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
