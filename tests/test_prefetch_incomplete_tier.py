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
from transfer.engine import PushPlan, push
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


def prefetcher(
    tmp_path: Path, tiers: list[tuple[str, Store]], expected: tuple[str, ...] = NODES
) -> Prefetcher:
    hot = HotDir(tmp_path / "hot", "")
    policy = PrefetchPolicy(expected_nodes=expected)
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


def test_a_step_whose_parts_are_all_in_but_lack_a_file_comes_from_the_next_tier(
    tmp_path: Path,
) -> None:
    """n2's part in the first tier holds no rank-2 file (a torn part: every part is in, and
    .metadata names a file none holds): the step comes from the next tier, whole."""
    warm = tier(tmp_path, "warm", torn="n2")
    lacking = tmp_path / "n2-torn" / "step_000010"
    lacking.mkdir(parents=True)
    (lacking / "notes.txt").write_text("no shard here")
    asyncio.run(push(warm, lacking, job=JOB, step=10, node="n2", options=OPTIONS,
                     plan=PushPlan(part=True)))  # fmt: skip
    tiers = [("warm", warm), ("cold", tier(tmp_path, "cold", torn=None))]
    record = prefetched(prefetcher(tmp_path, tiers), None)
    assert record.state is State.READY, record.error
    here = tmp_path / "hot" / JOB / "step_000010"
    assert (here / "__2_0.distcp").read_bytes() == (
        tmp_path / "src-cold/n2/step_000010/__2_0.distcp"
    ).read_bytes()
    assert not (here / "notes.txt").exists()


def test_a_step_torn_in_every_tier_is_refused_naming_the_missing_part(tmp_path: Path) -> None:
    """Nothing is restored, and the error says which node's part is not in yet."""
    record = prefetched(prefetcher(tmp_path, [("warm", tier(tmp_path, "warm", torn="n2"))]), None)
    assert record.state is State.FAILED
    assert record.error is not None and "5 of 6 parts, none yet from n2" in record.error
    assert not (tmp_path / "hot" / JOB / "step_000010").exists()


def test_parts_that_land_with_the_marker_during_the_check_are_read(tmp_path: Path) -> None:
    """The last part (n0's: .metadata) and the marker land between the listing of the parts
    and the read of the marker: the parts are read again, so the prefetch restores the
    whole step (before, it restored the five it had listed and called them ready)."""
    store = tier(tmp_path, "warm", torn=None)
    marker_key, n0_key = layout.completion_key(JOB, 10), layout.manifest_key(JOB, 10, "n0")

    async def hold_back() -> tuple[bytes, bytes]:
        held = await store.get(marker_key), await store.get(n0_key)
        for key in (marker_key, n0_key):
            await store.delete(key)
        return held

    marker, n0 = asyncio.run(hold_back())
    get = store.get

    async def landing_now(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key == marker_key and not await store.exists(key):
            await store.put(n0_key, n0)
            await store.put(marker_key, marker)
        return await get(key, start, end)

    store.get = landing_now  # type: ignore[method-assign]
    record = prefetched(prefetcher(tmp_path, [("warm", store)]), None)
    assert record.state is State.READY, record.error
    here = tmp_path / "hot" / JOB / "step_000010"
    for name in (".metadata", "__0_0.distcp"):
        assert (here / name).read_bytes() == (
            tmp_path / "src-warm/n0/step_000010" / name
        ).read_bytes()


def test_an_estimate_of_a_step_torn_everywhere_says_which_part_is_missing(tmp_path: Path) -> None:
    """A real agent: the estimate skips a torn tier as the prefetch does, and its 404 says
    why (before: only "no tier holds" it)."""
    from agent.rpc.client import FerryClient, RpcError
    from tests.harness import TOKEN, agent

    tier(tmp_path, "warm", torn="n2")
    env = {"FERRY_EXPECTED_NODES": ",".join(NODES)}

    async def go() -> str:
        async with (
            agent(tmp_path / "hot", [str(tmp_path / "warm")], "n4", extra_env=env) as url,
            FerryClient(url, TOKEN) as client,
        ):
            with pytest.raises(RpcError) as err:
                await client.estimate(JOB, 10)
            return str(err.value)

    message = asyncio.run(go())
    assert "no tier holds job 'llm' step 10" in message
    assert "5 of 6 parts, none yet from n2" in message


def test_without_expected_nodes_a_step_without_its_marker_is_not_whole(tmp_path: Path) -> None:
    """An agent that is not told the job's nodes (a spare node) knows a multi-node job by
    its completion markers: a step of such a job without its marker is not whole there
    (before, with n0's part missing, it was restored torn and called ready); the latest
    complete step is the one with a marker."""
    warm = tier(tmp_path, "warm", torn="n0")
    cold = tier(tmp_path, "cold", torn=None)
    asyncio.run(push_step(warm, tmp_path / "src-warm-20", 20))  # a job that writes markers
    record = prefetched(prefetcher(tmp_path, [("warm", warm), ("cold", cold)], ()), None)
    assert record.state is State.READY, record.error
    assert set(record.bytes_by_source) == {"tier:cold"}, record.bytes_by_source

    alone = prefetched(prefetcher(tmp_path / "b", [("warm", warm)], ()), None)
    assert alone.state is State.FAILED
    assert alone.error is not None and "no completion marker yet, 5 part(s) in" in alone.error


def test_ferry_pull_of_a_step_without_its_marker_is_refused_and_latest_is_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README says a pull without --node never lands a step with a part missing: with
    n0's part (and .metadata) missing there was nothing to find the gap by, and it did."""
    from agent.cli.run import main as ferry

    warm = tier(tmp_path, "warm", torn="n0")
    asyncio.run(push_step(warm, tmp_path / "src-20", 20))
    url, dest = str(tmp_path / "warm"), tmp_path / "pulled"
    assert ferry(["pull", url, str(dest / "10"), "--job", JOB, "--step", "10"]) == 1
    err = capsys.readouterr().err
    assert "llm step 10 is not whole" in err and "no completion marker yet" in err, err
    assert not (dest / "10").exists()
    assert ferry(["pull", url, str(dest / "latest"), "--job", JOB]) == 0
    assert "pulled llm step 20 (6 part(s))" in capsys.readouterr().out
    assert ferry(["pull", url, str(dest / "n1"), "--job", JOB, "--step", "10", "--node", "n1"]) == 0
    # every part in, the marker never written (its writer died): whole when told the nodes
    asyncio.run(push_step(warm, tmp_path / "src-30", 30, marker=False))
    assert ferry(["pull", url, str(dest / "30"), "--job", JOB, "--step", "30"]) == 1
    assert "6 part(s) in" in capsys.readouterr().err
    told = ["--expected-nodes", ",".join(NODES)]
    assert ferry(["pull", url, str(dest / "30"), "--job", JOB, "--step", "30", *told]) == 0
    assert ferry(["pin", url, "--job", JOB, "--step", "latest"]) == 0  # latest: as a pull's
    assert "step 20" in capsys.readouterr().out
