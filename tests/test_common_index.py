"""A survivor's share of a real-shaped N-node step reads a few parts, not N.

DCP spreads the items every rank reads (step counters, param_groups) over every rank's
file, so a resharded rank's share touches every file: with only the marker's file map, the
survivor read every part's manifest (N per survivor, N x N per resize). The marker's common
index (format/stepcommon.py) says where those items are stored, so the survivor reads
``.metadata``'s part and the parts its own rows are in. Without an index, with a malformed
one, or with one a repack left stale, every part is read and the share is the same."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import open_test_store
from tests.fake_dcp import dcp_metadata
from tests.test_share_parts import count_manifest_reads, prefetch_shares
from transfer.engine import PushPlan, push
from transfer.engine.catalog import Catalog
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.format import layout
from transfer.format.stepcommon import COMMON_KEY
from transfer.options import TransferOptions
from transfer.retention import Tier, TierPolicy, apply_plan, make_plan
from transfer.retention.repack import RepackPolicy
from transfer.store.base import Store

JOB, N = "llm", 8
NODES = tuple(f"n{r}" for r in range(N))
SIZES = {f"__{r}_0.distcp": 20_000 + 1_000 * r for r in range(N)}
#: the last bytes of every rank's file: an item every rank reads
REPLICATED = 64
OPTIONS = TransferOptions(chunk_size=8 << 10)
#: the survivor: rank 1 of the job shrunk to 4 ranks, which holds old ranks 2 and 3's rows
LAYOUT = {"world_size": 4, "ranks": [1]}


def write_part(root: Path, r: int, step: int, replicated: int, row_extra: int = 0) -> Path:
    """Rank r's file: its row (``row_extra`` bytes longer than SIZES says), then
    ``replicated`` bytes every rank reads (a few bytes of the row and the whole item change
    each step)."""
    d = root / NODES[r] / f"step_{step:06d}"
    d.mkdir(parents=True)
    sizes = {path: size + row_extra + replicated for path, size in SIZES.items()}
    # (4 bits of entropy a byte: compressible, so a changed chunk pays as a delta)
    data = bytearray(b & 0x0F for b in random.Random(r).randbytes(sizes[f"__{r}_0.distcp"]))
    rng = random.Random(r * 1000 + step)
    for _ in range(4):
        data[rng.randrange(len(data) - replicated)] ^= 0xFF
    data[-replicated:] = data[-replicated:].replace(b"\x01", bytes([step % 16]))
    (d / f"__{r}_0.distcp").write_bytes(data)
    if r == 0:
        (d / ".metadata").write_bytes(dcp_metadata(sizes, sharded=True, replicated=replicated))
    return d


async def push_step(
    store: Store,
    root: Path,
    step: int,
    replicated: int = REPLICATED,
    options: Any = OPTIONS,
    row_extra: int = 0,
) -> dict[str, Any]:
    """Every node's part, then the marker its agent writes; the marker."""
    for r, node in enumerate(NODES):
        d = write_part(root, r, step, replicated, row_extra)
        await push(store, d, job=JOB, step=step, node=node, options=options,
                   plan=PushPlan(part=True))  # fmt: skip
    doc = completion_doc(JOB, step, await check_step_whole(Catalog(store), JOB, step))
    await store.put(layout.completion_key(JOB, step), json.dumps(doc).encode())
    return doc


def prefetch(tmp_path: Path, store: Store, steps: list[int]) -> tuple[list[Counter[Any]], Path]:
    """The survivor's agent prefetches its share of each step in turn (each later one
    from the copy of the one before): the manifests each read, and where the copies are."""
    seen, hot = prefetch_shares(tmp_path, store, steps, NODES, {"layout": LAYOUT})
    return seen, hot.root / JOB


def assert_the_share(copy: Path, root: Path, step: int, replicated: int = REPLICATED) -> None:
    """Old ranks 2 and 3's files whole; of every other rank's, the replicated item (and
    none of the row that the item's chunks do not cover: a hole)."""
    for r in range(N):
        src = (root / NODES[r] / f"step_{step:06d}" / f"__{r}_0.distcp").read_bytes()
        got = (copy / f"__{r}_0.distcp").read_bytes()
        if r in (2, 3):
            assert got == src
        else:
            assert got[-replicated:] == src[-replicated:]
            assert len(got) == len(src) and not any(got[: -replicated - OPTIONS.chunk_size])


