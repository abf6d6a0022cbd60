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
``.metadata`` (byte ranges of its files: no part's manifest needed), and owners are chosen
by position instead: each chunk position (file, offset) a member writes has one owner among
the members whose share covers it, by rendezvous hashing of the position. A member fetches
a chunk itself when it owns one of the chunk's positions in its share, else asks the owner
of its first one, who owns that position and so fetches the chunk itself, or holds it already
(its own part of the step, which it serves from there): no member waits on one that waits in
turn. Each member thus plans from its own share's parts (the step's
file map finds them), not from every part of the step.

Before any of that, a chunk in a file another live member holds (the part its node wrote:
each part's manifest names the node, each member's /healthz its own) is asked of that
member, without a wait: after a scale-down the survivors still hold their own parts, which
the split alone would read from the tiers again. The probe asks each such member whether it
holds the file (a HEAD of one of its chunks, once per member and file): a member named as
a part's node may have lost it (a wiped disk, hot retention), and a chunk this member owns
must then go to the tiers at once, not after the chunks it waits for from the others (who
may be waiting for it). The split itself is unchanged: a member need not know what another
holds for all to agree on it. A holder that fails an ask later (it lost the file, or did not
answer) is not asked for that file again: the rest of the file goes the split's way, this
member's own chunks of it fetched from the tiers one by one.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping

from agent.peers.chunks import PeerSource
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.share import Share
from transfer.engine.sources import Land, LocalBase, Location, Supplied

#: how long an owner holds a peer's request for a chunk it is still fetching
WAIT_SECONDS = 30.0
_POLL_SECONDS = 0.02
_GRACE_SECONDS = 3.0
#: the probe's HEADs in flight at once (a peer counts a client's chunk requests: 32 at most)
HOLDS_AT_ONCE = 8


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

    async def wait(
        self,
        cid: str,
        seconds: float,
        locate: Callable[[], Awaitable[Location | None]] | None = None,
    ) -> Location | None:
        """Where ``cid`` landed, waiting up to ``seconds`` while a restore here expects it
        (and, one not expected, up to ``_GRACE_SECONDS`` for a restore to start expecting
        it: the members of a group start at about the same time, not in lockstep, and an
        asker may come before this member's own prefetch was even submitted). Once a
        restore that expected it has ended (its last chunks land moments before it ends,
        often between two looks), where ``locate`` (the hot index) finds it as the step is
        put in place, looked up every ``_POLL_SECONDS`` x 5, for up to the grace: the wait
        sat the whole grace out, 3 s for each member asking for a restore's last chunks."""
        began = time.monotonic()
        was_expected = False
        while True:
            with self._lock:
                where, expected = self._where.get(cid), cid in self._expected
            waited = time.monotonic() - began
            if where is not None or waited >= seconds:
                return where
            if not expected and was_expected:
                return await self._placed(locate, min(_GRACE_SECONDS, seconds - waited))
            if not expected and waited >= _GRACE_SECONDS:
                return None
            was_expected = was_expected or expected
            await asyncio.sleep(_POLL_SECONDS)

    @staticmethod
    async def _placed(
        locate: Callable[[], Awaitable[Location | None]] | None, seconds: float
    ) -> Location | None:
        """Where ``locate`` finds the chunk within ``seconds`` (None without one)."""
        if locate is None:
            return None
        until = time.monotonic() + seconds
        while True:
            where = await locate()
            if where is not None or time.monotonic() >= until:
                return where
            await asyncio.sleep(_POLL_SECONDS * 5)


