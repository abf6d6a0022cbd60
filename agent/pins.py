"""Pins set on this agent through the RPC: (job, step) -> expiry. The hot dir's retention
keeps a pinned step, and the checkpoint listing shows it; each tier's store holds its own
copy of the pin (transfer.retention.pin), so that no node's retention deletes it there. In
memory: a restart forgets them here, while the store pins expire on their own."""

from __future__ import annotations

import time

Key = tuple[str, int]  # (job, step)


class LocalPins:
    def __init__(self) -> None:
        self._expiry: dict[Key, float] = {}

    def pin(self, job: str, step: int, ttl: float) -> float:
        """Pin for ``ttl`` seconds from now; returns the expiry (epoch seconds)."""
        expiry = self._expiry[(job, step)] = time.time() + ttl
        return expiry

    def unpin(self, job: str, step: int) -> None:
        self._expiry.pop((job, step), None)

    def pinned(self, job: str, step: int) -> bool:
        expiry = self._expiry.get((job, step))
        return expiry is not None and expiry > time.time()

    def active(self) -> set[Key]:
        now = time.time()
        return {key for key, expiry in self._expiry.items() if expiry > now}
