"""plan_ranges (transfer/engine/memrestore.py): the chunks a restore of some byte ranges
needs, found by bisection, are exactly those a walk over every chunk finds; the plan carries
its chunks' delta bases and survives the trip to another rank (pickled in DCP's plan)."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from transfer.engine.memrestore import StepChunks, plan_ranges
from transfer.errors import FerryError
from transfer.format.chunkid import chunk_id
from transfer.format.manifest import ChunkRef, FileEntry, Manifest

PACK = "0" * 32


def manifest(sizes: dict[str, list[int]], bases: bool = False) -> Manifest:
    """A step whose files have chunks of the given sizes, each chunk's id unique (and, with
    ``bases``, every chunk a delta against a base chunk listed in the manifest)."""
    files, base_refs = [], []
    for path, chunk_sizes in sizes.items():
        refs = []
        for i, size in enumerate(chunk_sizes):
            cid = chunk_id(f"{path}:{i}".encode())
            base = None
            if bases:
                base = chunk_id(f"base {path}:{i}".encode())
                base_refs.append(ChunkRef(base, size, "zstd", 0, 0, 1))
            refs.append(ChunkRef(cid, size, "xor+zstd" if bases else "zstd", 0, 0, 1, base))
        files.append(FileEntry(path, sum(chunk_sizes), 0o644, tuple(refs)))
    return Manifest("j", 7, "n0", "2026-12-06T00:00:00+00:00", 1 << 20, (PACK,),
                    tuple(files), tuple(base_refs))  # fmt: skip


def walk(m: Manifest, wanted: dict[str, list[tuple[int, int]]]) -> set[tuple[str, int]]:
    out = set()
    for f in m.files:
        for offset, c in f.chunk_offsets():
            if any(offset < hi and offset + c.size > lo for lo, hi in wanted.get(f.path, [])):
                out.add((f.path, offset))
    return out


def test_bisection_finds_what_a_walk_over_every_chunk_finds() -> None:
    rng = random.Random(3)
    for _ in range(200):
        sizes = {f"f{k}": [rng.randint(1, 50) for _ in range(rng.randint(1, 12))] for k in range(3)}
        m = manifest(sizes)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for path, chunk_sizes in sizes.items():
            total, cuts = sum(chunk_sizes), []
            for _ in range(rng.randint(0, 3)):
                lo = rng.randint(0, total)
                cuts.append((lo, rng.randint(lo, total)))
            spans = sorted(c for c in cuts if c[1] > c[0])
            merged: list[tuple[int, int]] = []
            for lo, hi in spans:
                if merged and lo <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
                else:
                    merged.append((lo, hi))
            if merged:
                wanted[path] = merged
        plan = plan_ranges(StepChunks([m]), wanted)
        got = {pos for positions in plan.targets.values() for pos in positions}
        assert got == walk(m, wanted), (sizes, wanted)
        assert plan.bytes_raw == sum(
            c.size for f in m.files for o, c in f.chunk_offsets() if (f.path, o) in got
        )


def test_a_plan_carries_its_bases_and_travels_pickled() -> None:
    m = manifest({"a": [10, 10, 10], "b": [5]}, bases=True)
    plan = plan_ranges(StepChunks([m]), {"a": [(12, 15)]})
    assert [pos for ps in plan.targets.values() for pos in ps] == [("a", 10)]
    target = next(iter(plan.targets))
    assert {c.id for c in plan.chunks} == {target, plan.index()[target].base}  # and no more
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.index()[target] == plan.index()[target]
    # the pickled form is cached: a plan is frozen, and a changed copy pickles as changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.step = 8  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(dataclasses.replace(plan, step=8))).step == 8


def test_a_range_the_step_lacks_is_refused() -> None:
    step = StepChunks([manifest({"a": [10]})])
    with pytest.raises(FerryError, match="has no file 'z'"):
        plan_ranges(step, {"z": [(0, 1)]})
    with pytest.raises(FerryError, match="a range ends at 11"):
        plan_ranges(step, {"a": [(0, 11)]})