@pytest.fixture
def store(store_url: str) -> Any:
    """The tier, on a local directory and on the S3 server."""
    opened = open_test_store(store_url)
    yield opened
    asyncio.run(opened.close())


def test_a_survivor_reads_the_parts_its_rows_are_in_and_the_index_for_the_rest(
    tmp_path: Path, store: Store
) -> None:
    """Steps 10 and 20 (20's changed chunks delta-coded against 10's): each prefetch reads
    n0 (.metadata) and n2, n3 (its rows) of its step, and of the step its copy holds."""
    for step in (10, 20):
        doc = asyncio.run(push_step(store, tmp_path / "src", step))
        indexed = {f["path"] for f in doc[COMMON_KEY]["files"]}
        assert indexed == set(SIZES)  # every rank's file holds a replicated item
    (first, second), copies = prefetch(tmp_path, store, [10, 20])
    mine = {"n0", "n2", "n3"}
    assert first == Counter({(10, n): 1 for n in mine})
    assert second == Counter({(s, n): 1 for s in (10, 20) for n in mine})
    assert_the_share(copies / "step_000010", tmp_path / "src", 10)
    assert_the_share(copies / "step_000020", tmp_path / "src", 20)


def test_deltas_in_the_index_bring_their_bases(tmp_path: Path, store: Store) -> None:
    """Replicated items of 64 KiB and more (a tensor saved whole) that changed, stored as
    deltas: the index lists each delta's base chain (a manifest's rule), so a survivor
    holding nothing decodes them from it."""
    big, options = 96 << 10, replace(OPTIONS, chunk_size=96 << 10)
    for step in (10, 20):
        doc = asyncio.run(push_step(store, tmp_path / "src", step, big, options, 400_000))
    chunks = [c for f in doc[COMMON_KEY]["files"] for _, run in f["runs"] for c in run]
    deltas = [c for c in chunks if "base" in c]
    assert deltas, "step 20's changed items should be stored as deltas"
    listed = {c["id"] for c in chunks} | {b["id"] for b in doc[COMMON_KEY]["bases"]}
    assert all(c["base"] in listed for c in deltas)
    assert doc[COMMON_KEY]["bases"]  # (the bases are step 10's chunks: in no run here)
    (only,), copies = prefetch(tmp_path, store, [20])
    assert {n for _, n in only} < set(NODES)
    assert_the_share(copies / "step_000020", tmp_path / "src", 20, big)


def rewrite_marker(store: Store, step: int, change: dict[str, Any]) -> None:
    key = layout.completion_key(JOB, step)
    doc = json.loads(asyncio.run(store.get(key))) | change
    asyncio.run(store.put(key, json.dumps({k: v for k, v in doc.items() if v is not None})
                          .encode()))  # fmt: skip


