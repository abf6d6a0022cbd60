"""A multi-node job pushed by hand (``ferry push --part`` on each node) writes no completion
markers. Told no nodes, nothing may take one of its steps for whole by its parts alone: a
newcomer's trial had ``ferry retention --keep-last 1`` keep a step of two parts without
``.metadata`` as "the newest complete" and delete every step that could be loaded, and
``--step latest`` pull it. Now retention keeps every step of such a job, and several nodes'
parts without ``.metadata`` are never the whole step, nor parts that lack a file it names
(a pull of latest takes the newest step whose parts hold every file: a torn one is
skipped, not pulled and refused); told the nodes, all of it works."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from tests.conftest import init_test_store, open_test_store
from tests.test_share_parts import JOB, NODES, push_step
from transfer.format import layout
from transfer.retention import EXPIRE, Tier, TierPolicy, make_plan
from transfer.store.base import Store


def pushed_by_hand(tmp_path: Path, missing: dict[int, set[str]]) -> tuple[str, Store]:
    """Steps 10 to 40 pushed as every node's part, no markers anywhere, then the parts
    ``missing`` names deleted."""
    (tmp_path / "store").mkdir()
    url = init_test_store(str(tmp_path / "store"))
    store = open_test_store(url)

    async def go() -> None:
        for step in (10, 20, 30, 40):
            await push_step(store, tmp_path / f"src-{step}", step, marker=False)
        for step, nodes in missing.items():
            for node in sorted(nodes):
                await store.delete(layout.manifest_key(JOB, step, node))

    asyncio.run(go())
    return url, store


@pytest.fixture
def hand_pushed(tmp_path: Path) -> tuple[str, Store]:
    """Steps 10 and 20 whole (every node's part), 30 without n5's part, 40 without n0's
    (which holds .metadata); no markers anywhere."""
    return pushed_by_hand(tmp_path, {30: {"n5"}, 40: {"n0"}})


def expired(store: Store, expected: tuple[str, ...]) -> list[int]:
    tiers = [Tier(store, TierPolicy(keep_last=1))]
    plan = asyncio.run(make_plan(tiers, now=time.time(), expected_nodes=expected))
    return [a.step for a in plan.tiers[0].actions if a.action == EXPIRE]


def test_retention_keeps_every_step_of_a_job_it_cannot_judge(
    hand_pushed: tuple[str, Store],
) -> None:
    _, store = hand_pushed
    assert expired(store, ()) == []  # it expired 10, 20 and 30, keeping 40 as "complete"
    assert expired(store, NODES) == [10]  # 20 the newest whole; 30 and 40 still coming


def test_a_pull_never_lands_a_torn_step_and_told_the_nodes_takes_the_newest_whole(
    hand_pushed: tuple[str, Store], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = hand_pushed
    dest = tmp_path / "pulled"
    # latest: the newest step whose parts hold every file .metadata names (30 is torn by
    # it, 40 lacks it): it failed on 30, which the pull's own check then refused
    assert ferry(["pull", url, str(dest / "a"), "--job", JOB]) == 0
    assert f"pulled {JOB} step 20 (6 part(s))" in capsys.readouterr().out
    told = ["--expected-nodes", ",".join(NODES)]
    assert ferry(["pull", url, str(dest / "b"), "--job", JOB, *told]) == 0
    assert f"pulled {JOB} step 20 (6 part(s))" in capsys.readouterr().out
    assert ferry(["pull", url, str(dest / "c"), "--job", JOB, "--step", "40"]) == 1
    assert "no part of the 5 in holds .metadata" in capsys.readouterr().err
    assert ferry(["pull", url, str(dest / "d"), "--job", JOB, "--step", "30"]) == 1
    assert "is not whole" in capsys.readouterr().err  # (.metadata names n5's file)
    assert not any((dest / x).exists() for x in "cd")


def test_one_nodes_part_is_never_latest_unless_it_holds_the_whole_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: the newest step held one node's part only. Without
    ``.metadata`` (n3's), ``--step latest`` pulled it, exit 0, and it could not be
    loaded; with ``.metadata`` but another node's shards missing (n0's alone), latest
    stopped there and failed. Both are skipped for the newest whole step."""
    others = set(NODES)
    url, _ = pushed_by_hand(tmp_path, {30: others - {"n3"}, 40: others - {"n0"}})
    assert ferry(["pull", url, str(tmp_path / "latest"), "--job", JOB]) == 0
    assert f"pulled {JOB} step 20 (6 part(s))" in capsys.readouterr().out
    assert ferry(["pull", url, str(tmp_path / "n3"), "--job", JOB, "--step", "30"]) == 1
    assert "no part of the 1 in holds .metadata" in capsys.readouterr().err
    assert ferry(["pull", url, str(tmp_path / "n3-part"), "--job", JOB, "--step", "30",
                  "--node", "n3"]) == 0  # fmt: skip
