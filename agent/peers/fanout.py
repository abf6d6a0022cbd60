"""Fan-out restore: N agents prefetching one step at once read it about once from the store.

The scheduler names the group in each agent's prefetch (``fanout: {members, me}``: every
member's agent URL, and which one is this agent). Each chunk has one owner in the group,
chosen by rendezvous hashing of (chunk id, member URL), so every member computes the same
split with no coordinator. A member fetches the chunks it owns from the tiers, and serves
each to the others as soon as it has written and verified it (``Landing``: the chunk route
looks there before the hot dir); for every other chunk it asks the owner, who holds the
request up to ``WAIT_SECONDS`` for the chunk to land. Whatever an owner cannot deliver in
time (not in the group after all, slow, down, bad bytes) comes from the tiers, so a member
that drops out costs time, never correctness; every chunk is hash-checked on arrival.

Members may prefetch different shares of the step (``fanout.layouts``: each member's layout,
the same map sent to every member): each computes every member's share from the step's
``.metadata``, and a chunk's owner is chosen among the members whose share needs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Collection, Iterable, Mapping

from agent.peers.chunks import PeerSource
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.sources import Land, LocalBase, Location, Supplied

#: how long an owner holds a peer's request for a chunk it is still fetching
WAIT_SECONDS = 30.0
_POLL_SECONDS = 0.02
_GRACE_SECONDS = 3.0


def owner_of(cid: str, members: tuple[str, ...]) -> str:
    """The member that fetches ``cid`` from the tiers (rendezvous hashing: adding or
    removing a member moves only that member's share)."""
    return max(members, key=lambda m: _score(cid, m))


def _score(cid: str, member: str) -> bytes:
    return hashlib.blake2b(f"{cid}|{member}".encode(), digest_size=8).digest()


class Landing:
    """Chunks of the restores running on this node: which are expected, and where each one
    landed (written and verified in a staging file). Written from the restores' worker
    threads, read by the chunk route."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, int] = {}  # chunk id -> restores expecting it
        self._where: dict[str, Location] = {}
        self._fanouts = 0  # fan-out prefetches submitted here and not finished

    def begin(self) -> None:
        """A fan-out prefetch was submitted: peers' requests may come before it expects
        its chunks, and are held for a grace period."""
        with self._lock:
            self._fanouts += 1

    def end(self) -> None:
        with self._lock:
            self._fanouts -= 1

    def expect(self, ids: Iterable[str]) -> None:
        with self._lock:
            for cid in ids:
                self._expected[cid] = self._expected.get(cid, 0) + 1

    def release(self, ids: Iterable[str]) -> None:
        """The restore ended (its staging dir is renamed or gone): forget its chunks."""
        with self._lock:
            for cid in ids:
                left = self._expected.get(cid, 0) - 1
                if left > 0:
                    self._expected[cid] = left
                else:
                    self._expected.pop(cid, None)
                    self._where.pop(cid, None)

    def land(self, cid: str, where: Location) -> None:
        with self._lock:
            if cid in self._expected:
                self._where.setdefault(cid, where)

    def where(self, cid: str) -> Location | None:
        with self._lock:
            return self._where.get(cid)

    async def wait(self, cid: str, seconds: float) -> Location | None:
        """Where ``cid`` landed, waiting up to ``seconds`` while a restore here expects it
        (and, while a fan-out prefetch was submitted here, up to ``_GRACE_SECONDS`` for it
        to start expecting it: the members of a group start at about the same time, not in
        lockstep)."""
        began = time.monotonic()
        while True:
            with self._lock:
                where, expected = self._where.get(cid), cid in self._expected
            waited = time.monotonic() - began
            if (
                where is not None
                or waited >= seconds
                or (not expected and waited >= _GRACE_SECONDS)
            ):
                return where
            await asyncio.sleep(_POLL_SECONDS)


class FanoutSource:
    """The chunk source of one fan-out prefetch: a chunk another member owns is asked of
    that member, who waits for it to land; one this member owns is left to the tiers.
    Members that do not answer a health probe at the start are left out of the split (all
    members probe at about the same time, so they agree); one that fails later costs the
    others its remaining share from the tiers."""

    def __init__(
        self,
        peers: PeerSource,
        members: tuple[str, ...],
        me: str,
        needs: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        self.peers = peers
        self.members = members
        self.me = me
        self.live = members
        #: members prefetching a share (layouts): the chunks each one's share needs; a
        #: chunk's owner is chosen among the live members that need it, so members with
        #: different layouts still read each chunk once from the tiers in all
        self.needs = needs or {}

    async def probe(self) -> None:
        others = [m for m in self.members if m != self.me]
        up = await asyncio.gather(*(self.peers.alive(m) for m in others))
        down = {m for m, ok in zip(others, up, strict=True) if not ok}
        self.live = tuple(m for m in self.members if m not in down)

    def owner(self, cid: str) -> str:
        wanting = tuple(m for m in self.live if m not in self.needs or cid in self.needs[m])
        return owner_of(cid, wanting or self.live)

    def mine(self, cid: str) -> bool:
        return self.owner(cid) == self.me

    async def __call__(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None:
        owner = self.owner(chunk.id)
        if owner == self.me:
            return None
        return await self.peers.ask(owner, chunk, base, wait=WAIT_SECONDS, land=land)
