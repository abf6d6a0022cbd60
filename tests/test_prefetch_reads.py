"""A prefetch reads each manifest it restores once: the catalog picks the step and resolves
its manifests (resolve_checkpoint), and pull takes them as they are (``manifests=``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchPolicy, State
from tests.conftest import make_checkpoint, open_test_store
from transfer.engine import push
from transfer.format import layout
from transfer.options import TransferOptions
from transfer.store.base import Store

JOB, NODES = "llm", ("a", "b")


def _count_manifest_reads(store: Store) -> Counter[str]:
    """Counts, per manifest key, the store's get() calls from now on."""
    reads: Counter[str] = Counter()
    get = store.get

    async def counting_get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if layout.parse_manifest_key(key) is not None:
            reads[key] += 1
        return await get(key, start, end)

    store.get = counting_get  # type: ignore[method-assign]
    return reads


def test_a_prefetch_reads_each_manifest_once(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "src", shard_bytes=50_000)
    (tmp_path / "store").mkdir()
    store = open_test_store(str(tmp_path / "store"))
    hot = HotDir(tmp_path / "hot", ".metadata")

    async def go() -> tuple[dict[str, int], dict[str, int]]:
        for step in (10, 20):
            for node in NODES:  # a two-node checkpoint: two manifests per step
                await push(store, ckpt, job=JOB, step=step, node=node)
        reads = _count_manifest_reads(store)
        prefetcher = Prefetcher(
            hot,
            [("t", store)],
            TransferOptions(),
            BandwidthMeter(),
            PrefetchPolicy(expected_nodes=NODES),
        )
        seen = []
        for step in (10, None):  # the second: the latest complete step, with 10 as its base
            record = prefetcher.submit(JOB, step, None)
            assert record.task is not None
            await record.task
            assert record.state is State.READY, record.error
            seen.append(dict(reads))
            reads.clear()
        return seen[0], seen[1]

    first, latest = asyncio.run(go())
    keys = {step: {layout.manifest_key(JOB, step, n) for n in NODES} for step in (10, 20)}
    assert first == dict.fromkeys(keys[10], 1)
    # step 20's manifests once (not again by pull); step 10's once, as the base's
    assert latest == dict.fromkeys(keys[20] | keys[10], 1)
    assert (hot.step_path(JOB, 20) / "__0_0.distcp").read_bytes() == (
        ckpt / "__0_0.distcp"
    ).read_bytes()


def test_finished_prefetches_are_forgotten_beyond_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon serving prefetches for months kept every record (and every destination
    lock) forever, and /metrics walked them all: only the newest HISTORY finished ones are
    kept, the running ones always."""
    monkeypatch.setattr(Prefetcher, "HISTORY", 5)
    (tmp_path / "store").mkdir()
    store = open_test_store(str(tmp_path / "store"))
    prefetcher = Prefetcher(
        HotDir(tmp_path / "hot", ".metadata"), [("t", store)], TransferOptions(), BandwidthMeter()
    )

    async def go() -> list[str]:
        ckpt = make_checkpoint(tmp_path / "src", shard_bytes=10_000)
        await push(store, ckpt, job=JOB, step=1, node="a")  # step 1 restores: it takes a lock
        ids = []
        for step in range(40):  # no other step is in the store: each fails at once
            record = prefetcher.submit(JOB, step, None)
            assert record.task is not None
            await record.task
            ids.append(record.id)
        return ids

    ids = asyncio.run(go())
    assert len(prefetcher.jobs) <= 6  # 5 finished + the newest
    assert ids[-1] in prefetcher.jobs and ids[0] not in prefetcher.jobs
    assert prefetcher.jobs[ids[-1]].state is State.FAILED
    assert not prefetcher._dest_locks  # step 1's, taken by its restore, went with it
