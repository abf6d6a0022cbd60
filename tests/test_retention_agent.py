"""The agent's retention: the hot dir keeps its newest steps and evicts older ones only once
a colder tier holds them; tiers follow their policies after each push; pins hold; the
journal shrinks; /metrics reports it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.node.hotdir import EVICTING_MARK, HotDir
from agent.node.hotretention import plan_hot
from agent.node.journal import Journal
from agent.node.protected import StepHolds
from agent.rpc.client import FerryClient, RpcError
from tests.conftest import adamw_series, open_test_store
from tests.harness import TOKEN, agent
from transfer.engine import list_checkpoints

JOB = "llm"
RETAIN = {
    "FERRY_RETENTION_INTERVAL_SECONDS": "3600",  # runs come from pushes and the RPC here
    "FERRY_RETENTION_GRACE_SECONDS": "0",
}


@asynccontextmanager
async def retaining_agent(
    hot: Path, tiers: list[str], env: dict[str, str], config_text: str | None = None
) -> AsyncIterator[tuple[str, FerryClient]]:
    """Agent "a" with retention settings, and a client for it."""
    async with (
        agent(hot, tiers, "a", extra_env=env, config_text=config_text) as url,
        FerryClient(url, TOKEN) as client,
    ):
        yield url, client


async def _wait_pushed(client: FerryClient, step: int, tiers: int = 1) -> None:
    """Until ``step`` is durable in ``tiers`` tiers (or already evicted from the hot dir,
    which only happens after that: its journal rows are gone then)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = [r for r in (await client._call("GET", "/v1/pushes"))["pushes"]]
        mine = [r for r in rows if r["step"] == step]
        if sum(r["state"] == "durable" for r in mine) >= tiers:
            return
        if not mine and any(r["step"] > step for r in rows):
            return  # evicted
        await asyncio.sleep(0.2)
    raise AssertionError(f"step {step} not durable: {rows}")


def _hot_steps(hot: Path) -> list[str]:
    return sorted(p.name for p in (hot / JOB).iterdir())


async def _store_steps(url: str) -> list[int]:
    store = open_test_store(url)
    try:
        return sorted({c.step for c in await list_checkpoints(store, JOB)})
    finally:
        await store.close()


async def _metrics(url: str) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as s, s.get(f"{url}/metrics") as r:
        return await r.text()


def test_hot_dir_keeps_newest_and_evicts_only_what_a_tier_holds(
    local_url: str, tmp_path: Path
) -> None:
    hot = tmp_path / "hot"

    async def go() -> None:
        env = {**RETAIN, "FERRY_RETENTION_HOT_KEEP_LAST": "2"}
        async with retaining_agent(hot, [local_url], env) as (url, client):
            adamw_series(hot / JOB, 4, seed=3)  # steps 20, 40, 60, 80
            await _wait_pushed(client, 80)
            # pushes poke retention; run once more to be independent of timing
            report = await client.run_retention()
            assert report["errors"] == []
            assert _hot_steps(hot) == ["step_000060", "step_000080"]
            assert await _store_steps(local_url) == [20, 40, 60, 80]  # tier keeps all
            rows = (await client._call("GET", "/v1/pushes"))["pushes"]
            assert sorted(r["step"] for r in rows) == [60, 80]  # journal pruned
            text = await _metrics(url)
            assert "ferry_hot_evicted_total 2" in text
            assert 'ferry_tier_bytes{tier="hot"}' in text
            assert "ferry_retention_runs_total{" in text

    asyncio.run(go())


