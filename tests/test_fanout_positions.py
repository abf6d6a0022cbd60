"""Owners by position in a fan-out group whose members prefetch different shares: each
member computes them from every member's share (byte ranges, from ``.metadata``) and its
own chunks' positions alone, never from the other members' chunks, and still every member
agrees: whoever is asked for a chunk fetches it itself (no member waits on one that waits
in turn), and a chunk at one position is fetched by one member of the group."""

from __future__ import annotations

import random
from collections import Counter

from agent.peers.fanout import owner_of, position_owners
from transfer.engine.pull import chunk_positions
from transfer.engine.share import Share
from transfer.format.manifest import ChunkRef, FileEntry

CHUNK = 100


def step_files(rng: random.Random, nfiles: int, repeats: int) -> list[FileEntry]:
    """Storage files of 10-40 chunks; ``repeats`` chunk ids recur at several positions (a
    deduplicated tensor, as in real saves), in one file or across files."""
    shared = [f"dup{i}" for i in range(repeats)]
    files = []
    for fi in range(nfiles):
        n = rng.randint(10, 40)
        ids = [
            rng.choice(shared) if shared and rng.random() < 0.2 else f"f{fi}c{i}" for i in range(n)
        ]
        chunks = tuple(ChunkRef(cid, CHUNK, "raw", 0, 0, CHUNK) for cid in ids)
        files.append(FileEntry(f"__{fi}_0.distcp", n * CHUNK, 0o644, chunks))
    return files


def random_share(rng: random.Random, files: list[FileEntry]) -> Share:
    ranges: dict[str, tuple[tuple[int, int], ...]] = {}
    for f in rng.sample(files, rng.randint(1, len(files))):
        lo = rng.randrange(0, f.size - 1)
        hi = rng.randint(lo + 1, f.size)
        ranges[f.path] = ((lo, hi),)
    return Share(ranges, frozenset(f.path for f in files), None)


def test_every_member_agrees_and_no_ask_waits_on_another() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        files = step_files(rng, rng.randint(1, 5), repeats=rng.randint(0, 4))
        members = tuple(f"http://n{i}" for i in range(rng.randint(2, 9)))
        shares: dict[str, Share | None] = {m: random_share(rng, files) for m in members}
        if rng.random() < 0.3:
            shares[members[-1]] = None  # a member prefetching the whole step
        live = tuple(m for m in members if m == members[0] or rng.random() < 0.9)
        owners = {}
        for me in live:
            mine = chunk_positions(files, shares[me])
            owners[me] = position_owners(mine, shares, live, me)
            assert set(owners[me]) == set(mine)
        fetchers: Counter[str] = Counter()
        for me in live:
            for cid, owner in owners[me].items():
                assert owner in live, (seed, cid, owner)
                if owner == me:
                    fetchers[cid] += 1
                else:  # asked: it fetches the chunk itself, it waits on nobody
                    assert owners[owner][cid] == owner, (seed, me, cid, owner)
        for cid, positions in chunk_positions(files, None).items():
            wanted_by = [m for m in live if cid in owners[m]]
            if len(positions) == 1 and wanted_by:  # one position: one fetch in the group
                assert fetchers[cid] == 1, (seed, cid, wanted_by)


def test_a_position_is_owned_by_a_member_whose_share_covers_it() -> None:
    """Two members, two halves of one file and an overlap: the chunks of the first half
    are n0's, of the second n1's, of the overlap either (the same on both)."""
    (f,) = step_files(random.Random(1), 1, repeats=0)
    half = f.size // 2
    shares: dict[str, Share | None] = {
        "a": Share({f.path: ((0, half + CHUNK),)}, frozenset([f.path]), None),
        "b": Share({f.path: ((half, f.size),)}, frozenset([f.path]), None),
    }
    mine_a = position_owners(chunk_positions([f], shares["a"]), shares, ("a", "b"), "a")
    mine_b = position_owners(chunk_positions([f], shares["b"]), shares, ("a", "b"), "b")
    for at, c in f.chunk_offsets():
        if at + CHUNK <= half:
            assert mine_a[c.id] == "a"
        elif at >= half + CHUNK:
            assert mine_b[c.id] == "b"
        else:
            assert mine_a[c.id] == mine_b[c.id] == owner_of(f"{f.path}@{at}", ("a", "b"))


def test_a_dead_member_owns_nothing_and_files_outside_storage_are_everyones() -> None:
    (f,) = step_files(random.Random(2), 1, repeats=0)
    meta = FileEntry(".metadata", CHUNK, 0o644, (ChunkRef("meta", CHUNK, "raw", 0, 0, CHUNK),))
    whole = Share({f.path: ((0, f.size),)}, frozenset([f.path]), None)
    shares: dict[str, Share | None] = {"a": whole, "b": whole, "c": whole}
    positions = chunk_positions([meta, f], whole)
    assert "meta" in positions  # (outside storage: whole in every share)
    owners = position_owners(positions, shares, ("a", "b"), "a")  # c is down
    assert set(owners.values()) == {"a", "b"}
    assert owners["meta"] == owner_of(".metadata@0", ("a", "b"))


def test_the_common_index_is_nobodys_part() -> None:
    """A share reads the step's common index (the items every rank reads, stored once)
    beside its parts: its node name, "(common index)", sorts before every node's, and
    was taken for the holder of each file it has items of (no member is that node: those
    chunks went to the split) and for their owner (asked of every peer in turn)."""
    from agent.peers.chunks import chunk_owners, file_holders
    from transfer.format.manifest import Manifest
    from transfer.format.stepcommon import COMMON_NODE

    shared = ChunkRef("item", CHUNK, "raw", 0, 0, CHUNK)
    own = ChunkRef("rows", CHUNK, "raw", 0, 0, CHUNK)

    def part(node: str, *chunks: ChunkRef) -> Manifest:
        entry = FileEntry("__3_0.distcp", CHUNK * len(chunks), 0o644, chunks)
        return Manifest("llm", 10, node, "2026-12-07T00:00:00Z", CHUNK, (), (entry,))

    parts = [part(COMMON_NODE, shared), part("n3", own, shared)]
    assert file_holders(parts) == {"__3_0.distcp": "n3"}
    assert chunk_owners(parts) == {"rows": "n3", "item": "n3"}
