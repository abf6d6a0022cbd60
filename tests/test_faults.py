"""Faults injected by a real proxy in front of the real S3 server (tests/faultproxy.py): with
10% of requests failing (5xx, SlowDown, resets, lost replies, stalls, torn and short bodies)
push, pull, verify, the agent's background push and a prefetch all complete byte-exact; with
the store down they fail fast with a clear error and work again once it is back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from agent.rpc.client import FerryClient
from tests.conftest import adamw_series, random_bytes, tree_bytes
from tests.faultproxy import KINDS, FaultProxy
from tests.harness import (
    TOKEN,
    agent,
    make_queue,
    push_series,
    queue_agent,
    save,
    tier_states,
    until,
)
from tests.s3server import S3Endpoint
from transfer.errors import StoreError
from transfer.format.layout import PACKS_PREFIX
from transfer.store import StoreOptions, open_store
from transfer.store.retry import RetryPolicy

SMALL = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]
FAULT_RATE = 0.10
DOWN_DEADLINE_S = 60  # generous: a dead store must be reported well within a minute


def make_multipart_checkpoint(root: Path, seed: int = 0) -> Path:
    """~27 MB in three shards: several 10 MiB packs of two 5 MiB parts each."""
    save(
        root,
        {
            "__0_0.distcp": random_bytes(13_000_000, seed),
            "__1_0.distcp": random_bytes(9_000_000, seed + 1),
            "__2_0.distcp": random_bytes(5_000_000, seed + 2),
        },
    )
    return root


def pending_uploads(url: str, endpoint: str) -> list[str]:
    async def go() -> list[str]:
        store = open_store(url, StoreOptions(endpoint_url=endpoint))
        try:
            return [u.key for u in await store.list_uploads(PACKS_PREFIX)]
        finally:
            await store.close()

    return asyncio.run(go())


def assert_faults_injected(proxy: FaultProxy, at_least: int) -> None:
    injected = sum(proxy.stats.faults.values())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(proxy.stats.faults.items()))
    print(f"\nfaults: {injected} of {proxy.stats.requests} requests ({kinds})")
    assert injected >= at_least, proxy.stats
    assert len(proxy.stats.faults) >= 3, proxy.stats  # several kinds, not one


def test_cli_push_pull_verify_with_10pct_faulty_requests(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_multipart_checkpoint(tmp_path / "step_000010")
    via = ["--endpoint-url", s3_proxy.url, *SMALL, "--window", "4"]
    s3_proxy.set_faults(FAULT_RATE, KINDS)
    assert ferry(["push", str(src), s3_url, "--job", "j", "--node", "n", *via]) == 0
    # a second step, delta-coded against the first: base reads go through the faults too
    step20 = tmp_path / "step_000020"
    step20.mkdir()
    for f in src.iterdir():
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 1
        (step20 / f.name).write_bytes(bytes(data))
    assert ferry(["push", str(step20), s3_url, "--job", "j", "--node", "n", *via]) == 0
    for step, want in ((10, src), (20, step20)):
        dest = tmp_path / f"restored-{step}"
        assert ferry(["pull", s3_url, str(dest), "--job", "j", "--step", str(step), *via]) == 0
        assert tree_bytes(dest) == tree_bytes(want)
    assert ferry(["verify", s3_url, *via]) == 0
    capsys.readouterr()
    assert_faults_injected(s3_proxy, at_least=5)
    s3_proxy.set_faults(0.0)
    # uploads whose start reply was lost were aborted on the spot, not left billed
    assert pending_uploads(s3_url, s3_proxy.url) == []


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_kind_at_30pct_is_survived(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, kind: str
) -> None:
    """One kind at a time, often enough that every request type meets it. (12 attempts a
    request: with the default 6, one of a push's ~100 requests failed all six at 30%, 0.3^6
    each, about one run in 15: a CI run met it; 0.3^12 is 5e-7.)"""
    src = make_multipart_checkpoint(tmp_path / "step_000010", seed=11)
    via = ["--endpoint-url", s3_proxy.url, *SMALL, "--window", "4", "--attempts", "12"]
    s3_proxy.set_faults(0.3, (kind,))
    assert ferry(["push", str(src), s3_url, "--job", "j", "--node", "n", *via]) == 0
    dest = tmp_path / "restored"
    assert ferry(["pull", s3_url, str(dest), "--job", "j", *via]) == 0
    assert tree_bytes(dest) == tree_bytes(src)
    assert s3_proxy.stats.faults[kind] >= 3, s3_proxy.stats
    print(f"\nfaults: {kind} x{s3_proxy.stats.faults[kind]} of {s3_proxy.stats.requests} requests")


def test_a_lost_reply_to_taking_a_lease_does_not_make_the_run_wait_for_itself(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The create-only PUT of a lease lands, its reply is lost, the retry meets the lease:
    it is this run's own (a token says so), not another push's or retention run's. Before,
    a push waited for its own lease to lapse (120 s) and retention said it was busy."""
    src = make_multipart_checkpoint(tmp_path / "step_000010", seed=3)
    via = ["--endpoint-url", s3_proxy.url, *SMALL]
    s3_proxy.set_faults(1.0, ("lost_reply",), only="/locks/push/", budget=1)
    assert ferry(["push", str(src), s3_url, "--job", "j", "--node", "n", *via]) == 0
    assert s3_proxy.stats.faults["lost_reply"] == 1
    assert "another push" not in caplog.text  # it never waited for a push that is itself
    s3_proxy.set_faults(1.0, ("lost_reply",), only="/gc/lock.json", budget=1)
    assert ferry(["retention", s3_url, "--keep-last", "1", "--endpoint-url", s3_proxy.url]) == 0
    assert s3_proxy.stats.faults["lost_reply"] == 2


