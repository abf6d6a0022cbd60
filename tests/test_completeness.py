"""One rule for "is this step whole", asked by the prefetcher and the listing
(catalog.is_complete, on a real local store with real pushed parts) and by retention
(inventory), so the two can never disagree."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.conftest import make_checkpoint
from transfer.engine import push
from transfer.engine.catalog import is_complete, step_is_complete
from transfer.format import layout
from transfer.retention.inventory import take_inventory
from transfer.store.local import LocalStore


@pytest.mark.parametrize(
    ("parts", "marker", "expected", "job_writes_markers", "whole"),
    [
        ({"a"}, True, ("a", "b"), True, True),  # the marker says so
        ({"a", "b"}, False, ("a", "b"), True, True),  # every part, the marker's writer died
        ({"a"}, False, ("a", "b"), True, False),  # a node still pushing
        ({"a"}, False, (), False, True),  # a single-node job: its one part
        ({"a"}, False, (), True, False),  # a multi-node job seen without its node list
    ],
)
def test_the_rule(
    parts: set[str], marker: bool, expected: tuple[str, ...], job_writes_markers: bool, whole: bool
) -> None:
    assert step_is_complete(parts, marker, expected, job_writes_markers) is whole


def test_the_catalog_and_retention_agree_on_a_real_store(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "step_000010", shard_bytes=100_000)
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir()

    async def go() -> dict[tuple[str, int, tuple[str, ...]], tuple[bool, bool]]:
        for job, step, nodes in (("multi", 10, ("a", "b")), ("multi", 20, ("a",))):
            for node in nodes:
                await push(store, ckpt, job=job, step=step, node=node)
        await push(store, ckpt, job="single", step=10, node="a")
        await store.put(layout.completion_key("multi", 30), b"{}")  # a marker: the step is
        await push(store, ckpt, job="multi", step=30, node="a")  # whole by its word
        seen = {}
        for expected in (("a", "b"), ()):
            inventory = await take_inventory(store, now=time.time(), expected_nodes=expected)
            for (job, step), entry in inventory.steps.items():
                ours = await is_complete(store, job, step, expected)
                seen[(job, step, expected)] = (ours, entry.complete)
        return seen

    seen = asyncio.run(go())
    assert all(ours == theirs for ours, theirs in seen.values()), seen
    assert {key: ours for key, (ours, _) in seen.items()} == {
        ("multi", 10, ("a", "b")): True,  # both parts, no marker
        ("multi", 20, ("a", "b")): False,
        ("multi", 30, ("a", "b")): True,
        ("single", 10, ("a", "b")): False,  # seen as a multi-node job: b is missing
        ("multi", 10, ()): False,  # the job writes markers: a part is not the step
        ("multi", 20, ()): False,
        ("multi", 30, ()): True,
        ("single", 10, ()): True,
    }
