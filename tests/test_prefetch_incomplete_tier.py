"""A prefetch of a named step that the first tier holds only some parts of (its push there
is still running, or it failed for some nodes) takes the step from the next tier that holds
it whole: for the whole step and for a survivor's share alike. Neither restores a torn
step, and neither fails while a colder tier holds the step whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchPolicy, State
from tests.conftest import init_test_store, open_test_store
from tests.test_share_parts import ITEMS, JOB, NODES, OPTIONS, prefetched, push_step
from transfer.format import layout
from transfer.store.base import Store


def tier(tmp_path: Path, name: str, *, torn: str | None) -> Store:
    """A local tier holding step 10: every node's part and the marker, or (``torn``) every
    part but that node's and no marker (that node's push there still to come)."""
    url = tmp_path / name
    url.mkdir()
    store = open_test_store(init_test_store(str(url)))

    async def go() -> None:
        await push_step(store, tmp_path / f"src-{name}", 10, marker=torn is None)
        if torn is not None:
            await store.delete(layout.manifest_key(JOB, 10, torn))

    asyncio.run(go())
    return store


def prefetcher(tmp_path: Path, tiers: list[tuple[str, Store]]) -> Prefetcher:
    hot = HotDir(tmp_path / "hot", "")
    policy = PrefetchPolicy(expected_nodes=NODES)
    return Prefetcher(hot, tiers, OPTIONS, BandwidthMeter(), policy)


@pytest.mark.parametrize("items", [None, ITEMS], ids=["the whole step", "a share"])
@pytest.mark.parametrize("torn", ["n0", "n2"], ids=["no .metadata part", "no rank-2 part"])
def test_a_step_torn_in_the_first_tier_comes_from_the_next(
    tmp_path: Path, items: list[dict[str, Any]] | None, torn: str
) -> None:
    """Before, the whole step without n0's part (.metadata) was restored torn and called
    ready; without n2's it failed, and a share failed either way."""
    tiers = [
        ("warm", tier(tmp_path, "warm", torn=torn)),
        ("cold", tier(tmp_path, "cold", torn=None)),
    ]
    record = prefetched(prefetcher(tmp_path, tiers), items)
    assert record.state is State.READY, record.error
    assert set(record.bytes_by_source) == {"tier:cold"}, record.bytes_by_source
    here = tmp_path / "hot" / JOB / "step_000010"
    if items is None:  # every part's files, as saved
        for node in NODES:
            for f in (tmp_path / "src-cold" / node / "step_000010").iterdir():
                assert (here / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_step_torn_in_every_tier_is_refused_naming_the_missing_part(tmp_path: Path) -> None:
    """Nothing is restored, and the error says which node's part is not in yet."""
    record = prefetched(prefetcher(tmp_path, [("warm", tier(tmp_path, "warm", torn="n2"))]), None)
    assert record.state is State.FAILED
    assert record.error is not None and "5 of 6 parts, none yet from n2" in record.error
    assert not (tmp_path / "hot" / JOB / "step_000010").exists()