def test_without_the_index_every_part_is_read_and_the_share_is_the_same(
    tmp_path: Path, store: Store
) -> None:
    """A marker written before the index (or over its size limit): the file map alone
    sends the survivor to every part, since every file holds an item it reads."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    rewrite_marker(store, 10, {COMMON_KEY: None})
    (first,), copies = prefetch(tmp_path, store, [10])
    assert first == Counter({(10, n): 1 for n in NODES})
    assert_the_share(copies / "step_000010", tmp_path / "src", 10)


@pytest.mark.parametrize(
    "common",
    [
        "not an object",
        {"packs": [], "bases": [], "files": [{"path": "../escape", "mode": 420, "runs": []}]},
        "a file the map does not name",
        "no parts it was made from",
        "overlapping runs",
        "past the end",
        "a base that is not listed",
    ],
)  # fmt: skip
def test_a_malformed_index_is_ignored_with_a_warning(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture, common: Any
) -> None:
    doc = asyncio.run(push_step(store, tmp_path / "src", 10))
    good = doc[COMMON_KEY]
    first_file = good["files"][0]
    run_start, run_chunks = first_file["runs"][0]
    if common == "a file the map does not name":
        common = dict(good, files=[dict(first_file, path="other"), *good["files"][1:]])
    elif common == "no parts it was made from":
        common = {k: v for k, v in good.items() if k != "parts"}
    elif common == "overlapping runs":
        bad = dict(first_file, runs=[[run_start, run_chunks], [run_start, run_chunks]])
        common = dict(good, files=[bad, *good["files"][1:]])
    elif common == "past the end":
        bad = dict(first_file, runs=[[SIZES[first_file["path"]], run_chunks]])
        common = dict(good, files=[bad, *good["files"][1:]])
    elif common == "a base that is not listed":
        chunk = dict(run_chunks[0], enc="xor+zstd", base="f" * 64)
        bad = dict(first_file, runs=[[run_start, [chunk, *run_chunks[1:]]]])
        common = dict(good, files=[bad, *good["files"][1:]])
    rewrite_marker(store, 10, {COMMON_KEY: common})
    with caplog.at_level(logging.WARNING, logger="transfer.engine.catalog"):
        (first,), copies = prefetch(tmp_path, store, [10])
    assert "its common index is unusable" in caplog.text
    assert first == Counter({(10, n): 1 for n in NODES})
    assert_the_share(copies / "step_000010", tmp_path / "src", 10)


def test_an_index_naming_a_pack_that_is_gone_falls_back_to_the_parts(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """What a repack by an agent that predates the index leaves (the parts re-pointed, the
    old packs collected, the marker untouched): the prefetch reads every part instead."""
    doc = asyncio.run(push_step(store, tmp_path / "src", 10))
    gone = "0123456789abcdef" * 2
    common = dict(doc[COMMON_KEY], packs=[gone] * len(doc[COMMON_KEY]["packs"]))
    rewrite_marker(store, 10, {COMMON_KEY: common})
    with caplog.at_level(logging.WARNING, logger="agent.node.prefetch"):
        (first,), copies = prefetch(tmp_path, store, [10])
    assert "the index was stale" in caplog.text
    assert {n for _, n in first} == set(NODES)
    assert_the_share(copies / "step_000010", tmp_path / "src", 10)
    # and dropped from the marker, so that no later reader tries it first
    marker = json.loads(asyncio.run(store.get(layout.completion_key(JOB, 10))))
    assert "files" in marker and COMMON_KEY not in marker


def test_a_repack_writes_the_index_of_a_step_it_re_points_anew(
    tmp_path: Path, store: Store
) -> None:
    """Step 10 expires (keep_last 1) and step 20's live chunks in its packs are copied out:
    step 20's parts are re-pointed and the old packs collected, so its marker's index would
    name packs that are gone. The repack drops it before the first part is re-pointed and
    writes it anew from the parts as they are after; the survivor then reads n0, n2 and n3
    again, and the share is the same."""
    for step in (10, 20):
        asyncio.run(push_step(store, tmp_path / "src", step))
    before = json.loads(asyncio.run(store.get(layout.completion_key(JOB, 20))))

    async def expire_and_repack() -> Any:
        tiers = [Tier(store, TierPolicy(keep_last=1))]
        plan = await make_plan(tiers, now=time.time(), repacking=RepackPolicy(min_dead=0.1))
        return await apply_plan(plan, tiers, grace_s=0.0, holder="test")

    report = asyncio.run(expire_and_repack()).tiers[0].repack
    assert report is not None and report.parts_rewritten > 0
    after = json.loads(asyncio.run(store.get(layout.completion_key(JOB, 20))))
    assert after[COMMON_KEY]["parts"] != before[COMMON_KEY]["parts"]  # (the parts as now)
    rest = {k: v for k, v in after.items() if k != COMMON_KEY}
    assert rest == {k: v for k, v in before.items() if k != COMMON_KEY}
    (first,), copies = prefetch(tmp_path, store, [20])
    assert first == Counter({(20, n): 1 for n in ("n0", "n2", "n3")})
    assert_the_share(copies / "step_000020", tmp_path / "src", 20)


def test_ferry_pull_of_a_share_reads_the_index_and_reads_the_parts_when_it_is_stale(
    tmp_path: Path,
    store: Store,
    store_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ferry pull --world-size 4 --ranks 1`` of step 10, then of step 20 onto step 10's
    copy: n0, n2 and n3 of each. Then step 20 pulled again after its index was made to
    name a pack that is gone: it says so, reads the parts, and the share is the same."""
    from agent.cli.run import main as ferry

    for step in (10, 20):
        doc = asyncio.run(push_step(store, tmp_path / "src", step))
    base, dest = tmp_path / "step_000010", tmp_path / "step_000020"
    nodes = ",".join(NODES)
    share = ["--job", JOB, "--world-size", "4", "--ranks", "1", "--expected-nodes", nodes]
    assert ferry(["pull", store_url, str(base), "--step", "10", *share]) == 0
    reads: Counter[tuple[int, str]] = Counter()
    get = type(store).get  # (the CLI opens a store of its own, of this class)

    async def counting_get(self: Store, key: str, *args: Any) -> bytes:
        if (parsed := layout.parse_manifest_key(key)) is not None:
            reads[(parsed[1], parsed[2])] += 1
        return await get(self, key, *args)

    monkeypatch.setattr(type(store), "get", counting_get)
    argv = ["pull", store_url, str(dest), "--step", "20", "--base-dir", str(base), *share]
    assert ferry(argv) == 0
    assert reads == Counter({(s, n): 1 for s in (10, 20) for n in ("n0", "n2", "n3")})
    assert_the_share(dest, tmp_path / "src", 20)
    gone = "0123456789abcdef" * 2
    common = dict(doc[COMMON_KEY], packs=[gone] * len(doc[COMMON_KEY]["packs"]))
    rewrite_marker(store, 20, {COMMON_KEY: common})
    again = tmp_path / "again" / "step_000020"
    capsys.readouterr()
    assert ferry(["pull", store_url, str(again), "--step", "20", *share]) == 0
    assert "the index was stale" in capsys.readouterr().err
    assert_the_share(again, tmp_path / "src", 20)
    assert COMMON_KEY not in json.loads(asyncio.run(store.get(layout.completion_key(JOB, 20))))


