"""One rule for "is this step whole", asked by the prefetcher and the listing
(catalog.is_complete, on a real local store with real pushed parts) and by retention
(inventory), so the two can never disagree."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.conftest import make_checkpoint
from tests.fake_dcp import dcp_metadata
from transfer.engine import PushPlan, push
from transfer.engine.catalog import (
    complete_steps,
    is_complete,
    latest_complete_step,
    step_is_complete,
)
from transfer.errors import FerryError
from transfer.format import layout
from transfer.retention.inventory import take_inventory
from transfer.retention.plan import kept_steps
from transfer.retention.policy import TierPolicy
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


def test_a_torn_step_with_every_expected_part_is_whole_nowhere(tmp_path: Path) -> None:
    """A newcomer's trial: node b wrote one file late, and its agent pushed its part
    without it; the agent that found the step torn wrote no marker, but every expected
    node's part was in, so the listing, "latest" and retention took the step for whole
    (retention keeping only it would expire the last loadable step). Now each confirms a
    step no marker vouches for by its files: the torn step is whole nowhere, the step
    before it is "latest" and is kept."""
    files = {"__0_0.distcp": 40_000, "__1_0.distcp": 40_000}
    meta = dcp_metadata(files)

    def part(root: Path, names: tuple[str, ...], with_meta: bool) -> Path:
        root.mkdir(parents=True)
        for name in names:
            (root / name).write_bytes(bytes([len(name)]) * files[name])
        if with_meta:
            (root / ".metadata").write_bytes(meta)
        return root

    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    expected = ("a", "b")

    async def go() -> tuple[bool, bool, set[int], int, dict[int, bool], list[int]]:
        for step, b_files in ((10, ("__1_0.distcp",)), (20, ())):  # step 20: b's file late
            a = part(tmp_path / f"a{step}", ("__0_0.distcp",), True)
            b = part(tmp_path / f"b{step}", b_files, False)
            if not b_files:
                (b / "notes.txt").write_text("b's part, pushed before __1_0.distcp landed")
            for node, root in (("a", a), ("b", b)):
                await push(store, root, job="j", step=step, node=node, plan=PushPlan(part=True))
        inventory = await take_inventory(store, now=time.time(), expected_nodes=expected)
        kept, _ = kept_steps(inventory, TierPolicy(keep_last=1), time.time(), ())
        return (
            await is_complete(store, "j", 10, expected),
            await is_complete(store, "j", 20, expected),
            await complete_steps(store, "j", expected),
            await latest_complete_step(store, "j", expected),
            {step: e.complete for (_, step), e in inventory.steps.items()},
            sorted(step for _, step in kept),
        )

    whole10, whole20, listed, latest, taken_as_whole, kept = asyncio.run(go())
    assert (whole10, whole20) == (True, False)
    assert listed == {10} and latest == 10
    assert taken_as_whole == {10: True, 20: False}
    assert 10 in kept  # keep_last=1: the last loadable step stays


def test_a_step_whose_metadata_cannot_be_read_is_not_whole_and_fails_nothing(
    tmp_path: Path,
) -> None:
    """Every expected part in, no marker, and the pack holding ``.metadata`` lost: the
    listing and retention take the step for not whole (retention's inventory says the rest)
    instead of failing on it, and "latest", as a pull asks it, names the lost pack."""
    files = {"__0_0.distcp": 40_000}
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    src = tmp_path / "a"
    src.mkdir()
    (src / "__0_0.distcp").write_bytes(b"w" * files["__0_0.distcp"])
    (src / ".metadata").write_bytes(dcp_metadata(files))
    empty = tmp_path / "b"
    empty.mkdir()
    (empty / "notes.txt").write_text("b's part holds no shard")

    async def go() -> tuple[set[int], dict[int, bool], str]:
        for node, root in (("a", src), ("b", empty)):
            await push(store, root, job="j", step=10, node=node, plan=PushPlan(part=True))
        for pack in (tmp_path / "store" / "packs").rglob("*.pack"):
            pack.unlink()
        listed = await complete_steps(store, "j", ("a", "b"))
        inventory = await take_inventory(store, now=time.time(), expected_nodes=("a", "b"))
        with pytest.raises(FerryError) as refused:
            await latest_complete_step(store, "j", ("a", "b"))
        return listed, {s: e.complete for (_, s), e in inventory.steps.items()}, str(refused.value)

    listed, taken_as_whole, said = asyncio.run(go())
    assert listed == set() and taken_as_whole == {10: False}
    assert "not found" in said or "missing" in said, said
