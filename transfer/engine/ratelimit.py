"""A byte-rate cap for background transfers (a standby's replication must not starve the
training job's own traffic): each read reserves its bytes and waits its turn, so the
average rate stays at or under the cap whatever the number of threads."""

from __future__ import annotations

import asyncio
import threading
import time


class RateLimit:
    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError("a rate limit must be a positive number of bytes per second")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time when every reservation so far has passed

    def reserve(self, nbytes: int) -> float:
        """Seconds to wait before moving ``nbytes`` (thread-safe): until the bytes of every
        reservation so far, these included, would have moved at the cap. So however few and
        large the reads, a transfer never averages more than the cap, its first read
        included (a background transfer gives up the burst)."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_s
            return self._free_at - now

    def take(self, nbytes: int) -> None:
        """Block this thread until ``nbytes`` may move."""
        time.sleep(self.reserve(nbytes))

    async def wait(self, nbytes: int) -> None:
        await asyncio.sleep(self.reserve(nbytes))
