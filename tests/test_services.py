"""One owner of the agent's background work (agent/rpc/services.py): nothing the agent started is
left pending once it has stopped, and a service that raises is logged, not lost."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest

from agent.node.prefetch import Prefetcher, PrefetchJob
from agent.node.standby import Standby
from agent.rpc.services import Services, wait_for_any
from tests.harness import agent, until


def test_a_prefetch_started_while_the_agent_drains_is_cancelled_and_awaited(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The standby's last poll, still running when the stop comes, starts a replication that
    never finishes: at the drain deadline it is cancelled, and no task is left pending."""
    started: list[PrefetchJob] = []

    async def slow_poll(self: Standby) -> None:
        if not started:
            await asyncio.sleep(0.3)  # the agent begins to stop meanwhile
            started.append(self.prefetcher.submit("llm", 1, None, background=True))

    async def never_done(self: Prefetcher, record: PrefetchJob) -> None:
        await asyncio.sleep(3600)

    async def no_probe(self: Prefetcher) -> None:
        pass  # (the standby starts once the write probe ends: here at once)

    monkeypatch.setattr(Standby, "poll", slow_poll)
    monkeypatch.setattr(Prefetcher, "_fetch", never_done)
    monkeypatch.setattr(Prefetcher, "measure_disk", no_probe)

    async def go() -> None:
        async with agent(tmp_path / "hot", [local_url], extra_env={"FERRY_DRAIN_SECONDS": "1"}):
            pass
        assert [job.state.value for job in started] == ["cancelled"]
        left = asyncio.all_tasks() - {asyncio.current_task()}
        assert not left, left

    asyncio.run(go())


def test_a_service_that_raises_is_logged_and_the_agent_serves_on(
    local_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken_poll(self: Standby) -> None:
        raise RuntimeError("standby poll bug")

    monkeypatch.setattr(Standby, "poll", broken_poll)

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "background task standby failed" in r.getMessage()]

    async def go() -> None:
        async with agent(tmp_path / "hot", [local_url]) as url, aiohttp.ClientSession() as s:
            await until(lambda: bool(failed()))
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200
        assert not asyncio.all_tasks() - {asyncio.current_task()}

    with caplog.at_level(logging.ERROR, logger="agent.rpc.services"):
        asyncio.run(go())
    [record] = failed()
    assert record.exc_info is not None and "standby poll bug" in str(record.exc_info[1])


def test_services_drain_then_cancel_and_refuse_late_work() -> None:
    async def go() -> None:
        finished: list[str] = []

        async def quick() -> None:
            await asyncio.sleep(0.05)
            finished.append("quick")

        async def stuck() -> None:
            await asyncio.sleep(3600)

        async with Services(drain_seconds=0.3) as services:
            done = services.spawn(quick(), name="quick")
            hung = services.spawn(stuck(), name="stuck")
            loop = services.spawn(wait_for_any(services.stop), name="loop")
        assert finished == ["quick"] and done.done() and loop.done() and not loop.cancelled()
        assert hung.cancelled()
        late = stuck()
        with pytest.raises(RuntimeError, match="not running"):
            services.spawn(late, name="late")
        assert not asyncio.all_tasks() - {asyncio.current_task()}

    asyncio.run(go())