def test_what_a_survivor_serves_its_peers_is_learnt_from_the_index(
    tmp_path: Path, store: Store
) -> None:
    """The index of what a node can serve its peers (agent/peers/chunks.py HotIndex) of a
    survivor's share copy: the parts its rows are in and the marker's index, and the
    replicated items' chunks are found in the copy (they were every part's)."""
    from agent.node.hotdir import HotDir
    from agent.peers.chunks import HotIndex

    doc = asyncio.run(push_step(store, tmp_path / "src", 10))
    _, copies = prefetch(tmp_path, store, [10])
    reads = count_manifest_reads(store)
    index = HotIndex(HotDir(tmp_path / "hot", ".metadata"), [("t", store)])
    item = doc[COMMON_KEY]["files"][-1]  # (rank 7's file: no row of it in the share)
    start, (chunk, *_) = item["runs"][0]
    where = asyncio.run(index.locate(chunk["id"]))
    assert where == (copies / "step_000010" / item["path"], start, chunk["size"])
    assert {n for _, n in reads} == {"n0", "n2", "n3"}


def test_an_index_made_from_other_parts_is_not_used(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 10's index in step 20's marker (what a marker copied over other parts of the
    step, or written before a re-push, amounts to): the parts the survivor reads are not
    the ones it was made from, so it reads the rest too, and gets step 20's items."""
    old = asyncio.run(push_step(store, tmp_path / "src", 10))
    asyncio.run(push_step(store, tmp_path / "src", 20))
    rewrite_marker(store, 20, {COMMON_KEY: old[COMMON_KEY]})
    with caplog.at_level(logging.WARNING, logger="transfer.engine.stepparts"):
        (first,), copies = prefetch(tmp_path, store, [20])
    assert "made from other parts than the store holds now" in caplog.text
    assert {n for _, n in first} == set(NODES)
    assert_the_share(copies / "step_000020", tmp_path / "src", 20)


@pytest.mark.parametrize(
    "node", ["n2", "n7"], ids=["a part the survivor reads", "a part the index stands in for"]
)
def test_a_lost_pack_fails_the_prefetch_without_blaming_the_index(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture, node: str
) -> None:
    """n2's pack (rows the survivor reads from n2's own part) or n7's (the survivor takes
    only n7's replicated item, from the index) deleted: the chunk is lost, not the index
    stale (the parts fail where the index did). The prefetch fails naming the pack, says
    nothing of a stale index, and the marker keeps its index."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    (pack,) = asyncio.run(Catalog(store).manifest(JOB, 10, node)).packs
    asyncio.run(store.delete(layout.pack_key(pack)))
    with (
        caplog.at_level(logging.WARNING, logger="agent.node.prefetch"),
        pytest.raises(AssertionError, match=f"pack {pack} is missing"),
    ):
        prefetch(tmp_path, store, [10])
    assert "stale" not in caplog.text
    assert COMMON_KEY in json.loads(asyncio.run(store.get(layout.completion_key(JOB, 10))))


def test_a_step_of_one_part_gets_no_index(tmp_path: Path, store: Store) -> None:
    """One part: a reader reads it whole anyway, so the marker does not repeat it."""
    d = tmp_path / "one" / "step_000010"  # (every rank's file, .metadata: one node's save)
    d.mkdir(parents=True)
    for r in range(N):
        for f in write_part(tmp_path / "src", r, 10, REPLICATED).iterdir():
            f.rename(d / f.name)
    asyncio.run(push(store, d, job=JOB, step=10, node="n0", options=OPTIONS))
    doc = completion_doc(JOB, 10, asyncio.run(check_step_whole(Catalog(store), JOB, 10)))
    assert "files" in doc and COMMON_KEY not in doc


def test_a_copy_to_a_tier_holding_another_save_of_the_step_drops_the_index(
    tmp_path: Path, store: Store
) -> None:
    """The cold tier holds n5's part of an earlier save of step 10 (a job restarted from
    an older step re-saved it); copying the new save's step there keeps that part (parts
    never change) and must not bring an index of the new save's items with the marker."""
    from transfer.engine.catalog import init_store
    from transfer.retention.copy import copy_step

    (tmp_path / "cold").mkdir()
    cold = open_test_store(str(tmp_path / "cold"))
    asyncio.run(init_store(cold))
    old = write_part(tmp_path / "old", 5, 10, REPLICATED)
    shard = old / "__5_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-REPLICATED] + b"an earlier save".ljust(REPLICATED))
    asyncio.run(push(cold, old, job=JOB, step=10, node="n5", options=OPTIONS,
                     plan=PushPlan(part=True)))  # fmt: skip
    asyncio.run(push_step(store, tmp_path / "src", 10))
    asyncio.run(copy_step(store, cold, JOB, 10))
    marker = json.loads(asyncio.run(cold.get(layout.completion_key(JOB, 10))))
    assert "files" in marker and COMMON_KEY not in marker
    asyncio.run(cold.close())


