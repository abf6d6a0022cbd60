"""Issue 12, item 4: the estimate names the source a prefetch would use (a peer before the
tier), measures a source it has not seen at first contact with a probe instead of assuming
a constant, and gives a range. Real agents on loopback, a real store, real AdamW-shaped
saves; each estimate is checked against the prefetch that follows it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from agent.node.estimate import PREFETCH_START_SECONDS
from agent.rpc.client import FerryClient
from bench._measure import BLKIO, throttled_disk
from tests.conftest import adamw_series, prefetched, random_bytes, write_file
from tests.fake_dcp import dcp_metadata
from tests.harness import OPTS, TOKEN, agent, peer_agent, push_series
from transfer.engine import PushPlan, push
from transfer.engine.catalog import Catalog, resolve_manifests
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.engine.writeprobe import DiskProbe
from transfer.format.chunkid import chunk_id
from transfer.format.layout import completion_key
from transfer.store import open_store


def test_the_estimate_names_the_peer_that_will_serve_and_probes_it_first(
    local_url: str, tmp_path: Path
) -> None:
    """Node B holds step 20 (training wrote it there: no transfer has measured anything)
    and has peer A, which holds 20 and 40. The estimate for 40 names A, says it probed A,
    and predicts the bytes the prefetch then moves from A within 25% (the peer sends
    deltas against B's chunks, not the tier's stored form)."""
    hot_a = tmp_path / "node-a"
    k20, k40 = adamw_series(hot_a / "llm", 2, seed=21)

    async def go() -> None:
        await push_series(local_url, [k20, k40])
        shutil.copytree(k20, tmp_path / "b" / "llm" / k20.name, copy_function=os.link)
        async with (
            peer_agent(hot_a, [local_url], [], "a") as url_a,
            peer_agent(tmp_path / "b", [local_url], [url_a], "b") as url_b,
            FerryClient(url_b, TOKEN) as b,
        ):
            est = await b.estimate("llm", 40)
            assert (est["source"], est["rate_basis"]) == (f"peer:{url_a}", "probe"), est
            assert est["bytes_bases"] == 0 and set(est["bytes_by_source"]) == {"peer"}
            # a probe's rate comes with the default spread: up to twice the estimate
            assert est["seconds_low"] < est["seconds"] < est["seconds_high"]
            assert est["seconds_high"] >= 1.99 * est["seconds"], est
            done = await prefetched(b, 40)
            moved = sum(done["bytes_by_source"].values())
            assert done["bytes_by_source"]["peer"] > 0.9 * moved
            assert abs(est["bytes_missing"] - moved) <= 0.25 * moved, (est, moved)
            # restored here by that prefetch: its next prefetch checks it by stat, and so
            # does the estimate (it predicted a re-hash: 1.3 s on the corpus for 0.01 s)
            again = await b.estimate("llm", 40)
            assert (again["source"], again["bytes_by_source"]) == ("verified", {"local": 0})
            assert again["bytes_missing"] == 0  # (was the step's size: nothing is missing)
            assert again["seconds"] < 0.2 and again["seconds_low"] == 0.0, again
            # step 20 was written here by training, not restored: its prefetch re-hashes it,
            # at a rate probed on this copy at first contact
            held = await b.estimate("llm", 20)
            assert (held["source"], held["rate_basis"]) == ("local", "probe"), held
            assert held["bytes_by_source"] == {"local": held["bytes_total"]}  # re-read
            assert (await prefetched(b, 20))["satisfied_by"] == "held"
            # a file of 40 touched since it was restored: no longer known intact, re-hashed
            shard = Path(done["dest"]) / "__0_0.distcp"
            await asyncio.to_thread(os.utime, shard, (1e9, 1e9))
            changed = await b.estimate("llm", 40)
            assert (changed["source"], changed["rate_basis"]) == ("local", "measured"), changed
            assert (await prefetched(b, 40))["satisfied_by"] == "held"

    asyncio.run(go())


def test_in_an_n_node_job_the_estimate_counts_every_peer_that_holds_a_part(
    local_url: str, tmp_path: Path
) -> None:
    """Three nodes each hold their own part of a step; a fourth, holding nothing, has them
    as peers. No one peer holds every chunk it lacks: the estimate asked each peer for a
    whole sample, none served it all, and it named the tier for a prefetch the peers then
    served whole (a newcomer's three-node trial). It asks as the prefetch does now, each
    chunk of the first peer that has it: a peer named, the peers' bytes, within 25% of what
    the prefetch then moves from them."""
    nodes, step = ("n0", "n1", "n2"), 20
    sizes = {f"__{r}_0.distcp": 3 << 20 for r in range(len(nodes))}
    parts = []
    for r, node in enumerate(nodes):
        part = tmp_path / node / "llm" / f"step_{step:06d}"
        write_file(part / f"__{r}_0.distcp", random_bytes(3 << 20, seed=r))
        if r == 0:
            write_file(part / ".metadata", dcp_metadata(sizes))
        parts.append(part)
    (tmp_path / "e").mkdir()
    (tmp_path / "f").mkdir()

    async def go() -> None:
        store = open_store(local_url)
        try:
            for node, part in zip(nodes, parts, strict=True):
                plan = PushPlan(part=True)
                await push(store, part, job="llm", step=step, node=node, options=OPTS, plan=plan)
            whole = await check_step_whole(Catalog(store), "llm", step)
            doc = completion_doc("llm", step, whole)
            await store.put(completion_key("llm", step), json.dumps(doc).encode())
        finally:
            await store.close()
        async with contextlib.AsyncExitStack() as stack:
            # (the nodes without .metadata say so, as a multi-node deployment configures
            # them: their files are their part)
            marker = [None, 'commit_marker = ""\n', 'commit_marker = ""\n']
            urls = [
                await stack.enter_async_context(agent(tmp_path / n, [local_url], n, config_text=c))
                for n, c in zip(nodes, marker, strict=True)
            ]
            url_e = await stack.enter_async_context(
                peer_agent(tmp_path / "e", [local_url], urls, "e")
            )
            e = await stack.enter_async_context(FerryClient(url_e, TOKEN))
            est = await e.estimate("llm", step)
            done = await prefetched(e, step)
            # a node that knows two of the three as peers: the third part from the tier
            url_f = await stack.enter_async_context(
                peer_agent(tmp_path / "f", [local_url], urls[:2], "f")
            )
            f = await stack.enter_async_context(FerryClient(url_f, TOKEN))
            split = await f.estimate("llm", step)
            split_done = await prefetched(f, step)
            asked = await asks_per_chunk(urls, local_url, step)
        moved = sum(done["bytes_by_source"].values())
        assert done["bytes_by_source"]["peer"] > 0.9 * moved, done  # the peers served it
        assert est["source"] in {f"peer:{url}" for url in urls}, est
        assert set(est["bytes_by_source"]) == {"peer"}, est
        assert abs(est["bytes_missing"] - moved) <= 0.25 * moved, (est, moved)
        assert set(split["bytes_by_source"]) == set(split_done["bytes_by_source"]), split
        for where, nbytes in split_done["bytes_by_source"].items():
            assert abs(split["bytes_by_source"][where] - nbytes) <= 0.25 * nbytes, (split, where)
        # each chunk asked of its owner's peer alone: one request, not one per peer before it
        assert asked == {1}, asked

    asyncio.run(go())


async def asks_per_chunk(urls: list[str], store_url: str, step: int) -> set[int]:
    """How many peers a prefetch's chunk source asks for each chunk of the step, the step's
    owners known from its manifests and the peers' nodes from their /healthz."""
    from agent.peers.chunks import PeerSource, chunk_owners

    class Counting(PeerSource):
        async def ask(self, peer, chunk, base, *, wait=0.0, land=None):  # type: ignore[no-untyped-def]
            self.asked[chunk.id] = self.asked.get(chunk.id, 0) + 1
            return await super().ask(peer, chunk, base, wait=wait, land=land)

    store, peers = open_store(store_url), Counting(tuple(urls), TOKEN)
    peers.asked = {}  # type: ignore[attr-defined]
    try:
        manifests = await resolve_manifests(store, "llm", step)
        index = ChunkIndex()
        for m in manifests:
            index.add_manifest(m)
        await peers.learn_nodes()
        source = peers.owners_first(chunk_owners(manifests))
        for cid in chunk_owners(manifests):
            chunk = index.get(cid)
            assert chunk is not None and await source(chunk, None) is not None, cid
    finally:
        await peers.close()
        await store.close()
    return set(peers.asked.values())  # type: ignore[attr-defined]


def test_a_tier_seen_for_the_first_time_is_probed_then_measured_by_transfers(
    local_url: str, tmp_path: Path
) -> None:
    (k20,) = adamw_series(tmp_path / "src", 1, seed=22)

    async def go() -> None:
        await push_series(local_url, [k20])
        async with agent(tmp_path / "c", [local_url], "c") as url, FerryClient(url, TOKEN) as c:
            first = await c.estimate("llm", 20)
            assert (first["source"], first["rate_basis"]) == (f"tier:{local_url}", "probe")
            again = await c.estimate("llm", 20)  # the probe's rate is kept: no second probe
            assert again["rate_basis"] == "measured"
            # (the fixed part is what resolving the step took, timed each time: not compared)
            moving = [e["seconds"] - e["seconds_start"] for e in (first, again)]
            assert moving[1] == pytest.approx(moving[0])

    asyncio.run(go())


def test_the_estimate_knows_the_disk_a_restore_writes_to(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: an estimate says what a restore writes here and how fast this node's disk
    takes it: probed at the agent's start, then measured by each restore (here every one
    counts as held back by its disk: which ones do is prefetch._disk_sample's, tested on
    its own, and counts however quick: a 25 MB restore that auto wrote into the page cache
    took 3-8 ms on a busy machine, under the meter's MIN_SAMPLE_SECONDS, and CI failed); a
    step held here writes nothing. The time is never below what the disk takes for the
    bytes written."""
    monkeypatch.setattr("agent.node.prefetch.DISK_BOUND", 0.0)
    monkeypatch.setattr("agent.node.estimate.MIN_SAMPLE_SECONDS", 1e-6)
    k20, k40 = adamw_series(tmp_path / "src", 2, seed=23, mib=8)

    async def go() -> None:
        await push_series(local_url, [k20, k40])
        async with agent(tmp_path / "d", [local_url], "d") as url, FerryClient(url, TOKEN) as d:
            first = await d.estimate("llm", 20)
            assert first["disk_rate_basis"] == "probe", first  # the start-up probe's
            assert first["bytes_written"] == first["bytes_total"] > 0
            assert first["seconds"] >= first["bytes_written"] / first["disk_rate"]
            await prefetched(d, 20)
            after = await d.estimate("llm", 40)  # the restore of 20 measured the disk
            assert after["disk_rate_basis"] == "measured", after
            assert after["seconds"] >= after["bytes_written"] / after["disk_rate"]
            held = await d.estimate("llm", 20)
            assert (held["bytes_written"], held["disk_rate_basis"]) == (0, None)
            # the fixed part: until a prefetch is timed, what resolving the step took the
            # estimate (at least the constant; a busy machine took 0.026 s), then what a
            # prefetch took besides its restore
            assert first["seconds_start"] >= PREFETCH_START_SECONDS
            assert after["seconds_start"] != first["seconds_start"]  # the restore of 20's
            assert held["seconds_start"] >= PREFETCH_START_SECONDS  # no check timed yet
            await prefetched(d, 20)  # a check: held, and timed
            checked = await d.estimate("llm", 20)
            assert checked["seconds_start"] != held["seconds_start"]

    asyncio.run(go())


def test_a_probe_samples_a_quarter_of_the_transfer_within_its_bounds() -> None:
    """A probe costs at most a quarter of the prefetch it stands for, beyond PROBE_BYTES,
    and never more than PROBE_MAX; the sample stops at its budget and follows each chunk
    with the ones after it in its pack (one request of a restore reads such a run)."""
    from agent.peers import probe
    from transfer.engine.chunkindex import ChunkIndex, StoredChunk
    from transfer.engine.ranges import coalesce

    mib = 1 << 20
    assert probe.budget(100 * mib) == probe.PROBE_BYTES
    assert probe.budget(1000 * mib) == 250 * mib
    assert probe.budget(100_000 * mib) == probe.PROBE_MAX
    index = ChunkIndex()
    ids = [hashlib.blake2b(str(n).encode()).hexdigest()[:64] for n in range(200)]
    for n, cid in enumerate(ids):  # two packs of 100 chunks of 4 MiB, stored at 3 MiB each
        index.add(StoredChunk(cid, 4 * mib, "zstd", f"p{n // 100}", (n % 100) * 3 * mib, 3 * mib))
    picked = probe.sample(index, set(ids), {}, run_bytes=probe.RUN_BYTES, budget=250 * mib)
    assert sum(c.size for c in picked) == 252 * mib  # 63 chunks: the one that reaches 250 MiB
    assert len({c.id for c in picked}) == len(picked)
    # what the probe then reads, one request each
    runs = [list(r.chunks) for r in coalesce(picked, max_gap=0)]
    assert max(len(r) for r in runs) >= probe.RUN_BYTES // (3 * mib) and len(runs) <= 63 // 6 + 1
    assert all(b.offset == a.offset + a.stored for r in runs for a, b in itertools.pairwise(r))

    def pack_of(sizes: list[int]) -> ChunkIndex:
        out, offset = ChunkIndex(), 0
        for cid, size in zip(ids, sizes, strict=False):
            out.add(StoredChunk(cid, size, "zstd", "p", offset, size))
            offset += size
        return out

    def stored_runs(picked: list[StoredChunk]) -> list[int]:
        return sorted(sum(c.stored for c in r.chunks) for r in coalesce(picked, max_gap=0))

    # a DCP file cut at its items: three of every four chunks hold small items (64 KiB), yet
    # each request of a tier probe still reads RUN_BYTES, as a restore's long ranges do; a
    # peer's probe (asked chunk by chunk) keeps the mix of sizes by count
    mixed = pack_of([4 * mib if n % 4 == 0 else 64 << 10 for n in range(len(ids))])
    tier = stored_runs(probe.sample(mixed, set(ids), {}, run_bytes=probe.RUN_BYTES))
    assert tier[len(tier) // 2] >= probe.RUN_BYTES
    alone = probe.sample(mixed, set(ids), {}, budget=128 * mib)
    small = sum(c.size < mib for c in alone) / len(alone)
    assert 0.6 < small < 0.9, small
    # every chunk small: a run is still RUN_BYTES long, not six small chunks
    tiny = stored_runs(probe.sample(pack_of([64 << 10] * len(ids)), set(ids), {},
                                    run_bytes=probe.RUN_BYTES))  # fmt: skip
    assert max(tiny) >= min(probe.RUN_BYTES, len(ids) * 64 << 10) // 2


def test_auto_writes_buffered_only_where_the_page_cache_is_the_cheaper_way(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 32: ``write_path = "auto"`` on an agent probes both ways of writing at start
    and keeps buffered restores (the load then reads memory) only where filling the page
    cache is at least as fast as warm, which writes to the device and reads back (one log
    line says what it chose)."""
    from transfer.engine.writepath import page_cache_first

    assert page_cache_first(0.28e9, 0.45e9)  # a slow disk: the page cache is the way
    assert not page_cache_first(1.8e9, 0.3e9)  # one with costly fresh pages: warm
    assert not page_cache_first(1.8e9, 0.3e9, 1.8e9)  # (warm, read back: 0.9 GB/s)
    # a fast disk whose page cache is a little slower than its writes, but faster than
    # writing and reading back (2026-12-07: buffered 0.72x direct's wait, warm 1.03x)
    assert not page_cache_first(1.435e9, 1.282e9)
    assert page_cache_first(1.435e9, 1.282e9, 1.75e9)
    auto_probe_and_estimate(local_url, tmp_path, caplog)


def test_a_probe_slowed_by_other_work_at_start_does_not_choose_the_write_path(
    local_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three agents started together on one disk probed it buffered at 148 MB/s, 174 MB/s
    and 3.5 GB/s, and two of them then wrote every restore the slower way. ``auto`` probes
    each way WRITE_PROBE_ROUNDS times in turn and keeps the best of each: a first buffered
    probe slowed by the start's other work (its rate scripted here: contention cannot be
    made to order) no longer decides. The probes themselves are real writes."""
    from agent.node import prefetch as prefetch_module
    from agent.node.writechoice import recorded_choice

    real_probe = prefetch_module.probe_write
    slowed = iter([20.0])  # the first buffered probe: 20x its real time
    calls: list[bool] = []

    def probe(
        directory: Path, *, direct: bool, workers: int, nbytes: int, read_back: bool
    ) -> DiskProbe:
        calls.append(direct)
        assert read_back is direct  # (auto: warm's read-back is disk work too)
        written = real_probe(directory, direct=direct, workers=workers, nbytes=nbytes).written
        if direct:  # a disk of 1 GB/s direct, reading at 2 GB/s
            return DiskProbe(written, written / 1e9, written / 2e9)
        return DiskProbe(written, written / 3e9 * next(slowed, 1.0))  # the page cache: 3 GB/s

    monkeypatch.setattr(prefetch_module, "probe_write", probe)
    monkeypatch.setattr(prefetch_module, "WRITE_PROBE_BUDGET_SECONDS", 600.0)  # (a slow disk)
    fields, _ = auto_probe_and_estimate(local_url, tmp_path / "a", caplog)
    rounds = prefetch_module.WRITE_PROBE_ROUNDS
    assert rounds >= 2 and calls == [True, False] * rounds
    assert fields["rounds"] == rounds and fields["page_cache_first"] is True, fields
    assert abs(fields["rate_buffered"] - 3e9) <= 1 and abs(fields["rate_direct"] - 1e9) <= 1
    assert abs(fields["rate_read"] - 2e9) <= 1 and abs(fields["rate_warm"] - 2e9 / 3) <= 1
    # left for a one-shot `ferry pull` into that disk (test_write_choice.py), by a thread
    device, deadline = os.stat(tmp_path / "a").st_dev, time.monotonic() + 30
    while recorded_choice(device) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert recorded_choice(device) is True
    # once the rounds so far took the budget, no further round (a slow volume)
    monkeypatch.setattr(prefetch_module, "WRITE_PROBE_BUDGET_SECONDS", 0.0)
    calls.clear()
    caplog.clear()
    fields, _ = auto_probe_and_estimate(local_url, tmp_path / "b", caplog)
    assert calls == [True, False] and fields["rounds"] == 1, fields


@pytest.mark.skipif(
    os.geteuid() != 0 or not BLKIO.is_dir(), reason="a slow disk: the cgroup-v1 blkio throttle"
)
def test_on_a_slow_disk_the_first_estimate_writes_at_the_page_caches_rate(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk that takes O_DIRECT writes at 50 MB/s (a throttle that holds direct I/O
    only): ``auto`` restores go through the page cache, and the first estimate's disk is
    that rate (auto_probe_and_estimate), not the O_DIRECT probe's (2-3x slow here)."""
    with throttled_disk(tmp_path, 50e6):
        fields, _ = auto_probe_and_estimate(local_url, tmp_path, caplog)
    assert fields["page_cache_first"] is True, fields


def auto_probe_and_estimate(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An ``auto`` agent's start-up write probe (its log line's fields) and its first
    estimate of a step that fits in memory, whose disk rate is the probe's figure for the
    way that step's restore writes."""
    from transfer.engine.writepath import page_cache_first

    (k20,) = adamw_series(tmp_path / "src", 1, seed=24, mib=4)

    async def go() -> dict[str, Any]:
        await push_series(local_url, [k20])
        env = {"FERRY_TRANSFER_WRITE_PATH": "auto"}
        async with (
            agent(tmp_path / "e", [local_url], "e", extra_env=env) as url,
            FerryClient(url, TOKEN) as e,
        ):
            first = await e.estimate("llm", 20)  # (waits for the start-up probe)
            await prefetched(e, 20)
            return first

    with caplog.at_level("INFO"):
        estimate = asyncio.run(go())
    (probe,) = [r for r in caplog.records if r.getMessage() == "write_probe"]
    fields: dict[str, Any] = probe.__dict__["ferry_fields"]  # (agent/daemon/logs.py's event)
    assert fields["write_path"] == "auto"
    rule = page_cache_first(fields["rate_direct"], fields["rate_buffered"], fields["rate_read"])
    assert fields["page_cache_first"] is rule
    assert fields["chose"] == ("buffered" if rule else "warm")  # (the way, named)
    best = fields["rate_buffered"] if rule else fields["rate_direct"]
    assert fields["rate_expected"] <= best + 1  # (the median round's: the best chose the way)
    assert estimate["disk_rate_basis"] == "probe"
    assert abs(estimate["disk_rate"] - fields["rate_expected"]) <= 1, (estimate, fields)
    return fields, estimate


def test_the_local_probe_reads_the_largest_file_as_the_re_check_does(tmp_path: Path) -> None:
    """The probe of a copy held here reads (and hashes) the start of its largest file, up
    to PROBE_BYTES, chunk by chunk: all of a file shorter than that, a ragged last chunk
    included; nothing to read is None, not a rate of zero."""
    from agent.peers import probe

    step = tmp_path / "step_000010"
    step.mkdir()
    assert probe.probe_local(step) is None
    (step / ".metadata").write_bytes(b"m" * 100)
    (step / "__0_0.distcp").write_bytes(os.urandom(probe.CHUNK * 2 + 12_345))
    got = probe.probe_local(step)
    assert got is not None and got.moved == got.raw == probe.CHUNK * 2 + 12_345
    assert got.seconds > 0
    (step / "__0_0.distcp").write_bytes(b"")
    (step / ".metadata").unlink()
    assert probe.probe_local(step) is None


def test_a_peer_probe_opens_the_sources_connections_before_it_times_anything() -> None:
    """Each of the peer source's threads opens its connection on its first ask: the probe
    asks PEER_THREADS chunks first, untimed, and times only the rest (timed, the openings
    made the peer's first-contact estimate up to +38% slow)."""
    from agent.peers.chunks import PEER_THREADS
    from agent.peers.probe import probe_peers
    from transfer.engine.chunkindex import StoredChunk

    chunks = [
        StoredChunk(f"{n:064x}", 1000 + n, "zstd", "0" * 32, n * 100, 100)
        for n in range(4 * PEER_THREADS + 3)
    ]
    asked: list[int] = []

    lands: set[object] = set()

    class Peers:  # stands in for PeerSource: the order of the asks is what is checked
        async def __call__(
            self, chunk: StoredChunk, base: object, land: object = None
        ) -> tuple[None, int, str]:
            asked.append(chunks.index(chunk))
            lands.add(land)
            await asyncio.sleep(0)
            return None, chunk.stored, "peer:http://peer"

    got = asyncio.run(probe_peers(Peers(), chunks, {}))  # type: ignore[arg-type]
    assert got is not None and (got.served, got.peer) == (1.0, "http://peer")
    assert sorted(asked[:PEER_THREADS]) == list(range(PEER_THREADS))  # the openers first
    assert got.probe.raw == sum(c.size for c in chunks[PEER_THREADS:])  # only the rest timed
    # every chunk decoded into the source's reused buffers and verified, as a restore lands
    # it (into fresh memory of its own, unhashed, the corpus's first contact through a peer
    # was +18..+30%)
    (land,) = lands
    assert callable(land)
    good = StoredChunk(chunk_id(b"bytes"), 5, "zstd", "0" * 32, 0, 5)
    assert land(good, b"bytes") and not land(good, b"bytez")


def test_the_first_estimate_waits_for_the_start_up_write_probe(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked at an agent's start, the estimate probed the tier while the start-up write
    probe was still writing and reading its disk: each slowed the other, and the corpus's
    first estimate holding k was +68% and +74% off in two runs of three. It now waits for
    the write probe (made slow here, so that the two would overlap) before it probes."""
    from agent.node import prefetch as prefetch_module
    from agent.peers import probe as probe_module

    (k20,) = adamw_series(tmp_path / "src", 1, seed=25, mib=4)
    events: list[tuple[str, float]] = []
    real_disk, real_tier = prefetch_module.probe_write, probe_module.probe_tier

    def slow_disk(directory: Path, **kwargs: Any) -> DiskProbe:
        time.sleep(0.3)
        got = real_disk(directory, **kwargs)
        events.append(("disk probe ended", time.monotonic()))
        return got

    async def tier(*args: Any, **kwargs: Any) -> Any:
        events.append(("tier probe began", time.monotonic()))
        return await real_tier(*args, **kwargs)

    monkeypatch.setattr(prefetch_module, "probe_write", slow_disk)
    monkeypatch.setattr(probe_module, "probe_tier", tier)

    async def go() -> dict[str, Any]:
        await push_series(local_url, [k20])
        async with agent(tmp_path / "e", [local_url], "e") as url, FerryClient(url, TOKEN) as e:
            return await e.estimate("llm", 20)  # at once: the write probe is running

    estimate = asyncio.run(go())
    assert estimate["source"].startswith("tier:") and estimate["rate_basis"] == "probe"
    ended = [t for what, t in events if what == "disk probe ended"]
    assert ended, events  # (the write probe ran: the hot dir has room for it)
    disk_ended = max(ended)
    (tier_began,) = [t for what, t in events if what == "tier probe began"]
    assert tier_began > disk_ended, events


def test_a_peers_delta_rate_is_not_taken_from_its_plain_transfers(
    local_url: str, tmp_path: Path
) -> None:
    """A node holding an earlier step is served deltas its peer encodes per chunk, slower
    than stored chunks: in ``ferry demo``'s second round the first round's plain rate
    predicted 0.03-0.07 s for a prefetch of 0.12-0.23 s, above the range. The two are timed
    apart (estimate.PEER_DELTAS): after a plain transfer from the peer, the first estimate
    of a delta-served one probes; after a delta-served one, it is measured."""
    hot_a = tmp_path / "node-a"
    k20, k40, k60 = adamw_series(hot_a / "llm", 3, seed=26)

    async def go() -> None:
        await push_series(local_url, [k20, k40, k60])
        async with (
            peer_agent(hot_a, [local_url], [], "a") as url_a,
            peer_agent(tmp_path / "b", [local_url], [url_a], "b") as url_b,
            FerryClient(url_b, TOKEN) as b,
        ):
            plain = await prefetched(b, 20)  # onto an empty node: stored chunks, no deltas
            assert plain["bytes_by_source"]["peer"] > 0, plain
            est = await b.estimate("llm", 40)  # holding 20: the peer sends deltas
            assert (est["source"], est["rate_basis"]) == (f"peer:{url_a}", "probe"), est
            assert set(est["bytes_by_source"]) == {"peer"}, est  # (one name for the peers)
            assert (await prefetched(b, 40))["bytes_by_source"]["peer"] > 0
            est = await b.estimate("llm", 60)
            assert (est["source"], est["rate_basis"]) == (f"peer:{url_a}", "measured"), est

    asyncio.run(go())
