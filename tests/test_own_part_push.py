"""A node's own part of a step, not yet durable in every tier, that a prefetch adds to (the
whole step, or a survivor's share of it) goes on being pushed, its own files alone, until
it is: the colder tier gets this node's part, the step becomes whole there, and no other
node's file is ever pushed under this node's name. Before, the prefetch marked the step
"restored here": the part never reached the tier it had not reached yet, and a retry of its
push that was already waiting pushed every file the directory then held as this node's."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy, State
from tests.conftest import init_test_store, open_test_store
from tests.harness import make_queue, tier_states, until
from tests.test_share_parts import ITEMS, JOB, NODES, OPTIONS, SIZES, push_step
from transfer.engine import PullPlan, PushPlan, pull, push
from transfer.engine.catalog import load_manifest
from transfer.format import layout

SURVIVOR = "n4"


@pytest.mark.parametrize("share", [False, True], ids=["the whole step", "a share"])
def test_a_part_added_to_before_it_reached_every_tier_still_reaches_them_alone(
    tmp_path: Path, share: bool
) -> None:
    warm, cold = tmp_path / "warm", tmp_path / "cold-not-mounted-yet"
    warm.mkdir()
    init_test_store(str(warm))
    src = tmp_path / "src"
    hot = tmp_path / "hot"
    here = hot / JOB / "step_000010"

    async def go() -> None:
        store = open_test_store(str(warm))
        await push_step(store, src, 10)  # every node's part in warm, and the marker
        here.mkdir(parents=True)  # n4's own part, as training wrote it
        shutil.copy(src / SURVIVOR / "step_000010" / "__4_0.distcp", here)
        queue, (warm_store, cold_store) = make_queue(
            [str(warm), str(cold)], tmp_path / "state", SURVIVOR, expected_nodes=NODES,
            retry_seconds=0.2, max_attempts=8, options=OPTIONS,
        )  # fmt: skip
        await queue.start()
        try:
            assert queue.enqueue(JOB, 10, here)  # (a part without .metadata: no watcher)
            # warm: durable (found committed); cold: not a store yet, retried
            await until(lambda: _state(queue, str(warm)) == "durable", within=30)
            await until(lambda: _state(queue, str(cold)) == "failed", within=30)
            prefetcher = Prefetcher(
                HotDir(hot, ""),
                [("warm", warm_store), ("cold", cold_store)],
                OPTIONS,
                BandwidthMeter(),
                PrefetchPolicy(expected_nodes=NODES),
                PrefetchLinks(on_restore=queue.exclude, own_part=queue.keep_own_part),
            )
            record = prefetcher.submit(JOB, 10, None, items=ITEMS if share else None)
            assert record.task is not None
            await record.task
            assert record.state is State.READY, record.error
            assert record.satisfied_by == "filled_in"
            assert (JOB, 10) in {(j, s) for j, s, _ in queue.journal.pending()}  # kept
            # the tier is mounted, holding the other nodes' parts: n4's retry pushes its
            # part there, the last one, and so writes the step's marker
            mounting = tmp_path / "cold-being-mounted"
            mounting.mkdir()
            others = open_test_store(str(mounting))
            for node in NODES:
                if node != SURVIVOR:
                    d = src / node / "step_000010"
                    await push(others, d, job=JOB, step=10, node=node, options=OPTIONS,
                               plan=PushPlan(part=True))  # fmt: skip
            await others.close()
            mounting.rename(cold)
            await until(lambda: _state(queue, str(cold)) == "durable", within=60)
        finally:
            await queue.drain(0)
            queue.close()
        # n4's manifest in cold names its own file alone, though the directory held more
        mine = await load_manifest(cold_store, JOB, 10, SURVIVOR)
        assert [f.path for f in mine.files] == ["__4_0.distcp"]
        assert len(list(here.iterdir())) > 1  # (what the prefetch added beside it)
        # its push completed the step there: whole, every byte as saved
        await cold_store.head(layout.completion_key(JOB, 10))
        out = tmp_path / "from-cold"
        await pull(cold_store, out, PullPlan(JOB, 10))
        assert _tree(out) == _tree_of_parts(src)
        assert set(_tree(out)) == {*SIZES, ".metadata", "config.json"}
        for s in (store, warm_store, cold_store):
            await s.close()

    asyncio.run(go())


def _state(queue: Any, tier: str) -> str | None:
    row = tier_states(queue, JOB, 10).get(tier)
    return None if row is None else str(row["state"])


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _tree_of_parts(src: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for node in NODES:
        out.update(_tree(src / node / "step_000010"))
    return out
