"""A survivor's share of an N-node step reads the manifests of the parts it touches, not N:
the completion marker maps each file to its part (format/stepfiles.py), and a prefetch,
an estimate and ``ferry pull --items`` of a share read only ``.metadata``'s part and the
parts holding the share's files (and its base step's parts holding the same files).
Without a map, or with one the parts contradict, every part is read, as before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy, State
from tests.conftest import open_test_store
from tests.fake_dcp import dcp_metadata
from transfer.engine import PushPlan, push
from transfer.engine.catalog import Catalog
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.format import layout
from transfer.options import TransferOptions
from transfer.store.base import Store

JOB, N = "llm", 6
NODES = tuple(f"n{r}" for r in range(N))
SIZES = {f"__{r}_0.distcp": 40_000 + 1_000 * r for r in range(N)}
#: the survivor's share: part of rank 2's file and all of rank 4's
ITEMS = [
    {"path": "__2_0.distcp", "offset": 1_000, "length": 9_000},
    {"path": "__4_0.distcp", "offset": 0, "length": SIZES["__4_0.distcp"]},
]
OPTIONS = TransferOptions(chunk_size=8 << 10)


def write_parts(root: Path, step: int) -> list[Path]:
    """Node r's part: rank r's file; n0's also .metadata; n3's also a file outside DCP's
    storage (kept whole by every share)."""
    parts = []
    for r, node in enumerate(NODES):
        d = root / node / f"step_{step:06d}"
        d.mkdir(parents=True)
        rng = random.Random(r * 1000 + step // 10)  # a few bytes change per step
        data = bytearray(random.Random(r).randbytes(SIZES[f"__{r}_0.distcp"]))
        for _ in range(4):
            data[rng.randrange(len(data))] ^= 0xFF
        (d / f"__{r}_0.distcp").write_bytes(data)
        if r == 0:
            (d / ".metadata").write_bytes(dcp_metadata(SIZES))
        if r == 3:
            (d / "config.json").write_text(json.dumps({"step": step}))
        parts.append(d)
    return parts


async def push_step(store: Store, root: Path, step: int, *, marker: bool = True) -> None:
    for node, d in zip(NODES, write_parts(root, step), strict=True):
        plan = PushPlan(part=True)
        await push(store, d, job=JOB, step=step, node=node, options=OPTIONS, plan=plan)
    if marker:  # what the agent of the node that completes the step writes
        doc = completion_doc(JOB, step, await check_step_whole(Catalog(store), JOB, step))
        await store.put(layout.completion_key(JOB, step), json.dumps(doc).encode())


def count_manifest_reads(store: Store) -> Counter[tuple[int, str]]:
    """(step, node) of every manifest the store is asked for from now on."""
    reads: Counter[tuple[int, str]] = Counter()
    get = store.get

    async def counting_get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if (parsed := layout.parse_manifest_key(key)) is not None:
            reads[(parsed[1], parsed[2])] += 1
        return await get(key, start, end)

    store.get = counting_get  # type: ignore[method-assign]
    return reads


def prefetch_shares(
    tmp_path: Path,
    store: Store,
    steps: list[int],
    nodes: tuple[str, ...] = NODES,
    ask: dict[str, Any] | None = None,
) -> tuple[list[Counter[tuple[int, str]]], HotDir]:
    """The survivor's agent prefetches its share (``ask``: the prefetch's layout or items;
    by default ITEMS) of each step in turn: the manifests each read."""
    hot = HotDir(tmp_path / "hot", ".metadata")
    policy = PrefetchPolicy(expected_nodes=nodes)
    prefetcher = Prefetcher(hot, [("t", store)], OPTIONS, BandwidthMeter(), policy)
    reads = count_manifest_reads(store)
    seen = []

    async def go() -> None:
        for step in steps:
            record = prefetcher.submit(JOB, step, None, **(ask or {"items": ITEMS}))
            assert record.task is not None
            await record.task
            assert record.state is State.READY, record.error
            seen.append(Counter(reads))
            reads.clear()

    asyncio.run(go())
    return seen, hot


def assert_the_share(copy: Path, root: Path, step: int, extra: set[str] = frozenset()) -> None:
    """The copy holds .metadata and config.json whole, the share's ranges, nothing else
    (but ``extra`` files)."""
    src = {r: root / node / f"step_{step:06d}" for r, node in enumerate(NODES)}
    assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".ferry")) == sorted(
        {".metadata", "config.json", "__2_0.distcp", "__4_0.distcp"} | extra
    )
    assert (copy / ".metadata").read_bytes() == (src[0] / ".metadata").read_bytes()
    assert (copy / "config.json").read_bytes() == (src[3] / "config.json").read_bytes()
    for item in ITEMS:
        path, lo, n = item["path"], item["offset"], item["length"]
        rank = int(path[2])
        want = (src[rank] / path).read_bytes()[lo : lo + n]
        with open(copy / path, "rb") as f:
            f.seek(lo)
            assert f.read(n) == want


@pytest.fixture
def store(tmp_path: Path) -> Any:
    (tmp_path / "store").mkdir()
    s = open_test_store(str(tmp_path / "store"))
    yield s
    asyncio.run(s.close())


def test_a_share_reads_only_the_parts_it_touches_and_its_bases(
    tmp_path: Path, store: Store
) -> None:
    for step in (10, 20):
        asyncio.run(push_step(store, tmp_path / "src", step))
    (first, second), hot = prefetch_shares(tmp_path, store, [10, 20])
    touched = {"n0", "n2", "n3", "n4"}  # .metadata; the share's files; config.json
    assert first == Counter({(10, n): 1 for n in touched})
    # step 20 from its share of step 10: the same parts of each, once
    assert second == Counter({(s, n): 1 for s in (10, 20) for n in touched})
    assert_the_share(hot.step_path(JOB, 20), tmp_path / "src", 20)


def test_without_a_map_every_part_is_read_and_the_share_is_the_same(
    tmp_path: Path, store: Store
) -> None:
    asyncio.run(push_step(store, tmp_path / "src", 10, marker=False))
    (first,), hot = prefetch_shares(tmp_path, store, [10])
    assert first == Counter({(10, n): 1 for n in NODES})
    assert_the_share(hot.step_path(JOB, 10), tmp_path / "src", 10)


def rewrite_marker(store: Store, change: dict[str, object]) -> dict[str, Any]:
    """Step 10's completion marker with ``change`` applied, written back; the new one."""
    key = layout.completion_key(JOB, 10)
    doc = json.loads(asyncio.run(store.get(key))) | change
    asyncio.run(store.put(key, json.dumps(doc).encode()))
    return dict(doc)


