"""A chunk from a peer agent, received off the event loop.

Why not aiohttp here (it serves the routes, and the health checks): a prefetch served by a
peer received every byte on the event loop's thread, in 1 MiB pieces appended to a
growing buffer, then hopped to a worker to decode. With the peer on loopback that loop
was the busiest thread of the prefetch (py-spy: 55% of its samples in the receive path),
and the prefetch of the corpus's 1.69 GB save took 2x the same prefetch from the tier.
Here each worker thread keeps a keep-alive ``http.client`` connection per peer
(transfer/keepalive.py) and receives the reply with ``readinto`` into a buffer it reuses,
GIL released, then decodes in the same thread; the loop only waits for the result.

Failures are returned as None or raised as the few types ``PeerSource`` counts as "peer
down" (OSError, TimeoutError, http.client.HTTPException): a confused or unreachable peer
costs time, never correctness (the receiver checks every chunk's hash).
"""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Callable
from urllib.parse import urlencode

from transfer.codec.encodings import RAW
from transfer.directio import ThreadBuffers
from transfer.keepalive import KeptConnections

#: the encoding of a chunk route's body (absent: raw, as agents before 2026-11 sent)
ENCODING_HEADER = "X-Ferry-Encoding"
#: bytes read from a refused reply before its connection goes back for reuse
_ERROR_BODY_MAX = 64 << 10


class PeerWire:
    """GETs of ``/v1/chunks/{id}`` from peers, callable from many threads at once.
    ``token``: the bearer token (a callable: asked per request, so a rotated token takes
    effect); ``tls``: the context of each new https connection (asked per connection, so a
    rotated certificate does too; default: the system store's verification)."""

    def __init__(
        self,
        token: str | Callable[[], str],
        connect_timeout: float = 2.0,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self._token = token if callable(token) else (lambda: token)
        self._conns = (
            KeptConnections(connect_timeout, tls, reload_tls=True)
            if tls is not None
            else KeptConnections(connect_timeout)
        )
        self._buffers = ThreadBuffers()  # each thread's receive buffer

    def get_chunk(
        self, peer: str, cid: str, query: dict[str, str], most: int, timeout: float
    ) -> tuple[str, memoryview] | None:
        """(encoding, payload) of chunk ``cid`` from ``peer``, or None when the peer does
        not have it (or sends more than ``most`` bytes). The payload is a view of this
        thread's buffer: valid until the thread's next call."""
        path = f"/v1/chunks/{cid}" + (f"?{urlencode(query)}" if query else "")
        for fresh in (False, True):  # a kept connection the peer closed: once more, anew
            conn, reused = self._conns.take(peer, fresh)
            try:
                assert conn.sock is not None
                conn.sock.settimeout(timeout)
                conn.request("GET", path, headers={"Authorization": f"Bearer {self._token()}"})
                reply = conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                self._drop(conn)
                if reused:
                    continue
                raise
            except BaseException:
                self._drop(conn)
                raise
            return self._payload(peer, conn, reply, most)
        raise AssertionError("unreachable")

    def _payload(
        self,
        peer: str,
        conn: http.client.HTTPConnection,
        reply: http.client.HTTPResponse,
        most: int,
    ) -> tuple[str, memoryview] | None:
        try:
            if reply.status != 200:
                reply.read(_ERROR_BODY_MAX)
                self._keep_if_done(peer, conn, reply)
                return None
            length = reply.length
            if length is None or length > most:  # never buffer more than a chunk
                self._drop(conn)
                return None
            view = self._buffers.view("body", length)
            got = 0
            while got < length:
                n = reply.readinto(view[got:])
                if not n:
                    break
                got += n
            if got < length:
                self._drop(conn)
                raise http.client.IncompleteRead(bytes(view[:got]), length - got)
            self._keep_if_done(peer, conn, reply)
            return reply.getheader(ENCODING_HEADER, RAW), view
        except BaseException:
            self._drop(conn)
            raise

    # -- connections and buffers kept per thread -----------------------------------------

    def _keep_if_done(
        self, peer: str, conn: http.client.HTTPConnection, reply: http.client.HTTPResponse
    ) -> None:
        if (reply.isclosed() or reply.read(1) == b"") and not reply.will_close:
            self._conns.give_back(peer, conn)
            return
        self._drop(conn)

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        self._conns.drop(conn)

    def close(self) -> None:
        """Close every connection (a thread blocked on one then fails and returns)."""
        self._conns.close()