def test_steps_not_yet_in_a_colder_tier_are_never_evicted(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    tier = tmp_path / "nfs"  # never created: every push fails

    async def go() -> None:
        env = {**RETAIN, "FERRY_RETENTION_HOT_KEEP_LAST": "2", "FERRY_RETENTION_HOT_BUDGET": "1"}
        async with retaining_agent(hot, [str(tier)], env) as (_url, client):
            adamw_series(hot / JOB, 4, seed=4)
            await asyncio.sleep(1.5)  # the watcher sees them; the pushes fail
            report = await client.run_retention()
            assert _hot_steps(hot) == ["step_000020", "step_000040", "step_000060", "step_000080"]
            reasons = {s["step"]: s["reason"] for s in report["hot"]["steps"]}
            # queued for a retry (in use), or failed for good: either way not in a tier
            assert reasons[20] in ("in use or pinned", "push pending", "not in any colder tier yet")
            assert report["hot"]["over_budget"] is True

    asyncio.run(go())


def test_hot_budget_evicts_down_to_the_newest_two(local_url: str, tmp_path: Path) -> None:
    """A size-limited hot dir: keep_last would keep 5, the byte budget allows about 2.5
    steps, so the oldest durable steps go first, and never the newest two."""
    hot = tmp_path / "hot"

    async def go() -> None:
        one_step = 9 * (1 << 20) + 3  # adamw_series writes three 3 MiB tensors per step
        env = {
            **RETAIN,
            "FERRY_RETENTION_HOT_KEEP_LAST": "5",
            "FERRY_RETENTION_HOT_BUDGET": str(int(one_step * 2.5)),
        }
        async with retaining_agent(hot, [local_url], env) as (_url, client):
            adamw_series(hot / JOB, 4, seed=5)
            await _wait_pushed(client, 80)
            report = await client.run_retention()
            assert _hot_steps(hot) == ["step_000060", "step_000080"], report["hot"]
            assert report["hot"]["bytes_after"] <= int(one_step * 2.5)
            assert not report["hot"]["over_budget"]

    asyncio.run(go())


def test_tier_policy_runs_after_each_push_and_respects_pins(
    local_url: str, s3_url: str, tmp_path: Path
) -> None:
    """Hot tier NFS-like (local store) keeps 1; S3 keeps 2. After each push the agent trims
    both, on its own; a step pinned over the RPC stays in every tier until unpinned."""
    hot = tmp_path / "hot"
    config = "[[retention.tiers]]\nkeep_last = 1\n[[retention.tiers]]\nkeep_last = 2\n"

    async def go() -> None:
        env = {**RETAIN, "FERRY_RETENTION_HOT_KEEP_LAST": "4"}
        async with retaining_agent(hot, [local_url, s3_url], env, config_text=config) as (
            url,
            client,
        ):
            adamw_series(hot / JOB, 1, seed=6)
            await _wait_pushed(client, 20, tiers=2)
            await client.pin(JOB, 20, ttl_s=600)
            for k, d in enumerate(adamw_series(tmp_path / "later", 4, seed=6)[1:], start=2):
                shutil.copytree(d, hot / JOB / d.name)
                await _wait_pushed(client, 20 * k, tiers=2)
            deadline = time.monotonic() + 30  # the post-push run is asynchronous
            while time.monotonic() < deadline:
                if await _store_steps(local_url) == [20, 80] and await _store_steps(s3_url) == [
                    20,
                    60,
                    80,
                ]:
                    break
                await asyncio.sleep(0.3)
            assert await _store_steps(local_url) == [20, 80]  # 20 pinned, 80 newest
            assert await _store_steps(s3_url) == [20, 60, 80]
            await client.unpin(JOB, 20)
            report = await client.run_retention()
            assert report["errors"] == []
            assert await _store_steps(local_url) == [80]
            assert await _store_steps(s3_url) == [60, 80]
            text = await _metrics(url)
            assert "ferry_gc_marked_packs{" in text and "ferry_retention_expired_total{" in text
            dry = await client.retention(dry_run=True)
            assert dry["dry_run"] is True and dry["tiers"][0]["actions"]

    asyncio.run(go())


async def _pushed_by_a(url: str, dirs: list[Path], journal_path: Path) -> tuple[Any, Journal]:
    """``dirs`` pushed to ``url`` by node "a", each durable in its journal."""
    from transfer.engine import push

    store = open_test_store(url)
    journal = Journal(journal_path, "a")
    for d in dirs:
        step = int(d.name.split("_")[1])
        journal.record_staged(JOB, step, d, [url])
        result = await push(store, d, job=JOB, step=step, node="a")
        journal.record_durable(JOB, step, url, result.to_dict())
    return store, journal


def test_steps_in_use_and_their_bases_are_protected(local_url: str, tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    dirs = adamw_series(hot / JOB, 5, seed=7)

    async def go() -> None:
        store, journal = await _pushed_by_a(local_url, dirs, tmp_path / "j.sqlite3")
        holds = StepHolds()
        with holds.hold((JOB, 60)):  # e.g. a prefetch reading step 60: 40 is its base
            plan = await plan_hot(
                HotDir(hot, ".metadata"),
                node="a",
                keep_last=2,
                budget_bytes=None,
                tiers=[(local_url, store)],
                journal=journal,
                protected=holds.held(),
            )
        actions = {s.step: s.action for s in plan.steps}
        assert actions == {20: "evict", 40: "keep", 60: "keep", 80: "keep", 100: "keep"}
        assert holds.held() == set()

    asyncio.run(go())


def test_a_step_two_directories_name_is_never_evicted(local_url: str, tmp_path: Path) -> None:
    """``checkpoint-20`` beside the pushed ``step_000020`` names step 20 too: it was never
    pushed, and one decision for the step evicted both (a newcomer's trial lost it). Both
    are kept, named in the reason, while the older step 40 goes as before."""
    hot = tmp_path / "hot"
    dirs = adamw_series(hot / JOB, 5, seed=7)  # 20..100
    twin = hot / JOB / "checkpoint-20"
    shutil.copytree(dirs[1], twin)  # step 40's bytes, named as step 20

    async def go() -> None:
        store, journal = await _pushed_by_a(local_url, dirs, tmp_path / "j.sqlite3")
        plan = await plan_hot(HotDir(hot, ".metadata"), node="a", keep_last=2,
                              budget_bytes=None, tiers=[(local_url, store)],
                              journal=journal, protected=set())  # fmt: skip
        actions = {(s.step, Path(s.path).name): s.action for s in plan.steps}
        assert actions[(20, "checkpoint-20")] == actions[(20, "step_000020")] == "keep"
        assert actions[(40, "step_000040")] == "evict"
        (reason,) = {s.reason for s in plan.steps if s.step == 20}
        assert "2 directories name step 20 (checkpoint-20, step_000020)" in reason

    asyncio.run(go())


def test_a_crash_mid_eviction_is_swept(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    (d,) = adamw_series(hot / JOB, 1)
    half = d.with_name(f".{d.name}{EVICTING_MARK}dead")
    d.rename(half)
    assert HotDir(hot, ".metadata").sweep_evictions() == [half] and not half.exists()


def test_hot_dir_on_a_small_tmpfs_keeps_min_free(local_url: str, tmp_path: Path) -> None:
    """The hot dir on a real 48 MiB tmpfs: four ~9 MiB saves leave less than the 20 MiB
    min_free, so the oldest durable steps are evicted until the filesystem has it."""
    hot = tmp_path / "hot"
    hot.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(hot)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:

        async def go() -> None:
            env = {
                **RETAIN,
                "FERRY_RETENTION_HOT_KEEP_LAST": "10",
                "FERRY_RETENTION_HOT_MIN_FREE": str(20 << 20),
            }
            async with retaining_agent(hot, [local_url], env) as (_url, client):
                adamw_series(hot / JOB, 4, seed=8)
                await _wait_pushed(client, 80)
                report = await client.run_retention()
                st = os.statvfs(hot)
                assert st.f_bavail * st.f_frsize >= 20 << 20, report["hot"]
                assert _hot_steps(hot) == ["step_000040", "step_000060", "step_000080"]
                assert not report["hot"]["over_budget"]

        asyncio.run(go())
    finally:
        subprocess.run(["umount", "-l", str(hot)], check=False)


def test_partial_copies_are_kept_while_newest_and_evicted_once_superseded(tmp_path: Path) -> None:
    """A share a prefetch made (.ferry-share.json) is never the only copy: the newest of a
    job is kept (a survivor restarts from it), an older one goes once a newer step of its
    job is here (whole or a share), unless a prefetch holds it."""
    from transfer.format.share import SHARE_MARKER

    hot = tmp_path / "hot"
    for step in (10, 20, 30):
        d = hot / JOB / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m")
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
        (d / SHARE_MARKER).write_text("{}")

    async def plan(protected: set[tuple[str, int]]) -> dict[int, str]:
        journal = Journal(tmp_path / "j.sqlite3", "a")
        done = await plan_hot(HotDir(hot, ".metadata"), node="a", keep_last=2, budget_bytes=None,
                              tiers=[], journal=journal, protected=protected)  # fmt: skip
        return {s.step: s.action for s in done.steps}

    assert asyncio.run(plan(set())) == {10: "evict", 20: "evict", 30: "keep"}
    assert asyncio.run(plan({(JOB, 10)})) == {10: "keep", 20: "evict", 30: "keep"}


def test_a_run_asked_as_a_dry_run_changes_nothing(local_url: str, tmp_path: Path) -> None:
    """POST /v1/retention/run with {"dry_run": true} plans and reports (it ran for real:
    the body was ignored); a body that is not one is refused."""
    hot = tmp_path / "hot"
    hot.mkdir()

    async def go() -> None:
        async with retaining_agent(hot, [local_url], RETAIN) as (_, client):
            dry = await client._call("POST", "/v1/retention/run", json={"dry_run": True})
            real = await client._call("POST", "/v1/retention/run", json={})
            assert (dry["dry_run"], real["dry_run"]) == (True, False)
            with pytest.raises(RpcError, match="dry_run"):
                await client._call("POST", "/v1/retention/run", json={"dry_run": "yes"})

    asyncio.run(go())


def test_a_run_asked_of_an_agent_without_retention_is_a_conflict(
    local_url: str, tmp_path: Path
) -> None:
    """An agent with no ``[retention]`` table asked to run it: a 409 that says so (it was a
    404 typed CheckpointNotFoundError); its report says it is not enabled."""
    hot = tmp_path / "hot"
    hot.mkdir()

    async def go() -> None:
        async with agent(hot, [local_url]) as url, FerryClient(url, TOKEN) as client:
            assert await client._call("GET", "/v1/retention") == {"enabled": False}
            with pytest.raises(RpcError) as refused:
                await client._call("POST", "/v1/retention/run", json={})
            assert refused.value.status == 409, refused.value
            assert "retention is not configured on this agent" in str(refused.value)

    asyncio.run(go())


def test_every_tier_label_is_a_configured_tier(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 (f): the `tier` label was the tier as configured (`ckpt/store`) on the push
    series and the store's resolved URL (an absolute path) on retention's. One rule now: the
    URL as configured (`hot` for the hot dir), on every series of a real agent's /metrics."""
    monkeypatch.chdir(tmp_path)
    tier = os.path.relpath(local_url, tmp_path)  # "store", as a config names it
    hot = tmp_path / "hot"

    async def go() -> None:
        config = "[[retention.tiers]]\nkeep_last = 1\n"
        async with retaining_agent(hot, [tier], RETAIN, config) as (url, client):
            adamw_series(hot / JOB, 2, seed=4)
            await _wait_pushed(client, 40)
            report = await client.run_retention()
            assert report["errors"] == [] and await _store_steps(local_url) == [40]
            text = await _metrics(url)
        labels = set(re.findall(r'[{,]tier="([^"]*)"', text))
        assert labels == {"hot", tier}, labels
        for series in ("ferry_push_total", "ferry_tier_bytes", "ferry_retention_expired_total"):
            assert re.search(rf'^{series}{{[^}}]*tier="{tier}"', text, re.M), series

    asyncio.run(go())