def test_a_map_the_parts_contradict_is_not_trusted(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A marker that places rank 4's file in n1's part: the parts are the record, so the
    share is read from every part, and the warning names what disagreed."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    doc = rewrite_marker(store, {})
    files = [[p, s, "n1" if p == "__4_0.distcp" else n] for p, s, n in doc["files"]]
    rewrite_marker(store, {"files": files})
    with caplog.at_level(logging.WARNING, logger="transfer.engine.share"):
        (first,), hot = prefetch_shares(tmp_path, store, [10])
    assert "the file map places __4_0.distcp where the parts do not hold it" in caplog.text
    assert {node for _, node in first} == set(NODES)
    assert_the_share(hot.step_path(JOB, 10), tmp_path / "src", 10)


@pytest.mark.parametrize(
    "change",
    [
        {"files": [["../escape", 1, "n0"]]},  # a path out of the step
        {"files": [["a", 1, "n9"]]},  # a node the marker does not name
        {"files": [["a", -1, "n0"]]},
        {"files": "not a list"},
        {"nodes": [["n0"], {}]},  # nodes that are no names
    ],
)
def test_a_malformed_map_is_ignored_with_a_warning(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture, change: dict[str, object]
) -> None:
    asyncio.run(push_step(store, tmp_path / "src", 10))
    rewrite_marker(store, change)
    with caplog.at_level(logging.WARNING, logger="transfer.engine.catalog"):
        (first,), hot = prefetch_shares(tmp_path, store, [10])
    assert "reading every part of the step instead" in caplog.text
    assert {node for _, node in first} == set(NODES)
    assert_the_share(hot.step_path(JOB, 10), tmp_path / "src", 10)


def test_ferry_pull_of_a_share_never_reads_the_parts_it_does_not_touch(
    tmp_path: Path, store: Store
) -> None:
    """n1's and n5's manifests garbled: a pull of the share does not read them, so it
    succeeds; a pull of the whole step reads them and says which is unreadable."""
    from agent.cli.run import main as ferry

    asyncio.run(push_step(store, tmp_path / "src", 10))
    for node in ("n1", "n5"):
        (tmp_path / "store" / layout.manifest_key(JOB, 10, node)).write_text("{garbled")
    items = tmp_path / "items.json"
    items.write_text(json.dumps(ITEMS))
    url, dest = str(tmp_path / "store"), tmp_path / "share"
    args = ["pull", url, str(dest), "--job", JOB, "--step", "10"]
    assert ferry([*args, "--items", str(items)]) == 0
    assert_the_share(dest, tmp_path / "src", 10)
    assert ferry(["pull", url, str(tmp_path / "whole"), "--job", JOB, "--step", "10"]) != 0


def survivor(
    tmp_path: Path, store: Store, rank: int, told: list[Any] | None = None
) -> tuple[HotDir, Path, Prefetcher]:
    """Node n<rank> after the scale-down: its own part of step 10 in its hot dir (a node
    without .metadata: its files are its part). ``told``: what the push queue is told of
    its own part (Prefetcher.own_part), with what the directory held then."""
    own = tmp_path / "src" / NODES[rank] / "step_000010"
    hot = HotDir(tmp_path / "hot", "")
    here = hot.step_path(JOB, 10)
    here.mkdir(parents=True)
    name = f"__{rank}_0.distcp"
    (here / name).write_bytes((own / name).read_bytes())

    def own_part(job: str, step: int, path: Path, files: frozenset[str]) -> None:
        if told is not None:
            told.append((job, step, path, files, sorted(p.name for p in path.iterdir())))

    links = PrefetchLinks(own_part=own_part)
    policy = PrefetchPolicy(expected_nodes=NODES)
    return hot, here, Prefetcher(hot, [("t", store)], OPTIONS, BandwidthMeter(), policy, links)


def run_prefetch(prefetcher: Prefetcher, items: list[dict[str, Any]] | None = ITEMS) -> Any:
    record = prefetched(prefetcher, items)
    assert record.state is State.READY, record.error
    return record


def prefetched(prefetcher: Prefetcher, items: list[dict[str, Any]] | None) -> Any:
    """The record of a prefetch of step 10 (``items``: a share), once it ended."""

    async def go() -> Any:
        record = prefetcher.submit(JOB, 10, None, items=items)
        assert record.task is not None
        await record.task
        return record

    return asyncio.run(go())


def test_a_survivor_holding_its_own_part_gets_only_what_its_share_lacks(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a scale-down the survivor n4 holds its own part of the step (rank 4's file)
    and its new rank reads part of rank 2's file and all of its own: the prefetch brings
    .metadata, config.json and rank 2's range (not the other parts), durably, leaves its
    own file untouched, reads 4 manifests of 6, and the copy is from then on a partial
    copy (never taken for the whole step) whose record names its own file and the share."""
    from transfer.engine.share import read_record

    asyncio.run(push_step(store, tmp_path / "src", 10))
    hot, here, prefetcher = survivor(tmp_path, store, 4)
    inode = (here / "__4_0.distcp").stat().st_ino
    reads = count_manifest_reads(store)
    synced = spy_on_fsync(monkeypatch)
    record = run_prefetch(prefetcher)
    assert record.satisfied_by == "filled_in"
    assert_the_share(here, tmp_path / "src", 10)
    assert (here / "__4_0.distcp").stat().st_ino == inode  # its own file, untouched
    moved = sum(record.bytes_by_source.values())
    # at most rank 2's file (a restore reads through small gaps between the chunks it
    # needs: 16.7-42.3 KB here) with .metadata and config.json; the other parts' 210 KB never
    others = sum(size for path, size in SIZES.items() if path != "__4_0.distcp")
    assert moved <= SIZES["__2_0.distcp"] + 2_000 < others, record.bytes_by_source
    assert {n for _, n in reads} == {"n0", "n2", "n3", "n4"}
    # on the disk before the record that names them (a crash never leaves it naming holes)
    assert {".metadata", "config.json", "__2_0.distcp"} <= synced
    assert hot.is_share(here) and not hot.checkpoints(JOB)
    held = read_record(here)
    assert held is not None and held["ranges"] == {
        "__2_0.distcp": [[1_000, 10_000]],
        "__4_0.distcp": [[0, SIZES["__4_0.distcp"]]],
    }
    assert [p.name for p in here.parent.iterdir()] == ["step_000010"]  # no scratch left


def spy_on_fsync(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the files fsynced from now on."""
    synced: set[str] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        with contextlib.suppress(OSError):
            synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_the_push_queue_is_told_the_nodes_own_files_before_anything_is_added(
    tmp_path: Path, store: Store
) -> None:
    """Its part may not be in every tier yet: before the share is added beside it, the
    prefetch tells the push queue which files are the node's own (then, only rank 4's
    file is there), so that they alone go on being pushed (tests/test_own_part_push.py);
    asked for the whole step, the same, before the other parts come in."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    told: list[Any] = []
    hot, here, prefetcher = survivor(tmp_path, store, 4, told)
    assert run_prefetch(prefetcher).satisfied_by == "filled_in"
    assert told == [(JOB, 10, here, {"__4_0.distcp"}, ["__4_0.distcp"])]
    assert hot.is_share(here)
    told.clear()
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "src").symlink_to(tmp_path / "src")
    hot, here, prefetcher = survivor(whole, store, 4, told)
    assert run_prefetch(prefetcher, None).satisfied_by == "filled_in"
    assert told == [(JOB, 10, here, {"__4_0.distcp"}, ["__4_0.distcp"])]
    assert sorted(p.name for p in here.iterdir()) == sorted([*SIZES, ".metadata", "config.json"])


def test_a_wider_ask_later_keeps_every_file_of_the_nodes_part(tmp_path: Path, store: Store) -> None:
    """n5's share does not read its own file; a later ask for more rebuilds the copy from
    its record, which names every file of the part, so rank 5's file is still there."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    _, here, prefetcher = survivor(tmp_path, store, 5)
    assert run_prefetch(prefetcher).satisfied_by == "filled_in"
    more = [*ITEMS, {"path": "__1_0.distcp", "offset": 0, "length": 100}]
    assert run_prefetch(prefetcher, more).satisfied_by == "filled_in"
    assert_the_share(here, tmp_path / "src", 10, extra={"__1_0.distcp", "__5_0.distcp"})
    own = tmp_path / "src" / "n5" / "step_000010" / "__5_0.distcp"
    assert (here / "__5_0.distcp").read_bytes() == own.read_bytes()


def test_ferry_pull_of_a_share_onto_its_earlier_share_reads_the_same_parts_of_both(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ferry pull --items ... --base-dir`` the share of step 10: of step 10, too, only the
    parts holding the share's files are read (4 of 6), and its chunks are reused."""
    from agent.cli.run import main as ferry
    from transfer.store.local import LocalStore

    for step in (10, 20):
        asyncio.run(push_step(store, tmp_path / "src", step))
    items = tmp_path / "items.json"
    items.write_text(json.dumps(ITEMS))
    url = str(tmp_path / "store")
    base = tmp_path / "step_000010"
    share = ["--items", str(items)]
    assert ferry(["pull", url, str(base), "--job", JOB, "--step", "10", *share]) == 0
    reads: Counter[tuple[int, str]] = Counter()
    get = LocalStore.get

    async def counting_get(self: LocalStore, key: str, *args: Any) -> bytes:
        if (parsed := layout.parse_manifest_key(key)) is not None:
            reads[(parsed[1], parsed[2])] += 1
        return await get(self, key, *args)

    monkeypatch.setattr(LocalStore, "get", counting_get)
    dest = tmp_path / "step_000020"
    args = ["pull", url, str(dest), "--job", JOB, "--step", "20", "--base-dir", str(base)]
    assert ferry([*args, *share]) == 0
    touched = {"n0", "n2", "n3", "n4"}
    assert reads == Counter({(s, n): 1 for s in (10, 20) for n in touched})
    assert_the_share(dest, tmp_path / "src", 20)


def test_a_node_serving_its_own_part_to_peers_reads_its_own_manifest_only(
    tmp_path: Path, store: Store
) -> None:
    """The index of what this node can serve its peers (agent/peers/chunks.py HotIndex)
    learns where its own part's chunks are from its own part's manifest, found by the
    step's file map: 1 read of 6 (it read every part)."""
    from agent.peers.chunks import HotIndex

    asyncio.run(push_step(store, tmp_path / "src", 10))
    hot, here, _ = survivor(tmp_path, store, 4)
    manifest = asyncio.run(Catalog(store).manifest(JOB, 10, "n4"))
    reads = count_manifest_reads(store)
    index = HotIndex(hot, [("t", store)])
    ((offset, chunk), *_) = manifest.files[0].chunk_offsets()
    where = asyncio.run(index.locate(chunk.id))
    assert where == (here / "__4_0.distcp", offset, chunk.size)
    assert reads == Counter({(10, "n4"): 1})


def test_the_index_of_what_a_node_serves_learns_the_files_a_prefetch_moved_in(
    tmp_path: Path, store: Store
) -> None:
    """n4 indexed its own part, then its share's prefetch added .metadata and n3's
    config.json beside it: a peer asking for those chunks finds them here (the prefetch
    told the index the step changed, and it read the parts it now holds), not the tier
    after a wait."""
    from agent.peers.chunks import HotIndex

    asyncio.run(push_step(store, tmp_path / "src", 10))
    hot, here, _ = survivor(tmp_path, store, 4)
    index = HotIndex(hot, [("t", store)], min_refresh=0.0)
    links = PrefetchLinks(step_changed=index.forget_step)
    policy = PrefetchPolicy(expected_nodes=NODES)
    prefetcher = Prefetcher(hot, [("t", store)], OPTIONS, BandwidthMeter(), policy, links)
    own = asyncio.run(Catalog(store).manifest(JOB, 10, "n4")).files[0].chunks[0]
    assert asyncio.run(index.locate(own.id)) is not None
    config = next(f for f in asyncio.run(Catalog(store).manifest(JOB, 10, "n3")).files
                  if f.path == "config.json")  # fmt: skip
    assert asyncio.run(index.locate(config.chunks[0].id)) is None  # not here yet

    run_prefetch(prefetcher)
    where = asyncio.run(index.locate(config.chunks[0].id))
    assert where == (here / "config.json", 0, config.chunks[0].size)