def test_a_fan_out_member_reads_the_index_too(tmp_path: Path, store: Store) -> None:
    """The same survivor as one member of the survivors' fan-out group (the others do not
    run: their address refuses, so it fetches its whole share itself): n0, n2, n3."""
    from agent.node.estimate import BandwidthMeter
    from agent.node.hotdir import HotDir
    from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy, State
    from agent.peers.chunks import PeerSource
    from tests.harness import reserve_port

    asyncio.run(push_step(store, tmp_path / "src", 10))
    refused = reserve_port()
    members = tuple(f"http://127.0.0.1:{refused}/m{i}" for i in range(4))
    layouts = {url: {"world_size": 4, "ranks": [i]} for i, url in enumerate(members)}
    reads = count_manifest_reads(store)
    hot = HotDir(tmp_path / "hot", ".metadata")

    async def go() -> None:
        peers = PeerSource((), "token")
        prefetcher = Prefetcher(hot, [("t", store)], OPTIONS, BandwidthMeter(),
                                PrefetchPolicy(expected_nodes=NODES),
                                PrefetchLinks(fanout_client=peers))  # fmt: skip
        group = {"fanout": (members, members[1]), "fanout_layouts": layouts}
        record = prefetcher.submit(JOB, 10, None, layout=LAYOUT, **group)
        assert record.task is not None
        await record.task
        await peers.close()
        assert record.state is State.READY, record.error

    asyncio.run(go())
    assert {n for _, n in reads} == {"n0", "n2", "n3"}
    assert_the_share(hot.root / JOB / "step_000010", tmp_path / "src", 10)


