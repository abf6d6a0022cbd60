"""What clients can make the agent hold at once, and for how long (docs/SECURITY.md,
"Bounded requests"). Past a bound the answer is a 429 with ``Retry-After``, at once: no
request waits in a queue for room. None of it is shared with the agent's own work: its
pushes, and its own prefetches' reads, take no slot here and wait for no client.

- a request body: at most ``max_body_bytes`` (aiohttp's ``client_max_size``: 413), and it
  must arrive within BODY_SECONDS of the request's head (408);
- a request's head: within aiohttp's keep-alive timeout (75 s) of the connection or of the
  previous reply, else the connection is closed;
- prefetches queued or running at once: MAX_PREFETCHES (they are long: each holds a task,
  and a transfer's buffers while it runs);
- chunk requests in flight from one client (its address): CHUNK_REQUESTS_PER_CLIENT (an
  agent asks at most PEER_THREADS at once); a chunk's reply must be taken within
  SEND_SECONDS, else the connection is cut (a client that stops reading holds a 4 MiB
  reply, and its slot, no longer than that);
- long polls of prefetches (``GET /v1/prefetch/{id}?wait=``) in flight from one client:
  WAITS_PER_CLIENT, each held at most 30 s (routes/prefetch.py WAIT_SECONDS), and none
  beyond the start of the agent's stop.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

MAX_PREFETCHES = 64
CHUNK_REQUESTS_PER_CLIENT = 32  # 4 x agent.peers.chunks.PEER_THREADS
WAITS_PER_CLIENT = 2 * MAX_PREFETCHES  # a scheduler waiting on every prefetch, twice over
BODY_SECONDS = 30.0
SEND_SECONDS = 30.0
RETRY_AFTER_SECONDS = 1


class InFlight:
    """Requests in flight per client, each client at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        """Take a slot for ``client``; False: it has ``limit`` already."""
        held = self._held.get(client, 0)
        if held >= self.limit:
            return False
        self._held[client] = held + 1
        return True

    def leave(self, client: str) -> None:
        left = self._held.get(client, 0) - 1
        if left > 0:
            self._held[client] = left
        else:
            self._held.pop(client, None)

    def held(self) -> int:
        """Slots taken now, every client's."""
        return sum(self._held.values())


def too_many(message: str) -> web.Response:
    """A 429 in the RPC's error shape, with ``Retry-After``."""
    return web.json_response(
        {"error": message, "type": "TooManyRequests"},
        status=429,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


class DestLocks:
    """One pull at a time per destination: a lock per key while anyone holds or waits for
    it (then forgotten: an agent pulls into ever new directories)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: str, within: float) -> bool:
        """Hold ``key``'s lock (True), or not within ``within`` seconds (False)."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with asyncio.timeout(within):
                await lock.acquire()
        except TimeoutError:
            self._leave(key)
            return False
        except BaseException:  # (cancelled while waiting)
            self._leave(key)
            raise
        return True

    def release(self, key: str) -> None:
        self._locks[key][0].release()
        self._leave(key)

    def _leave(self, key: str) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
