"""A fan-out group whose members prefetch different shares (owners by chunk position,
agent/peers/fanout.py), at the edges a review found: a member holding an earlier step reads
only the parts of it its share touches, as it does alone; and a member that adds its share
to its own part of the step serves the chunks of that part it owns to the others (they plan
its share from its layout, its own files included), where each ask waited out a 3 s grace
and went to the tier instead (a 2-member group took 33-39 s, against 0.5-1.2 s)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy, State
from agent.peers.chunks import PeerSource
from agent.rpc.client import FerryClient
from tests.conftest import open_test_store
from tests.fake_dcp import dcp_metadata
from tests.harness import TOKEN, agent, reserve_port
from tests.test_share_parts import JOB, NODES, OPTIONS, SIZES, count_manifest_reads
from transfer.engine import PushPlan, push
from transfer.engine.catalog import Catalog
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.format import layout
from transfer.store.base import Store


async def push_sharded(store: Store, root: Path, step: int, skip: str | None = None) -> None:
    """Every node's part of ``step`` (``skip``'s left out), ``.metadata`` one tensor saved
    Shard(0), a row per rank's file (layouts then read whole rank files); the marker with
    its file map unless a part is missing."""
    for r, node in enumerate(NODES):
        d = root / node / f"step_{step:06d}"
        if not d.exists():
            d.mkdir(parents=True)
            rng = random.Random(r * 1000 + step)
            data = bytearray(random.Random(r).randbytes(SIZES[f"__{r}_0.distcp"]))
            for _ in range(4):
                data[rng.randrange(len(data))] ^= 0xFF
            (d / f"__{r}_0.distcp").write_bytes(data)
            if r == 0:
                (d / ".metadata").write_bytes(dcp_metadata(SIZES, sharded=True))
        if node != skip:
            plan = PushPlan(part=True)
            await push(store, d, job=JOB, step=step, node=node, options=OPTIONS, plan=plan)
    if skip is None:
        doc = completion_doc(JOB, step, await check_step_whole(Catalog(store), JOB, step))
        await store.put(layout.completion_key(JOB, step), json.dumps(doc).encode())


@pytest.mark.parametrize("fanout", [False, True], ids=["alone", "a fan-out member"])
def test_a_member_holding_an_earlier_step_reads_only_its_shares_parts_of_it(
    tmp_path: Path, fanout: bool
) -> None:
    """Steps 10 then 20 prefetched by their share (world 3, rank 1: old ranks 2 and 3):
    of base step 10, the prefetch of 20 reads the parts holding the same files (n0 for
    .metadata, n2, n3), alone and in a group alike (the group's member read all 6)."""
    (tmp_path / "store").mkdir()
    store = open_test_store(str(tmp_path / "store"))
    reads_of_20: Counter[tuple[int, str]] = Counter()

    async def go() -> None:
        for step in (10, 20):
            await push_sharded(store, tmp_path / "src", step)
        refused = reserve_port()  # (the other members do not run: their address refuses)
        members = tuple(f"http://127.0.0.1:{refused}/m{i}" for i in range(3))
        layouts = {url: {"world_size": 3, "ranks": [i]} for i, url in enumerate(members)}
        peers = PeerSource((), "token")
        links = PrefetchLinks(fanout_client=peers)
        policy = PrefetchPolicy(expected_nodes=NODES)
        hot = HotDir(tmp_path / "hot", ".metadata")
        prefetcher = Prefetcher(hot, [("t", store)], OPTIONS, BandwidthMeter(), policy, links)
        reads = count_manifest_reads(store)
        for step in (10, 20):
            reads.clear()
            group: dict[str, Any] = {"fanout": (members, members[1]), "fanout_layouts": layouts}
            record = prefetcher.submit(
                JOB, step, None, layout=layouts[members[1]], **(group if fanout else {})
            )
            assert record.task is not None
            await record.task
            assert record.state is State.READY, record.error
        reads_of_20.update(reads)
        await peers.close()
        await store.close()

    asyncio.run(go())
    assert {node for step, node in reads_of_20 if step == 10} == {"n0", "n2", "n3"}
    assert {node for step, node in reads_of_20 if step == 20} == {"n0", "n2", "n3"}


@pytest.mark.parametrize("tiers", ["AB", "BA"], ids=["its part not in the first tier", "in it"])
def test_a_member_adding_its_share_to_its_own_part_serves_that_part_to_the_group(
    tmp_path: Path, tiers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n4 holds its own part (rank 4's file), not yet in tier A; its share of world 3
    (rank 2: old ranks 4 and 5) lacks rank 5's file, which it adds in place. Member m's
    share (world 2, rank 1: old ranks 3-5) covers rank 4's file too: n4 holds that file
    and so owns every position of it (both learn whose node each member is from its
    /healthz), and m asks n4 for every chunk of it, which serves them from its part. By
    rendezvous hashing of the positions alone, as before, m read some of them from the
    tiers (all of them in about 1 run in 16, by the members' ports)."""
    for t in "ab":
        (tmp_path / t).mkdir()
    a, b = open_test_store(str(tmp_path / "a")), open_test_store(str(tmp_path / "b"))
    asks: list[tuple[str, str, bool, float]] = []  # (peer, chunk id, served, wait)
    ask = PeerSource.ask

    async def counted(self: PeerSource, peer: str, chunk: Any, *args: Any, **kw: Any) -> Any:
        got = await ask(self, peer, chunk, *args, **kw)
        asks.append((peer, chunk.id, got is not None, kw.get("wait", 0.0)))
        return got

    monkeypatch.setattr(PeerSource, "ask", counted)
    alive = PeerSource.alive

    async def patient(self: PeerSource, peer: str, within: float = 2.0) -> bool:
        # n4 is up throughout; a loaded machine must not make m's 2 s health check of it
        # time out and send m to the tiers (correct, but not the path under test)
        return await alive(self, peer, within=30.0)

    monkeypatch.setattr(PeerSource, "alive", patient)
    hot4 = tmp_path / "n4" / "hot"
    own = hot4 / JOB / "step_000010"
    env = {"FERRY_EXPECTED_NODES": ",".join(NODES), "FERRY_QUIET_SECONDS": "600"}
    urls = [str(tmp_path / t.lower()) for t in tiers]

    async def go() -> tuple[dict[str, Any], dict[str, Any], set[str], set[str]]:
        await push_sharded(b, tmp_path / "src", 10)
        await push_sharded(a, tmp_path / "src", 10, skip="n4")
        own.mkdir(parents=True)
        shutil.copy(tmp_path / "src" / "n4" / "step_000010" / "__4_0.distcp", own)
        manifest = await Catalog(b).manifest(JOB, 10, "n4")
        own_ids = {c.id for f in manifest.files for c in f.chunks}
        async with contextlib.AsyncExitStack() as stack:
            enter = stack.enter_async_context
            config = 'commit_marker = ""\n'  # (a node without .metadata: its files are its part)
            u4 = await enter(agent(hot4, urls, "n4", extra_env=env, config_text=config))
            um = await enter(agent(tmp_path / "m" / "hot", urls, "m", extra_env=env))
            layouts = {u4: (3, [2]), um: (2, [1])}
            c4, cm = await enter(FerryClient(u4, TOKEN)), await enter(FerryClient(um, TOKEN))
            ids = [
                await c.prefetch(
                    JOB, "latest", layout=layouts[u], fanout=([u4, um], u), fanout_layouts=layouts
                )
                for c, u in ((c4, u4), (cm, um))
            ]
            waits = (c.wait_prefetch(i, 120) for c, i in zip((c4, cm), ids, strict=True))
            d4, dm = await asyncio.gather(*waits)
            return d4, dm, own_ids, {cid for peer, cid, *_ in asks if peer == u4}

    d4, dm, own_ids, asked_of_n4 = asyncio.run(go())
    asyncio.run(a.close())
    asyncio.run(b.close())
    assert d4["state"] == dm["state"] == "ready", (d4, dm)
    assert d4["satisfied_by"] == "filled_in"  # the share added to its own part
    asked_of_own = asked_of_n4 & own_ids
    assert asked_of_own == own_ids  # m counted on n4 for every chunk of n4's own file ...
    # ... without a wait (a holder serves from its part at once, or lost it: the tiers)
    assert {wait for peer, cid, _, wait in asks if cid in own_ids} == {0.0}
    served = {cid for _, cid, ok, _ in asks if ok}
    assert asked_of_own <= served, len(asked_of_own - served)  # ... and got every one