def test_a_stale_index_found_while_building_on_an_earlier_step_falls_back_too(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The survivor holds step 10's share, and step 20's index names packs that are gone:
    the chunks it fetches beside reusing step 10's come from a task group, whose error
    the prefetch still knows for the index's, and reads the parts instead."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    doc = asyncio.run(push_step(store, tmp_path / "src", 20))
    gone = "0123456789abcdef" * 2
    common = dict(doc[COMMON_KEY], packs=[gone] * len(doc[COMMON_KEY]["packs"]))
    rewrite_marker(store, 20, {COMMON_KEY: common})
    with caplog.at_level(logging.WARNING, logger="agent.node.prefetch"):
        (_, second), copies = prefetch(tmp_path, store, [10, 20])
    assert "the index was stale" in caplog.text
    assert {n for s, n in second if s == 20} == set(NODES)
    assert_the_share(copies / "step_000020", tmp_path / "src", 20)


def test_a_pack_gone_while_building_on_an_earlier_step_fails_the_prefetch_in_one_line(
    tmp_path: Path, store: Store
) -> None:
    """Step 20's new pack of n2 (rows the survivor reads) deleted, step 10's share held:
    the prefetch fails naming the pack (it was an ExceptionGroup out of the pull's task
    group, which left the prefetch running for ever and no other tier tried)."""
    asyncio.run(push_step(store, tmp_path / "src", 10))
    asyncio.run(push_step(store, tmp_path / "src", 20))
    old = set(asyncio.run(Catalog(store).manifest(JOB, 10, "n2")).packs)
    (pack,) = set(asyncio.run(Catalog(store).manifest(JOB, 20, "n2")).packs) - old
    asyncio.run(store.delete(layout.pack_key(pack)))
    with pytest.raises(AssertionError, match=f"pack {pack} is missing"):
        prefetch(tmp_path, store, [10, 20])


def test_a_copy_run_again_over_its_own_parts_keeps_the_index(tmp_path: Path, store: Store) -> None:
    """A copy stopped after the parts and before the marker, run again: the parts there are
    its own (the same bytes), so the marker keeps its index."""
    from transfer.engine.catalog import init_store
    from transfer.retention.copy import copy_step

    (tmp_path / "cold").mkdir()
    cold = open_test_store(str(tmp_path / "cold"))
    asyncio.run(init_store(cold))
    asyncio.run(push_step(store, tmp_path / "src", 10))
    asyncio.run(copy_step(store, cold, JOB, 10))
    asyncio.run(cold.delete(layout.completion_key(JOB, 10)))  # (where the first run stopped)
    asyncio.run(copy_step(store, cold, JOB, 10))
    marker = json.loads(asyncio.run(cold.get(layout.completion_key(JOB, 10))))
    assert COMMON_KEY in marker
    asyncio.run(cold.close())


def test_verify_finds_an_index_that_vouches_for_parts_it_does_not_describe(
    tmp_path: Path, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's trial forged step 20's index from step 10's, keeping step 20's parts'
    digests: readers trust it (the parts they read match), and a share restored step 10's
    items. ``ferry verify`` compares every index with the parts it vouches for: all good
    before, BAD after, naming the marker."""
    from agent.cli.run import main as ferry

    old = asyncio.run(push_step(store, tmp_path / "src", 10))
    new = asyncio.run(push_step(store, tmp_path / "src", 20))
    assert ferry(["verify", store_url, "--job", JOB]) == 0
    assert "all good" in capsys.readouterr().out
    rewrite_marker(store, 20, {COMMON_KEY: dict(old[COMMON_KEY], parts=new[COMMON_KEY]["parts"])})
    assert ferry(["verify", store_url, "--job", JOB]) != 0
    out = "".join(capsys.readouterr())
    assert f"BAD index {layout.completion_key(JOB, 20)}: its common index puts chunk" in out
    assert "1 BAD common index(es)" in out