def test_agent_push_and_prefetch_with_10pct_faulty_requests(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.url)  # the agents' S3 endpoint
    s3_proxy.set_faults(FAULT_RATE, KINDS)

    async def go() -> None:
        async with agent(tmp_path / "hot-a", [s3_url], node="a") as url_a:
            src = make_multipart_checkpoint(tmp_path / "hot-a" / "llm" / "step_000030", seed=5)
            async with FerryClient(url_a, TOKEN) as a:
                rows: list[dict] = []  # type: ignore[type-arg]
                for _ in range(600):
                    rows = (await a._call("GET", "/v1/pushes"))["pushes"]
                    if rows and rows[0]["state"] in ("durable", "failed"):
                        break
                    await asyncio.sleep(0.1)
                assert [r["state"] for r in rows] == ["durable"], rows
        async with agent(tmp_path / "hot-b", [s3_url]) as url_b, FerryClient(url_b, TOKEN) as b:
            done = await b.wait_prefetch(await b.prefetch("llm"), within_s=120)
            assert done["state"] == "ready", done
            assert tree_bytes(Path(done["dest"])) == tree_bytes(src)

    asyncio.run(go())
    assert_faults_injected(s3_proxy, at_least=3)


def test_store_down_fails_within_its_deadline_and_works_once_back(
    s3_url: str,
    s3_proxy: FaultProxy,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.url)
    src = make_multipart_checkpoint(tmp_path / "step_000010")
    via = ["--endpoint-url", s3_proxy.url, *SMALL]
    s3_proxy.down()
    began = time.monotonic()
    assert ferry(["push", str(src), s3_url, "--job", "j", "--node", "n", *via]) == 1
    assert time.monotonic() - began < DOWN_DEADLINE_S
    err = capsys.readouterr().err
    assert "the store may be down" in err and "Could not connect" in err, err

    async def prefetch_while_down() -> dict:  # type: ignore[type-arg]
        async with agent(tmp_path / "hot", [s3_url]) as url, FerryClient(url, TOKEN) as client:
            pid = await client.prefetch("j", 10, deadline_s=DOWN_DEADLINE_S)
            return await client.wait_prefetch(pid, within_s=DOWN_DEADLINE_S + 10)

    began = time.monotonic()
    status = asyncio.run(prefetch_while_down())
    assert status["state"] == "failed" and "the store may be down" in status["error"], status
    assert time.monotonic() - began < DOWN_DEADLINE_S
    dest = tmp_path / "restored"
    assert ferry(["pull", s3_url, str(dest), "--job", "j", *via]) == 1
    assert "the store may be down" in capsys.readouterr().err
    assert not dest.exists() and not list((tmp_path / "hot").rglob("*staging*"))

    s3_proxy.up()
    assert ferry(["push", str(src), s3_url, "--job", "j", "--node", "n", *via]) == 0
    assert ferry(["pull", s3_url, str(dest), "--job", "j", *via]) == 0
    assert tree_bytes(dest) == tree_bytes(src)

    async def prefetch_when_back() -> dict:  # type: ignore[type-arg]
        async with agent(tmp_path / "hot", [s3_url]) as url, FerryClient(url, TOKEN) as client:
            return await client.wait_prefetch(await client.prefetch("j", 10), within_s=60)

    status = asyncio.run(prefetch_when_back())
    assert status["state"] == "ready", status
    assert tree_bytes(Path(status["dest"])) == tree_bytes(src)


