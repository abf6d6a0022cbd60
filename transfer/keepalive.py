"""Blocking HTTP/1.1 connections kept per thread for the thread's next request.

The one home of the connection handling shared by the restore's S3 ranged reads
(store/s3ranges.py) and a prefetch's chunk requests to peer agents (agent/peerwire.py):
both receive bodies with ``readinto`` in worker threads, where the bytes land with the
GIL released, and both keep a connection only when its reply was read to its end. A
thread may hold several connections to one origin at once (a stream open, a read beside
it); each is given back when its reply is done, and used again by that thread only.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Callable
from urllib.parse import urlsplit


class KeptConnections:
    """Connections per (thread, origin); ``close`` ends all of them, from any thread."""

    def __init__(
        self,
        connect_timeout: float,
        tls: Callable[[], ssl.SSLContext] = ssl.create_default_context,
        *,
        reload_tls: bool = False,
    ) -> None:
        """``tls``: makes the context of https connections, once (at the first), or for
        each new connection with ``reload_tls`` (a context that changes: the agent's own,
        whose certificate rotates, agent/tls.py)."""
        self._connect_timeout = connect_timeout
        self._tls = tls
        self._reload_tls = reload_tls
        self._context: ssl.SSLContext | None = None  # made at the first https connection
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self, origin: str, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to ``origin`` (``http[s]://host[:port]``) for one request: one this
        thread kept, unless ``fresh``, else a new one; and whether it was kept. Connecting
        may raise TimeoutError or OSError."""
        idle = self._idle(origin)
        if idle and not fresh:
            return idle.pop(), True
        return self._connect(origin), False

    def give_back(self, origin: str, conn: http.client.HTTPConnection) -> None:
        """A connection whose reply was read to its end: kept for this thread's next."""
        self._idle(origin).append(conn)

    def drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def close(self) -> None:
        """Close every connection (a thread blocked on one then fails and returns)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    def count(self) -> int:
        """Connections open now, kept or in use."""
        with self._lock:
            return len(self._all)

    def _idle(self, origin: str) -> list[http.client.HTTPConnection]:
        by_origin: dict[str, list[http.client.HTTPConnection]] | None = getattr(
            self._local, "idle", None
        )
        if by_origin is None:
            by_origin = self._local.idle = {}
        return by_origin.setdefault(origin, [])

    def _connect(self, origin: str) -> http.client.HTTPConnection:
        url = urlsplit(origin)
        host, timeout = url.hostname or "localhost", self._connect_timeout
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            if self._context is None or self._reload_tls:
                self._context = self._tls()
            conn = http.client.HTTPSConnection(
                host, url.port, timeout=timeout, context=self._context
            )
        else:
            conn = http.client.HTTPConnection(host, url.port, timeout=timeout)
        conn.connect()
        with self._lock:
            self._all.append(conn)
        return conn
