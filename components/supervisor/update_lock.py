"""The lock an update holds on the head's supervisor: while a `pulumi up` or `preview` of the stack runs, the
supervisor leaves every rank to it (a rank the update stops is not a rank to heal).

The program takes it when it starts and renews it while it runs (a lease: a crashed update's lock ends
`TTL_S` after its last renewal) and releases it when the program's process ends, also on failure. Before the
supervisor exists (the first up) there is nothing to lock; failures to reach it are reported once, never fatal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable

import requests

from components.supervisor import policy

TTL_S = 90.0
RENEW_S = 20.0
TIMEOUT_S = 5.0


def holder_name(stack: str, dry_run: bool) -> str:
    return f"pulumi {'preview' if dry_run else 'up'} of {stack} from {socket.gethostname()} pid {os.getpid()}"


class UpdateLock:
    def __init__(
        self,
        url: str,
        token: str,
        holder: str,
        *,
        log: Callable[[str], None] = print,
        session: requests.Session | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/lock"
        self.holder = holder
        self._headers = {"Authorization": f"Bearer {token}"}
        self._log = log
        self._session = session or requests.Session()
        self._stop = threading.Event()
        self._warned = False
        self.held = False

    def renew(self) -> bool:
        try:
            reply = self._session.post(
                self.url, json={"holder": self.holder, "ttl_s": TTL_S}, headers=self._headers, timeout=TIMEOUT_S
            )
            self.held = reply.status_code == 200
            if not self.held and not self._warned:
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
        while not self._stop.wait(RENEW_S):
            self.renew()

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
        """Take the lock, renew it until the process ends; `report` gets the supervisor's state line."""
        if self.renew() and report is not None and (line := self.status_line()):
            report(line)
        threading.Thread(target=self._renew_until_stopped, name="update-lock", daemon=True).start()
        atexit.register(self.release)
        return self
