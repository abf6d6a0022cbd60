"""``GET /v1/prefetch/{id}?wait=``: the scheduler's long poll, on a real agent over a real
S3 server, with a proxy in front that holds the restore's first pack read (so the prefetch
is certainly still running when the poll starts)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.rpc.client import FerryClient, RpcError
from agent.rpc.routes.prefetch import WAIT_SECONDS
from tests.conftest import adamw_series
from tests.faultproxy import FaultProxy
from tests.harness import TOKEN, agent, push_series
from tests.s3server import S3Endpoint

HOLD_SECONDS = 2.0  # the proxy holds the first pack read this long, then drops it


def test_a_status_request_with_wait_answers_when_the_prefetch_ends(
    s3_url: str, s3_env: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (k0,) = adamw_series(tmp_path / "train", 1)
    with FaultProxy(s3_env.url, stall_seconds=HOLD_SECONDS) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)

        async def go() -> None:
            await push_series(s3_url, [k0])
            async with agent(tmp_path / "hot", [s3_url]) as url, FerryClient(url, TOKEN) as c:
                proxy.set_faults(1.0, ("stall",), only=".pack", budget=1)
                pid = await c.prefetch("llm", 20)
                # without a wait, or with one shorter than the prefetch: the record as it is
                assert (await c.prefetch_status(pid))["state"] in ("queued", "running")
                assert (await c.prefetch_status(pid, wait=0.05))["state"] in ("queued", "running")
                requests = proxy.stats.requests
                ended = await c.prefetch_status(pid, wait=WAIT_SECONDS)  # one request
                assert ended["state"] == "ready", ended
                assert proxy.stats.faults["stall"] == 1  # it did wait for the held read
                assert proxy.stats.requests > requests
                # an ended prefetch answers at once, whatever the wait
                assert (await c.prefetch_status(pid, wait=WAIT_SECONDS))["state"] == "ready"
                assert (await c.wait_prefetch(pid))["state"] == "ready"
                for bad in ("-1", "nan", "inf", "soon", str(WAIT_SECONDS + 1)):
                    with pytest.raises(RpcError, match="wait must be") as err:
                        await c._call("GET", f"/v1/prefetch/{pid}", params={"wait": bad})
                    assert err.value.status == 400

        asyncio.run(go())


def test_a_held_status_request_does_not_hold_up_the_agents_stop(
    s3_url: str, s3_env: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop answers a held poll at once, with the record as it is ("running"), rather
    than holding the stop until the prefetch ends ("ready" once the held read is over)."""
    (k0,) = adamw_series(tmp_path / "train", 1)
    with FaultProxy(s3_env.url, stall_seconds=HOLD_SECONDS) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)

        async def go() -> None:
            await push_series(s3_url, [k0])
            client = None
            async with agent(tmp_path / "hot", [s3_url]) as url:
                client = FerryClient(url, TOKEN, timeout=WAIT_SECONDS + 30)
                proxy.set_faults(1.0, ("stall",), only=".pack", budget=1)
                pid = await client.prefetch("llm", 20)
                held = asyncio.ensure_future(client.prefetch_status(pid, wait=WAIT_SECONDS))
                await asyncio.sleep(0.3)  # the poll is in, and held
                assert not held.done()
            answer = await held
            await client.close()
            assert proxy.stats.faults["stall"] == 1
            assert answer["state"] == "running", answer

        asyncio.run(go())
