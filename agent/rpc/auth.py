"""Who may call what on the agent's RPC (docs/SECURITY.md).

Two bearer tokens, each read from its file and read again when the file changes (its mtime,
size and inode, looked at per request: a rotated Secret takes effect without a restart):

* ``token_file``: the scheduler's and operator's token, good for every route;
* ``peer_token_file`` (optional): the token agents present to each other, good only for what
  peers read of each other: ``GET /v1/chunks/{id}`` (a prefetch's, a fan-out member's, a
  standby replication's and an estimate's probe's chunk requests; their health probes go to
  ``/healthz``, which needs no token). Any other route answers 403 to it.

Tokens are compared in constant time (``hmac.compare_digest``) and never logged: a file that
cannot be read after start-up is reported by its path, and the token it held stays in force.
"""

from __future__ import annotations

import enum
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.daemon.config import read_secret
from transfer.errors import FerryError

log = logging.getLogger(__name__)

_NOTHING = object()

#: (method, route) the peer token may call (``/healthz`` needs no token at all)
PEER_ROUTES = frozenset({("GET", "/v1/chunks/{id}"), ("HEAD", "/v1/chunks/{id}")})


class Scope(enum.Enum):
    ALL = "all"  # token_file's token
    PEER = "peer"  # peer_token_file's


class SecretFile:
    """A token held in a file: read at once (a failure raises ConfigError), then read again
    whenever the file's stat changes; a failure then keeps the token read last."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self._lock = threading.Lock()
        self._stamp = _stamp(path)
        self._value = read_secret(path, key)
        self._failed: object = _NOTHING  # the stat of a change that did not read

    def value(self) -> str:
        stamp = _stamp(self.path)
        if stamp == self._stamp or stamp == self._failed:
            return self._value
        with self._lock:
            if stamp != self._stamp and stamp != self._failed:
                try:
                    self._value = read_secret(self.path, self.key)
                except FerryError as exc:  # a rotation half done: keep the old token
                    self._failed = stamp
                    log.warning("%s changed but cannot be used (%s): the previous token stays "
                                "in force", self.key, exc)  # fmt: skip
                else:
                    self._stamp, self._failed = stamp, None
                    log.info("%s changed: its new token is in force", self.key)
            return self._value


class Credentials:
    """The agent's tokens: which scope a request's ``Authorization`` header has, and the
    token this agent presents to its peers."""

    def __init__(self, main: SecretFile | str, peer: SecretFile | None = None) -> None:
        self._main = main
        self._peer = peer

    def main(self) -> str:
        return self._main if isinstance(self._main, str) else self._main.value()

    def scope(self, authorization: str) -> Scope | None:
        """The scope ``authorization`` (a request's header) grants; None: none (no bearer
        token, or a wrong one). Both tokens are compared, each in constant time."""
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        offered = given.encode()
        is_main = hmac.compare_digest(offered, self.main().encode())
        is_peer = self._peer is not None and hmac.compare_digest(
            offered, self._peer.value().encode()
        )
        if is_main:
            return Scope.ALL
        return Scope.PEER if is_peer else None

    def for_peers(self) -> str:
        """The token to present to peers: the peer token when configured, else the main."""
        return self._peer.value() if self._peer is not None else self.main()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class Refusals:
    """Calls refused for who made them (no or a wrong token, no client certificate, the
    peer token on another route), logged: one line per client address per ``window``
    seconds, with how many were not logged since; an operator sees them, a client trying
    tokens does not flood the log. Never the token itself."""

    #: addresses remembered at most (then forgotten all at once: a line more, no growth)
    MAX_CLIENTS = 4096

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.clock = window, clock
        self._last: dict[str, tuple[float, int]] = {}  # address -> (logged at, not since)

    def refused(self, method: str, path: str, client: str, status: int, why: str) -> None:
        now = self.clock()
        logged_at, quiet = self._last.get(client, (-math.inf, 0))
        if now - logged_at < self.window:
            self._last[client] = (logged_at, quiet + 1)
            return
        if len(self._last) >= self.MAX_CLIENTS:
            self._last.clear()
        self._last[client] = (now, 0)
        more = f" ({quiet} more refused since the last line)" if quiet else ""
        log.warning("refused %s %s from %s: %d, %s%s", method, path, client, status, why, more)