#: where a member writes each of its chunks: chunk id -> (path, offset, size) of each position
Positions = Mapping[str, list[tuple[str, int, int]]]


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
        shares: Mapping[str, Share | None] | None = None,
        positions: Positions | None = None,
        holders: Mapping[str, str] | None = None,
    ) -> None:
        self.peers = peers
        self.members = members
        self.me = me
        self.live = members
        #: members prefetching a share (layouts): each one's share (None or absent: the
        #: whole step), and where this member writes its chunks: owners are then chosen by
        #: position (position_owners), so members with different layouts still read each
        #: chunk about once from the tiers in all
        self.shares = shares or {}
        self.positions = positions or {}
        #: file path -> the node whose part holds it (chunks.file_holders)
        self.holders = holders or {}
        self._owners: dict[str, str] = {}
        #: chunk id -> (member, file): another live member holding a file the chunk is in
        self._held_by: dict[str, tuple[str, str]] = {}
        self._not_held: set[tuple[str, str]] = set()  # (member, file): asked, not there

    async def probe(self) -> None:
        others = [m for m in self.members if m != self.me]
        up = await asyncio.gather(*(self.peers.alive(m) for m in others))
        down = {m for m, ok in zip(others, up, strict=True) if not ok}
        self.live = tuple(m for m in self.members if m not in down)
        if self.shares:  # (off the loop: a large share has many positions)
            self._owners = await asyncio.to_thread(
                position_owners, self.positions, self.shares, self.live, self.me
            )
        self._held_by = await self._confirmed(
            held_elsewhere(self.positions, self._holding_members(), self.me)
        )

    async def _confirmed(self, held: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
        """Of ``held``, the chunks whose holder says it holds their file: one of the file's
        chunks asked of it (a HEAD: nothing read or sent), once per (member, file). A
        member named as the node that wrote a part may not hold it (a wiped disk, hot
        retention): a chunk left to the split must be fetched by its owner at once, not
        after asking a holder that does not have it."""
        sample = {pair: cid for cid, pair in held.items()}
        pairs = list(sample)
        gate = asyncio.Semaphore(HOLDS_AT_ONCE)

        async def holds(member: str, cid: str) -> bool:
            async with gate:
                return await self.peers.holds(member, cid)

        answers = await asyncio.gather(*(holds(m, sample[(m, f)]) for m, f in pairs))
        holding = {pair for pair, yes in zip(pairs, answers, strict=True) if yes}
        return {cid: pair for cid, pair in held.items() if pair in holding}

    def _holding_members(self) -> dict[str, str]:
        """File path -> the live member on the node whose part holds it (the others' nodes
        as their /healthz named them in the probe, this one's by its config)."""
        nodes = {m: self.peers.node if m == self.me else self.peers.node_of(m) for m in self.live}
        member_of_node = {node: m for m, node in nodes.items() if node is not None}
        return {
            path: member_of_node[node]
            for path, node in self.holders.items()
            if node in member_of_node
        }

    def owner(self, cid: str) -> str:
        return self._owners.get(cid) or owner_of(cid, self.live)

    def mine(self, cid: str) -> bool:
        """This member reads the chunk from the tiers at once (it owns the chunk, and no
        other member holds it: or none that answered for it)."""
        return self.owner(cid) == self.me and self._holder(cid) is None

    def held(self, cid: str) -> bool:
        """Another member holds the chunk: asked of it first, answered without a wait."""
        return self._holder(cid) is not None

    def _holder(self, cid: str) -> tuple[str, str] | None:
        held = self._held_by.get(cid)
        return None if held is None or held in self._not_held else held

    async def __call__(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None:
        if (held := self._holder(chunk.id)) is not None:
            # it serves the chunk from its part at once, or does not have the file
            got = await self.peers.ask(held[0], chunk, base, land=land)
            if got is not None:
                return got
            self._not_held.add(held)
        owner = self.owner(chunk.id)
        if owner == self.me:
            return None
        return await self.peers.ask(owner, chunk, base, wait=WAIT_SECONDS, land=land)


def held_elsewhere(
    positions: Positions, holding: Mapping[str, str], me: str
) -> dict[str, tuple[str, str]]:
    """Chunk id -> (member, file) for each chunk in a file another member holds
    (``holding``: file path -> member), the first such position's; none for a chunk in a
    file this member holds (it reads it from its own part)."""
    held: dict[str, tuple[str, str]] = {}
    for cid, where in positions.items():
        members = [(holding[path], path) for path, _, _ in where if path in holding]
        if members and all(member != me for member, _ in members):
            held[cid] = members[0]
    return held


def position_owners(
    positions: Positions, shares: Mapping[str, Share | None], live: tuple[str, ...], me: str
) -> dict[str, str]:
    """The owner of each of this member's chunks (``positions``): this member, where it
    owns one of the chunk's positions, else the owner of the first. A position's owner is
    chosen among the live members whose share covers it (a member whose share is None,
    or that ``shares`` does not name, wants the whole step; a file outside DCP's storage
    is whole in every share), by rendezvous hashing of the position; every member computes
    the same for the positions it shares with another."""
    whole = [m for m in live if shares.get(m) is None]
    storage = next((s.storage for s in shares.values() if s is not None), frozenset())
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for member in live:
        share = shares.get(member)
        for path, ranges in ({} if share is None else share.ranges).items():
            spans[path] += [(lo, hi, member) for lo, hi in ranges]
    mine: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # path -> (at, end, cid)
    for cid, where in positions.items():
        for path, at, size in where:
            mine[path].append((at, at + size, cid))
    owner_at: dict[tuple[str, int], str] = {}
    for path, here in mine.items():
        if path not in storage:
            for at, _, _ in here:
                owner_at[(path, at)] = owner_of(f"{path}@{at}", live)
            continue
        for at, wanting in _covering(sorted(here), spans[path]):
            group = (*whole, *wanting) or (me,)  # (me: a position of a wider ask, mine alone)
            owner_at[(path, at)] = owner_of(f"{path}@{at}", group)
    owners = {}
    for cid, where in positions.items():
        owned = [owner_at[(path, at)] for path, at, _ in where]
        owners[cid] = me if me in owned else owned[0]
    return owners


def _covering(
    here: list[tuple[int, int, str]], spans: list[tuple[int, int, str]]
) -> Iterable[tuple[int, tuple[str, ...]]]:
    """For each of the sorted positions ``here`` (at, end, _): its offset, and the members
    one of whose ``spans`` (lo, hi, member) overlaps it (a sweep: each span is pushed and
    popped once)."""
    spans = sorted(spans)
    active: list[tuple[int, str]] = []  # (hi, member), the smallest hi first
    i = 0
    for at, end, _ in here:
        while i < len(spans) and spans[i][0] < end:
            heapq.heappush(active, (spans[i][1], spans[i][2]))
            i += 1
        while active and active[0][0] <= at:
            heapq.heappop(active)
        yield at, tuple(sorted({member for _, member in active}))