def test_background_push_fails_while_the_store_is_down_and_resumes_when_back(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.url)
    hot = tmp_path / "hot"
    queue, stores = make_queue([s3_url], tmp_path, max_attempts=10)

    async def go() -> None:
        s3_proxy.down()
        async with queue_agent(queue, hot):
            ckpt = save(hot / "j" / "step_000005", {"a.bin": random_bytes(3_000_000, 9)})
            for _ in range(600):  # the first attempt fails and says why
                row = tier_states(queue, "j", 5).get(s3_url)
                if row and row["state"] == "failed":
                    break
                await asyncio.sleep(0.1)
            assert row and "the store may be down" in str(row["error"]), row
            s3_proxy.up()
            for _ in range(600):  # a later attempt goes through
                row = tier_states(queue, "j", 5)[s3_url]
                if row["state"] == "durable":
                    break
                await asyncio.sleep(0.1)
            assert row["state"] == "durable", row
        dest = tmp_path / "restored"
        from transfer.engine import PullPlan, pull

        await pull(stores[0], dest, PullPlan("j", 5))
        assert tree_bytes(dest) == tree_bytes(ckpt)
        for store in stores:
            await store.close()

    asyncio.run(go())


def test_a_server_that_hangs_is_cut_off_by_the_read_timeout_and_retried(
    s3_url: str, s3_env: S3Endpoint
) -> None:
    """A stall longer than the client's read timeout (a black-holed connection): each try
    ends at the timeout, the next try goes through once the server answers again."""
    from transfer.store.s3 import S3Store
    from transfer.store.s3config import S3Settings

    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    with FaultProxy(s3_env.url, stall_seconds=60) as proxy:
        settings = S3Settings(bucket, endpoint_url=proxy.url, read_timeout=1)
        store = S3Store(settings, prefix, retry=RetryPolicy(attempts=2))

        async def go() -> None:
            await store.put("k", b"data")
            proxy.set_faults(1.0, ("stall",))
            began = time.monotonic()
            with pytest.raises(StoreError, match="the store may be down"):
                await store.get("k")
            assert time.monotonic() - began < 20  # 2 tries of 1 s, not 2 x 60 s
            proxy.set_faults(0.0)
            assert await store.get("k") == b"data"
            await store.close()

        asyncio.run(go())


def test_a_stop_during_a_restore_from_a_store_that_stopped_answering_is_not_held_by_retries(
    s3_url: str, s3_env: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pack read stalls, then its connection drops (a black-holing store). The
    agent stops mid-restore: its reader threads finish the read they are in and try no
    other (store/retry.py ``no_retries_after``), so the stop takes about one stall, not
    one per try of the retry policy (6 here) for every reader."""
    stall = 3.0
    (k0,) = adamw_series(tmp_path / "train", 1)
    with FaultProxy(s3_env.url, stall_seconds=stall) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)

        async def go() -> float:
            await push_series(s3_url, [k0])
            env = {"FERRY_DRAIN_SECONDS": "0.2"}
            async with agent(tmp_path / "hot", [s3_url], extra_env=env) as url:
                async with FerryClient(url, TOKEN) as client:
                    proxy.set_faults(1.0, ("stall",), only=".pack")
                    pid = await client.prefetch("llm", 20)
                    await until(lambda: proxy.stats.faults["stall"] > 0, within=30)  # held
                    assert (await client.prefetch_status(pid))["state"] == "running"
                stopping = time.monotonic()
            return time.monotonic() - stopping

        took = asyncio.run(go())
    tries = RetryPolicy().attempts
    assert took < 3 * stall < tries * stall, took  # one stall each, not `tries` of them
    assert not list((tmp_path / "hot").glob("llm/step_*")), "a torn restore was left"
