"""The lock an update holds on the head's supervisor: while a `pulumi up` of the stack runs, the supervisor leaves
every rank to it (a rank the update stops is not a rank to heal).

The program takes it when it starts and renews it while it runs (a lease: a crashed update's lock ends
`TTL_S` after its last renewal) and releases it when the program's process ends. A preview takes none: it changes
nothing on the nodes, and a preview's release must never end a running up's lock. The lock is exclusive: an up
that finds another live holder fails at once, naming it; a holder on this machine whose process is gone (an up
killed before it could release) is taken over. Before the supervisor exists (the first up) there is nothing to
lock; failures to reach it are reported once, never fatal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable

import requests

from components.supervisor import policy

TTL_S = 90.0
RENEW_S = 20.0
ENGINE_CHECK_S = 2.0  # an orphaned update's lock ends within this of its engine's end
TIMEOUT_S = 5.0


def holder_name(stack: str, dry_run: bool) -> str:
    return f"pulumi {'preview' if dry_run else 'up'} of {stack} from {socket.gethostname()} pid {os.getpid()}"


def gone_local_holder(holder: str) -> bool:
    """Whether `holder` names a process of this machine that no longer runs (so it will never release)."""
    match = re.fullmatch(rf"pulumi \S+ of \S+ from {re.escape(socket.gethostname())} pid (\d+)", holder)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it runs, as another user
    return False


class LockHeld(Exception):
    """Another live update holds the supervisor's lock."""


class UpdateLock:
    def __init__(
        self,
        url: str,
        token: str,
        holder: str,
        *,
        log: Callable[[str], None] = print,
        session: requests.Session | None = None,
        engine_alive: Callable[[], bool] = lambda: True,
        renew_s: float = RENEW_S,
    ) -> None:
        self.url = url.rstrip("/") + "/lock"
        self.holder = holder
        self._headers = {"Authorization": f"Bearer {token}"}
        self._log = log
        self._session = session or requests.Session()
        self._stop = threading.Event()
        self._engine_alive = engine_alive
        self._renew_s = renew_s
        self._warned = False
        self.held = False
        self.refused_by = ""
        """Who holds the lock, when the last take was refused because another live update has it."""

    def _post(self, takeover: str = "") -> requests.Response:
        body: dict[str, object] = {"holder": self.holder, "ttl_s": TTL_S}
        if takeover:
            body["takeover"] = takeover
        return self._session.post(self.url, json=body, headers=self._headers, timeout=TIMEOUT_S)

    def renew(self) -> bool:
        self.refused_by = ""
        try:
            reply = self._post()
            if reply.status_code == 409:
                other = str(_json(reply).get("holder") or "")
                if other and gone_local_holder(other):
                    self._log(f"took over the supervisor's update lock from {other} (that process is gone)")
                    reply = self._post(takeover=other)
                elif other:
                    self.refused_by = other
            self.held = reply.status_code == 200
            if not self.held and not self._warned and not self.refused_by:
                self._warned = True
                self._log(f"the supervisor at {self.url} refused the update lock (HTTP {reply.status_code})")
        except requests.RequestException:
            self.held = False  # no supervisor yet (the first up), or the head is down: nothing to hold off
        return self.held

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(requests.RequestException):  # else the lease ends by itself
            self._session.delete(self.url, json={"holder": self.holder}, headers=self._headers, timeout=TIMEOUT_S)

    def _renew_until_stopped(self) -> None:
        due = time.monotonic() + self._renew_s
        while not self._stop.wait(min(ENGINE_CHECK_S, self._renew_s)):
            # An update whose CLI was killed leaves this process behind (the plugins run in their own process
            # groups): renewing on would hold the supervisor off, and the next up out, for as long as it lingers.
            if not self._engine_alive():
                self.release()
                # pulumi.log needs the engine that is gone: its error must not matter
                with contextlib.suppress(Exception):
                    self._log("the Pulumi engine of this update is gone: released the supervisor's update lock")
                return
            if time.monotonic() < due:
                continue
            due = time.monotonic() + self._renew_s
            if not self.renew() and self.refused_by:
                self._log(f"the supervisor's update lock was taken by {self.refused_by} while this update runs")

    def status_line(self) -> str | None:
        """The leader's state in one line (policy.summary), or None when it does not answer."""
        try:
            reply = self._session.get(
                self.url.removesuffix("/lock") + "/status", headers=self._headers, timeout=TIMEOUT_S
            )
            return policy.summary(reply.json(), time.time()) if reply.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None

    def start(self, report: Callable[[str], None] | None = None) -> UpdateLock:
        """Take the lock, renew it until the process ends; `report` gets the supervisor's state line.
        LockHeld when another live update holds it."""
        if not self.renew() and self.refused_by:
            raise LockHeld(
                f"another update holds the supervisor's lock on the head: {self.refused_by}. Wait for it to end "
                f"(its lease lasts {TTL_S:g} s after its last renewal), then run this again"
            )
        if self.held and report is not None and (line := self.status_line()):
            report(line)
        threading.Thread(target=self._renew_until_stopped, name="update-lock", daemon=True).start()
        atexit.register(self.release)
        return self

    def report(self, report: Callable[[str], None]) -> None:
        """A preview's view: the supervisor's state line, no lock taken."""
        if line := self.status_line():
            report(line)


def _json(reply: requests.Response) -> dict[str, object]:
    try:
        data = reply.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
