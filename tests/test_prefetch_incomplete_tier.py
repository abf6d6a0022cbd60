"""A prefetch of a named step that the first tier holds only some parts of (its push there
is still running, or it failed for some nodes) takes the step from the next tier that holds
it whole: for the whole step and for a survivor's share alike. Neither restores a torn
step, and neither fails while a colder tier holds the step whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchPolicy, State
from tests.conftest import init_test_store, open_test_store
from tests.test_share_parts import ITEMS, JOB, NODES, OPTIONS, push_step
from transfer.format import layout


@pytest.mark.parametrize("items", [None, ITEMS], ids=["the whole step", "a share"])
@pytest.mark.parametrize("torn", ["n0", "n2"], ids=["no .metadata part", "no rank-2 part"])
def test_a_step_torn_in_the_first_tier_comes_from_the_next(
    tmp_path: Path, items: object, torn: str
) -> None:
    """Before, the whole step without n0's part (.metadata) was restored torn and called
    ready; without n2's it failed, and a share failed either way."""
    warm, cold = (init_test_store(str(tmp_path / name)) for name in ("warm", "cold"))
    for url in (warm, cold):
        Path(url).mkdir(exist_ok=True)

    async def go() -> object:
        warm_store, cold_store = open_test_store(warm), open_test_store(cold)
        await push_step(warm_store, tmp_path / "src-warm", 10, marker=False)
        await push_step(cold_store, tmp_path / "src-cold", 10)
        await warm_store.delete(layout.manifest_key(JOB, 10, torn))  # warm: that part not yet
        prefetcher = Prefetcher(
            HotDir(tmp_path / "hot", ""), [("warm", warm_store), ("cold", cold_store)],
            OPTIONS, BandwidthMeter(), PrefetchPolicy(expected_nodes=NODES),
        )  # fmt: skip
        record = prefetcher.submit(JOB, 10, None, items=items)
        assert record.task is not None
        await record.task
        return record

    record = asyncio.run(go())
    assert record.state is State.READY, record.error
    assert set(record.bytes_by_source) == {"tier:cold"}, record.bytes_by_source
    here = tmp_path / "hot" / JOB / "step_000010"
    if items is None:  # every part's files, as saved
        for node in NODES:
            for f in (tmp_path / "src-cold" / node / "step_000010").iterdir():
                assert (here / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_step_torn_in_every_tier_is_refused_naming_the_missing_part(tmp_path: Path) -> None:
    """Nothing is restored, and the error says which node's part is not in yet."""
    warm = init_test_store(str(tmp_path / "warm"))
    Path(warm).mkdir(exist_ok=True)

    async def go() -> object:
        store = open_test_store(warm)
        await push_step(store, tmp_path / "src", 10, marker=False)
        await store.delete(layout.manifest_key(JOB, 10, "n2"))
        prefetcher = Prefetcher(
            HotDir(tmp_path / "hot", ""), [("warm", store)], OPTIONS, BandwidthMeter(),
            PrefetchPolicy(expected_nodes=NODES),
        )  # fmt: skip
        record = prefetcher.submit(JOB, 10, None)
        assert record.task is not None
        await record.task
        return record

    record = asyncio.run(go())
    assert record.state is State.FAILED
    assert record.error is not None and "5 of 6 parts, none yet from n2" in record.error
    assert not (tmp_path / "hot" / JOB / "step_000010").exists()
