"""The agent's RPC on a real aiohttp server on loopback, against real stores: auth, errors,
prefetch (cold, and onto a node holding the previous checkpoint), estimates, pins, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agent.cli.run import main as ferry
from agent.rpc.client import FerryClient, RpcError
from tests.conftest import adamw_series, tree_bytes
from tests.harness import (
    TOKEN,
    DyingProxy,
    agent,
    peer_agent,
    prefetch_through,
    push_series,
    reserve_port,
)
from transfer.store import open_store


@contextlib.asynccontextmanager
async def raw_agent(hot: Path, tier: str) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """A real agent and a plain HTTP session with its token: requests no client would send."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with agent(hot, [tier]) as url, aiohttp.ClientSession(headers=headers) as session:
        yield url, session


def test_auth_is_required_everywhere_but_health(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        async with agent(tmp_path / "hot", [local_url]) as url, aiohttp.ClientSession() as s:
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200 and (await r.json())["node"] == "b"
            for path in ("/v1/checkpoints", "/metrics", "/v1/estimate?job=x"):
                async with s.get(url + path) as r:
                    assert r.status == 401, path
                    assert (await r.json())["type"] == "Unauthorized"
                async with s.get(url + path, headers={"Authorization": "Bearer nope"}) as r:
                    assert r.status == 401, path
            async with s.post(f"{url}/v1/prefetch", json={"job": "x"}) as r:
                assert r.status == 401

    asyncio.run(go())


def test_bad_requests_get_json_4xx(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        async with raw_agent(tmp_path / "hot", local_url) as (url, s):
            cases = [
                ("POST", "/v1/prefetch", {"data": b"not json"}, 400),
                ("POST", "/v1/prefetch", {"json": {"job": "../../etc"}}, 400),
                ("POST", "/v1/prefetch", {"json": {"job": "ok", "step": -3}}, 400),
                ("POST", "/v1/prefetch", {"json": {"job": "ok", "deadline_s": "soon"}}, 400),
                ("POST", "/v1/prefetch", {"data": b"{" + b" " * (2 << 20) + b"}"}, 413),
                ("GET", "/v1/prefetch/doesnotexist", {}, 404),
                ("GET", "/v1/estimate?job=nojob", {}, 404),
                ("GET", "/v1/estimate?job=j&gpus=many", {}, 400),
                ("POST", "/v1/pins", {"json": {"job": "j", "step": 1, "ttl_s": 10**9}}, 400),
                ("POST", "/v1/pins", {"json": {"job": "j", "step": 1, "ttl_s": True}}, 400),
                ("POST", "/v1/prefetch", {"data": b'{"job": "ok", "deadline_s": NaN}'}, 400),
                ("POST", "/v1/prefetch", {"json": {"job": "ok", "deadline_s": True}}, 400),
                ("GET", "/v1/estimate?job=j&gpus=1" + "0" * 400, {}, 400),
                ("GET", "/v1/estimate?job=j&gpu_hour_price=inf", {}, 400),
            ]
            for method, path, kwargs, status in cases:
                async with s.request(method, url + path, **kwargs) as r:
                    assert r.status == status, (path, kwargs, await r.text())
                    assert "error" in await r.json(content_type=None)
            # a newcomer's trial: "invalid literal for int() with base 10: 'abc'"
            async with s.get(url + "/v1/estimate?job=j&gpus=abc") as r:
                assert "gpus must be an integer" in (await r.json())["error"]
        assert not (tmp_path / "etc").exists()

    asyncio.run(go())


def test_a_typo_in_a_body_field_is_a_400_naming_it_not_a_default(
    local_url: str, tmp_path: Path
) -> None:
    """A newcomer's trial: {"job": "j1", "stpe": 20} prefetched the latest step (202), and
    a pin's {"ttl": 60} took the default hour (201). Nothing starts or is pinned now."""

    async def go() -> None:
        async with raw_agent(tmp_path / "hot", local_url) as (url, s):
            cases = [
                ("/v1/prefetch", {"job": "j1", "stpe": 20}, "'stpe'"),
                ("/v1/pins", {"job": "j1", "step": 40, "ttl": 60}, "'ttl'"),
                ("/v1/standby/j1", {"layuot": None}, "'layuot'"),
                ("/v1/retention/run", {"dryrun": True}, "'dryrun'"),
            ]
            for path, body, named in cases:
                method = s.put if "standby" in path else s.post
                async with method(url + path, json=body) as r:
                    doc = await r.json()
                    assert r.status == 400, (path, doc)
                    assert doc["error"].startswith(f"unknown body field {named}"), doc
            async with s.post(f"{url}/v1/prefetch", json={"step": 20}) as r:
                assert (r.status, (await r.json())["error"]) == (400, "missing body field 'job'")
            async with s.get(f"{url}/v1/estimate", params={"step": "1"}) as r:  # ("None")
                want = (400, "missing query parameter 'job'")
                assert (r.status, (await r.json())["error"]) == want
            async with s.get(f"{url}/metrics") as r:
                assert "ferry_prefetch_started_total" not in await r.text()  # (none started)

    asyncio.run(go())


def test_prefetch_cold_and_onto_a_node_holding_the_previous_step(
    store_url: str, tmp_path: Path
) -> None:
    k0, k1 = adamw_series(tmp_path / "node-a", 2, frozen=0.5)

    async def go() -> None:
        await push_series(store_url, [k0])
        hot_b = tmp_path / "node-b"
        async with agent(hot_b, [store_url]) as url, FerryClient(url, TOKEN) as client:
            before = await client.estimate("llm", gpus=8, gpu_hour_price=2.5)
            assert before["bytes_missing"] > 0 and before["step"] == 20
            assert before["cost"] == pytest.approx(before["seconds"] / 3600 * 8 * 2.5)
            assert before["cooldown_seconds"] == pytest.approx(before["seconds"] + 300)

            first = await client.wait_prefetch(await client.prefetch("llm"), within_s=120)
            assert first["state"] == "ready", first
            assert first["satisfied_by"] == "restored"
            assert tree_bytes(Path(first["dest"])) == tree_bytes(k0)

            await push_series(store_url, [k1])
            est = await client.estimate("llm", "latest")
            assert 0 < est["bytes_missing"] < before["bytes_missing"]  # it holds step 20
            second = await client.wait_prefetch(await client.prefetch("llm", 40), within_s=120)
            assert second["state"] == "ready", second
            assert Path(second["dest"]).name == "step_000040"
            assert tree_bytes(Path(second["dest"])) == tree_bytes(k1)
            assert second["chunks_local"] > 0
            moved = sum(second["bytes_by_source"].values())
            assert moved <= est["bytes_missing"] * 1.01 + 4096  # only what it did not hold

            again = await client.wait_prefetch(await client.prefetch("llm", 40))
            assert again["state"] == "ready" and not again["bytes_by_source"]  # already here
            assert again["satisfied_by"] == "held"  # and it says so
            listing = (await client.checkpoints())["jobs"]["llm"]
            assert [(e["step"], e["local"]) for e in listing] == [(20, True), (40, True)]
            assert listing[1]["bytes"] == sum(len(b) for b in tree_bytes(k1).values())
            assert listing[1]["pushes"] == {}  # restored here, so never pushed from here

            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession(headers=auth) as s, s.get(f"{url}/metrics") as r:
                text = await r.text()
            assert "ferry_prefetch_started_total 3" in text
            assert 'ferry_bandwidth_bytes_per_second{source="tier:' in text
            assert 'ferry_prefetch_total{state="ready"} 3' in text
            assert "# TYPE ferry_prefetch_bytes_total counter" in text

    asyncio.run(go())


def test_prefetch_of_a_missing_checkpoint_fails_visibly(local_url: str, tmp_path: Path) -> None:
    """A step or job the tier lacks: the status names what it holds instead (it said only
    "no committed checkpoint for job 'toy' step 999", a newcomer's trial) and the kind of
    failure, as an error reply's ``type`` does."""
    (k20,) = adamw_series(tmp_path / "src", 1, seed=3)

    async def go() -> None:
        async with agent(tmp_path / "hot", [local_url]) as url, FerryClient(url, TOKEN) as client:
            status = await client.wait_prefetch(await client.prefetch("ghost", 5), within_s=30)
            assert status["state"] == "failed" and "holds no checkpoints" in status["error"]
            await push_series(local_url, [k20])
            for job, step, there in (
                ("llm", 999, "steps there: 20"),
                ("lmm", 20, "jobs there: llm"),
            ):
                status = await client.wait_prefetch(await client.prefetch(job, step), within_s=30)
                assert status["state"] == "failed", status
                assert status["error_type"] == "CheckpointNotFoundError", status
                assert status["error"].endswith(f" in {local_url} ({there})"), status["error"]

    asyncio.run(go())


def test_pins_expire_and_show_in_the_listing(local_url: str, tmp_path: Path) -> None:
    (k0,) = adamw_series(tmp_path / "a", 1)

    async def go() -> None:
        await push_series(local_url, [k0])
        async with agent(tmp_path / "hot", [local_url]) as url, FerryClient(url, TOKEN) as client:
            await client.pin("llm", 20, ttl_s=60)
            assert (await client.checkpoints())["jobs"]["llm"][0]["pinned"] is True
            await client.unpin("llm", 20)
            assert (await client.checkpoints())["jobs"]["llm"][0]["pinned"] is False
            await client.pin("llm", 20, ttl_s=0.2)
            await asyncio.sleep(0.3)
            assert (await client.checkpoints())["jobs"]["llm"][0]["pinned"] is False
            with pytest.raises(RpcError) as exc:
                await client.pin("llm", 20, ttl_s=-1)
            assert exc.value.status == 400

    asyncio.run(go())


def test_pinning_a_step_that_does_not_exist_is_refused_by_the_rpc_as_by_the_cli(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29 (d): `ferry pin` refused a step nobody pushed while POST /v1/pins accepted
    it (and the listing then showed nothing pinned). Both refuse now: the RPC with a 404
    and the reason, pinning nothing."""
    (k0,) = adamw_series(tmp_path / "a", 1)

    async def go() -> None:
        await push_series(local_url, [k0])
        async with agent(tmp_path / "hot", [local_url]) as url, FerryClient(url, TOKEN) as client:
            with pytest.raises(RpcError) as missing:
                await client.pin("llm", 21, ttl_s=60)
            assert missing.value.status == 404
            assert "no committed checkpoint llm step 21" in str(missing.value)
            assert local_url in str(missing.value)  # the tiers it looked in
            assert (await client.pin("llm", 20, ttl_s=60))["step"] == 20  # one that exists
        assert not (Path(local_url) / "pins" / "llm" / f"{21:018d}").exists()

    asyncio.run(go())
    assert ferry(["pin", local_url, "--job", "llm", "--step", "21"]) == 1
    assert "no committed checkpoint llm step 21" in capsys.readouterr().err


def test_unpin_says_whether_a_pin_was_removed(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29 (e): `ferry unpin` of a step never pinned printed "unpinned". Both doors say
    whether a pin was removed; unpinning what is not pinned still succeeds (exit 0)."""
    (k0,) = adamw_series(tmp_path / "a", 1)
    asyncio.run(push_series(local_url, [k0]))
    where = [local_url, "--job", "llm", "--step", "20"]
    assert ferry(["unpin", *where]) == 0
    out = capsys.readouterr().out
    assert "was not pinned" in out and "unpinned" not in out
    assert ferry(["pin", *where]) == 0
    capsys.readouterr()
    assert ferry(["unpin", *where, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] is True
    assert ferry(["unpin", *where, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] is False

    async def go() -> None:
        async with agent(tmp_path / "hot", [local_url]) as url, FerryClient(url, TOKEN) as client:
            assert (await client.unpin("llm", 20))["removed"] is False
            await client.pin("llm", 20, ttl_s=60)
            assert (await client.unpin("llm", 20)) == {
                "job": "llm",
                "step": 20,
                "pinned": False,
                "removed": True,
            }
            assert (await client.unpin("llm", 20))["removed"] is False

    asyncio.run(go())


def test_unpin_without_its_parameters_names_the_missing_one(local_url: str, tmp_path: Path) -> None:
    """Issue 29 (h): DELETE /v1/pins without parameters answered "invalid job name None"."""

    async def go() -> None:
        async with raw_agent(tmp_path / "hot", local_url) as (url, s):
            for query, missing in (("", "'job'"), ("?step=3", "'job'"), ("?job=llm", "'step'")):
                async with s.delete(f"{url}/v1/pins{query}") as r:
                    doc = await r.json()
                    assert r.status == 400, doc
                    assert doc["error"] == f"missing query parameter {missing}", doc
                    assert "None" not in doc["error"]
            async with s.post(f"{url}/v1/pins", json={}) as r:
                assert r.status == 400
                assert (await r.json())["error"] == "missing body field 'job'"

    asyncio.run(go())


def test_ferry_agent_process_serves_and_stops_on_sigterm(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (k0,) = adamw_series(tmp_path / "a", 1)
    asyncio.run(push_series(local_url, [k0]))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = reserve_port()
    env = dict(
        os.environ,
        FERRY_NODE="proc",
        FERRY_HOT_DIR=str(tmp_path / "hot"),
        FERRY_TIERS=local_url,
        FERRY_LISTEN=f"127.0.0.1:{port}",
        FERRY_TOKEN_FILE=str(token_file),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "agent"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.1)

        async def ask() -> dict:  # type: ignore[type-arg]
            async with FerryClient(f"http://127.0.0.1:{port}", TOKEN) as client:
                return await client.checkpoints()

        assert [e["step"] for e in asyncio.run(ask())["jobs"]["llm"]] == [20]
        url = f"http://127.0.0.1:{port}"
        argv = ["estimate", url, "--token-file", str(token_file), "--job", "llm", "--gpus", "4"]
        capsys.readouterr()
        assert ferry([*argv, "--gpu-hour-price", "3", "--json"]) == 0
        est = json.loads(capsys.readouterr().out)
        assert est["bytes_missing"] > 0 and est["cost"] == pytest.approx(est["seconds"] / 300)
        # the line: a cost under a cent is no "0.00" (a newcomer's trial), with its unit
        assert ferry([*argv, "--gpu-hour-price", "3"]) == 0
        said = re.search(r"cost ([\d.,]+) at 3 per GPU-hour", capsys.readouterr().out)
        assert said is not None and float(said.group(1).replace(",", "")) > 0
        assert ferry(["estimate", url, "--token-file", str(tmp_path / "a" / "x"), "--job", "llm"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stdout is not None
        said = proc.stdout.read()  # (the drain said, then its end, the last line)
        assert "draining" in said and said.endswith("ferry agent proc: stopped\n"), said[-500:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_printed_example_config_runs_as_printed(tmp_path: Path) -> None:
    """The README's agent quick start, in a fresh directory: print the example, make its
    hot dir and its store (`ferry init ckpt/store`), start the agent; it creates its token,
    pushes a committed step from ckpt/hot to ckpt/store, and logs where each config value
    came from."""
    ferry_cmd = [sys.executable, "-m", "agent"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    printed = subprocess.run(
        [*ferry_cmd, "agent", "--print-example-config"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    (tmp_path / "ferry.toml").write_text(printed.stdout)
    (tmp_path / "ckpt" / "hot").mkdir(parents=True)
    init = [*ferry_cmd, "init", "ckpt/store"]
    subprocess.run(init, capture_output=True, check=True, cwd=tmp_path, env=env)
    port = reserve_port()  # the one value changed: 7070 may be taken on a shared machine
    proc = subprocess.Popen(
        [*ferry_cmd, "agent", "--config", "ferry.toml"],
        cwd=tmp_path, env={**env, "FERRY_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        token = tmp_path / "ferry.token"
        step = tmp_path / "ckpt" / "hot" / "quick" / "step_000001"
        step.mkdir(parents=True)
        (step / "__0_0.distcp").write_bytes(b"x" * 5000)
        (step / ".metadata").write_bytes(b"meta")  # last, as DCP does
        deadline = time.monotonic() + 60
        pushed = False
        while not pushed and time.monotonic() < deadline:
            time.sleep(0.5)
            listed = subprocess.run(
                [*ferry_cmd, "ls", str(tmp_path / "ckpt" / "store"), "--json"],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            pushed = listed.returncode == 0 and '"quick"' in listed.stdout
        assert pushed, "the quick start never pushed its step"
        assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "created token_file ferry.token" in err
    assert f'config key=listen value=127.0.0.1:{port} source="env FERRY_LISTEN' in err
    assert "config key=hot_dir value=ckpt/hot source=file" in err
    assert "config key=token_file value=ferry.token source=file" in err
    assert re.search(r"config key=endpoint_url value=\S+ source=", err), err  # unset: (none)
    assert "push job=quick step=1 tier=ckpt/store outcome=durable" in err


def test_plan_finds_the_interval_with_the_least_badput(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--save-seconds", "30", "--step-seconds", "2", "--mtbi-hours", "6"]
    assert ferry([*argv, "--interval-steps", "100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # the complete model's optimum, 1118.5 s = 559 steps (Young's sqrt(2 x 30 s x 6 h), 569)
    assert doc["optimal_interval_steps"] == 559
    assert doc["optimal_badput"] < doc["current_badput"]
    # a newcomer's trial: "mtbi_seconds must be a positive finite number, got -21600.0"
    for flag, value in (("--mtbi-hours", "-6"), ("--step-seconds", "0"), ("--save-seconds", "nan")):
        with pytest.raises(SystemExit) as misused:
            ferry([*argv, flag, value])
        assert misused.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err


def test_prefetch_prefers_peers_and_survives_a_peer_dying(local_url: str, tmp_path: Path) -> None:
    hot_a = tmp_path / "node-a"
    (k0,) = adamw_series(hot_a / "llm", 1, seed=7)  # node A wrote it: <hot>/llm/step_000020

    async def go() -> None:
        await push_series(local_url, [k0])
        async with peer_agent(hot_a, [local_url], [], "a") as url_a:
            # B: every chunk comes from peer A, nothing from the tier
            node_b = peer_agent(tmp_path / "b", [local_url], [url_a], "b")
            async with node_b as url_b, FerryClient(url_b, TOKEN) as client:
                done = await client.wait_prefetch(await client.prefetch("llm"), within_s=60)
            assert done["state"] == "ready", done
            assert tree_bytes(Path(done["dest"])) == tree_bytes(k0)
            assert done["bytes_by_source"]["peer"] > 0
            assert done["bytes_by_source"][f"tier:{local_url}"] == 0
            assert done["bytes_by_peer"] == {url_a: done["bytes_by_source"]["peer"]}  # which

            # C: peer A dies after 3 chunks; C completes from the tier
            proxy = DyingProxy(url_a, budget=3)
            done = await prefetch_through(proxy, tmp_path / "c", [local_url], "c")
            assert done["state"] == "ready", done
            assert tree_bytes(Path(done["dest"])) == tree_bytes(k0)
            assert proxy.served == 3
            assert 0 < done["bytes_by_source"]["peer"] <= 3 << 20  # the 3 chunks it served
            assert done["bytes_by_source"][f"tier:{local_url}"] > 0

    asyncio.run(go())


def test_the_estimate_counts_the_bases_a_node_without_them_fetches(
    local_url: str, tmp_path: Path
) -> None:
    """Issue 12: an empty node asked for a delta-coded step also fetches the chunks its
    deltas decode from; the estimate counts them (it used to say about half), and names
    where the bytes come from: the tier, or this node when it holds the step."""
    k20, k40 = adamw_series(tmp_path / "src", 2, seed=14)

    async def go() -> None:
        await push_series(local_url, [k20, k40])
        async with agent(tmp_path / "c", [local_url], "c") as url, FerryClient(url, TOKEN) as c:
            est = await c.estimate("llm", 40)
            assert est["source"] == f"tier:{local_url}" and est["bytes_bases"] > 0
            done = await c.wait_prefetch(await c.prefetch("llm", 40), within_s=60)
            moved = sum(done["bytes_by_source"].values())
            assert abs(est["bytes_missing"] - moved) <= 0.05 * moved, (est, moved)
            # restored by that prefetch: checked by stat (estimate_sources._held_here)
            held = await c.estimate("llm", 40)
            assert (held["source"], held["bytes_bases"]) == ("verified", 0)
            # a copy this agent did not restore (training's own save): re-hashed
            own = tmp_path / "c" / "llm" / k20.name
            await asyncio.to_thread(shutil.copytree, k20, own)
            held = await c.estimate("llm", 20)
            assert (held["source"], held["bytes_bases"]) == ("local", 0)

    asyncio.run(go())


def test_a_peer_sends_deltas_against_what_the_node_holds(local_url: str, tmp_path: Path) -> None:
    """Issue 12: node B holds step 20 and asks peer A (holding 20 and 40) for step 40. Every
    chunk changed (all weights and Adam moments move), so raw chunks from the peer would
    move ~2.3x what the tier's deltas do; the peer now sends deltas against B's chunks, and
    B moves no more than 1.1x what node C, holding 20 with no peer, reads from the tier."""
    hot_a = tmp_path / "node-a"
    k20, k40 = adamw_series(hot_a / "llm", 2, seed=12)

    async def prefetch(client: FerryClient, step: int) -> dict:  # type: ignore[type-arg]
        done = await client.wait_prefetch(await client.prefetch("llm", step), within_s=60)
        assert done["state"] == "ready", done
        return done

    async def go() -> None:
        await push_series(local_url, [k20, k40])
        async with peer_agent(hot_a, [local_url], [], "a") as url_a:
            node_c = peer_agent(tmp_path / "c", [local_url], [], "c")
            async with node_c as url_c, FerryClient(url_c, TOKEN) as c:
                await prefetch(c, 20)
                alone = await prefetch(c, 40)
            from_tier = alone["bytes_by_source"][f"tier:{local_url}"]
            node_b = peer_agent(tmp_path / "b", [local_url], [url_a], "b")
            async with node_b as url_b, FerryClient(url_b, TOKEN) as b:
                await prefetch(b, 20)
                done = await prefetch(b, 40)
            assert tree_bytes(Path(done["dest"])) == tree_bytes(k40)
            moved = sum(done["bytes_by_source"].values())
            assert done["bytes_by_source"]["peer"] > 0.9 * moved  # the peer served it
            raw = sum(len(v) for v in tree_bytes(k40).values())
            assert moved <= 1.1 * from_tier < 0.8 * raw, (moved, from_tier, raw)

    asyncio.run(go())


def test_chunk_route_serves_only_verified_local_chunks(local_url: str, tmp_path: Path) -> None:
    hot_a = tmp_path / "node-a"
    (k0,) = adamw_series(hot_a / "llm", 1, seed=8)

    async def go() -> None:
        await push_series(local_url, [k0])
        store = open_store(local_url)
        from transfer.engine.catalog import load_manifest

        manifest = await load_manifest(store, "llm", 20, "a")
        await store.close()
        first = manifest.files[0]
        cid = first.chunks[0].id
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            peer_agent(hot_a, [local_url], [], "a") as url,
            aiohttp.ClientSession(headers=auth) as s,
        ):
            async with s.get(f"{url}/v1/chunks/{cid}") as r:
                assert r.status == 200 and len(await r.read()) == first.chunks[0].size
            async with s.get(f"{url}/v1/chunks/{'0' * 64}") as r:
                assert r.status == 404
            async with s.get(f"{url}/v1/chunks/..%2F..%2Fetc%2Fpasswd") as r:
                assert r.status in (400, 404)
            corrupt = k0 / first.path  # local corruption: never served
            await asyncio.to_thread(corrupt.write_bytes, b"\xff" * 64 + corrupt.read_bytes()[64:])
            async with s.get(f"{url}/v1/chunks/{cid}") as r:
                assert r.status == 404

    asyncio.run(go())


def test_agent_pushes_what_training_writes_and_not_what_it_prefetched(
    local_url: str, tmp_path: Path
) -> None:
    hot_a, hot_b = tmp_path / "node-a", tmp_path / "node-b"

    async def pushes(client: FerryClient) -> list[dict]:  # type: ignore[type-arg]
        return list((await client._call("GET", "/v1/pushes"))["pushes"])

    async def go() -> None:
        async with peer_agent(hot_a, [local_url], [], "a") as url_a, FerryClient(url_a, TOKEN) as a:
            (k0,) = adamw_series(hot_a / "llm", 1, seed=9)  # training saves; .metadata last
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = await pushes(a)
                if any(s.get("state") == "durable" for s in states):
                    break
                await asyncio.sleep(0.2)
            assert [s["state"] for s in states] == ["durable"], states
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession(headers=auth) as s, s.get(f"{url_a}/metrics") as r:
                text = await r.text()
            assert "ferry_push_written_ratio{" in text and "ferry_push_total{" in text
            async with (
                peer_agent(hot_b, [local_url], [url_a], "b") as url_b,
                FerryClient(url_b, TOKEN) as b,
            ):
                done = await b.wait_prefetch(await b.prefetch("llm"), within_s=60)
                assert done["state"] == "ready"
                assert tree_bytes(Path(done["dest"])) == tree_bytes(k0)
                await asyncio.sleep(1.5)  # more than one watcher poll
                assert not [s for s in await pushes(b) if s.get("state") != "restored"]

    asyncio.run(go())


def test_agent_start_sweeps_staging_no_prefetch_will_resume(local_url: str, tmp_path: Path) -> None:
    """A killed prefetch's staging dir is kept for the next prefetch of that step (it
    resumes from it: test_staging.py, test_crash_trials.py); the start-up sweep removes
    what none will adopt: one whose step is here already, one behind a newer leftover of
    the same step, one older than a day, and a fill-in scratch dir."""
    hot = tmp_path / "hot"

    def leftover(name: str, age: float = 0.0) -> Path:
        path = hot / "llm" / name
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "__0_0.distcp").write_bytes(b"x" * 1000)
        then = time.time() - age
        os.utime(path, (then, then))
        return path

    resumable = leftover(".step_000020.ferry-staging-deadbeef", age=5)
    leftover(".step_000020.ferry-staging-000000a1", age=50)  # a newer one is kept
    leftover(".step_000010.ferry-staging-00000010")  # step 10 is here
    leftover(".step_000030.ferry-staging-00000030", age=2 * 86400)  # too old
    leftover(".step_000040.ferry-staging-fill-00000040")
    keep = hot / "llm" / "step_000010"
    keep.mkdir()
    (keep / ".metadata").write_bytes(b"m")

    async def go() -> None:
        async with agent(hot, [local_url]):
            pass

    asyncio.run(go())
    left = sorted(p.name for p in (hot / "llm").iterdir())
    assert left == [resumable.name, "step_000010"], left


def test_an_incomplete_multi_node_step_is_never_latest(local_url: str, tmp_path: Path) -> None:
    from transfer.format.layout import completion_key

    k20, k40 = adamw_series(tmp_path / "src", 2, seed=4)

    async def go() -> None:
        await push_series(local_url, [k20, k40], node="a")
        await push_series(local_url, [k20], node="b")  # node b never finished step 40
        store = open_store(local_url)
        await store.put(completion_key("llm", 20), b'{"job": "llm", "step": 20}', create_only=True)
        await store.close()
        expected = {"FERRY_EXPECTED_NODES": "a,b"}
        node_c = agent(tmp_path / "hot", [local_url], "c", extra_env=expected)
        async with node_c as url, FerryClient(url, TOKEN) as client:
            assert (await client.estimate("llm"))["step"] == 20
            done = await client.wait_prefetch(await client.prefetch("llm"), within_s=60)
            assert done["state"] == "ready" and done["step"] == 20
            listing = (await client.checkpoints())["jobs"]["llm"]
            assert [(e["step"], e["complete"]) for e in listing] == [(20, True), (40, False)]

    asyncio.run(go())


def test_a_local_copy_is_verified_and_never_overwritten(local_url: str, tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    (k0,) = adamw_series(tmp_path / "src", 1, seed=5)

    async def go() -> None:
        await push_series(local_url, [k0])
        here = hot / "llm" / "step_000020"
        shutil.copytree(k0, here)
        async with agent(hot, [local_url]) as url, FerryClient(url, TOKEN) as client:
            good = await client.wait_prefetch(await client.prefetch("llm", 20))
            assert good["state"] == "ready" and good["dest"] == str(here)
            damaged = bytearray((here / "__1_0.distcp").read_bytes())
            damaged[12345] ^= 1
            (here / "__1_0.distcp").write_bytes(bytes(damaged))
            bad = await client.wait_prefetch(await client.prefetch("llm", 20))
            assert bad["state"] == "failed" and "never overwritten" in bad["error"]
            assert (here / "__1_0.distcp").read_bytes() == bytes(damaged)  # untouched

    asyncio.run(go())


def test_a_node_holding_its_own_part_gets_the_other_parts_added(
    local_url: str, tmp_path: Path
) -> None:
    (full,) = adamw_series(tmp_path / "src", 1, seed=6)
    part_a, part_b = tmp_path / "a" / "step_000020", tmp_path / "b" / "step_000020"
    for part, names in (
        (part_a, [".metadata", "__0_0.distcp"]),
        (part_b, [".metadata", "__1_0.distcp"]),
    ):
        part.mkdir(parents=True)
        for name in names:
            shutil.copy(full / name, part / name)
    hot = tmp_path / "hot"

    async def go() -> None:
        await push_series(local_url, [part_a], node="a")
        await push_series(local_url, [part_b], node="b")
        here = hot / "llm" / "step_000020"
        shutil.copytree(part_b, here)  # node b survived with its own part
        own = (here / "__1_0.distcp").stat().st_ino
        async with agent(hot, [local_url], "b") as url, FerryClient(url, TOKEN) as client:
            est = await client.estimate("llm", 20)
            done = await client.wait_prefetch(await client.prefetch("llm", 20), within_s=60)
        assert done["state"] == "ready", done
        # the estimate knew node b holds only its own part (it said 0 bytes missing)
        moved = sum(done["bytes_by_source"].values())
        assert est["source"].startswith("tier:") and moved > 0, est
        assert abs(est["bytes_missing"] - moved) <= 0.25 * moved, (est, moved)
        assert tree_bytes(here) == tree_bytes(full)
        assert (here / "__1_0.distcp").stat().st_ino == own  # its own file was not touched
        assert sorted(p.name for p in (hot / "llm").iterdir()) == ["step_000020"]

    asyncio.run(go())


def test_one_unreachable_tier_does_not_hide_the_others(local_url: str, tmp_path: Path) -> None:
    """tiers = [a missing mount, a good store]: listing and estimates answer from the good
    one (a prefetch would use it too) and name the bad one; with no good tier left, 502."""
    asyncio.run(push_series(local_url, adamw_series(tmp_path / "src", 1)))  # step 20
    missing = str(tmp_path / "nfs-not-mounted")

    async def go() -> None:
        async with (
            agent(tmp_path / "hot", [missing, local_url]) as url,
            FerryClient(url, TOKEN) as client,
        ):
            listing = await client._call("GET", "/v1/checkpoints")
            assert [e["step"] for e in listing["jobs"]["llm"]] == [20]
            assert "does not exist" in listing["unreachable_tiers"][missing]
            est = await client.estimate("llm", 20)
            assert est["source"] == f"tier:{local_url}" and est["bytes_missing"] > 0
        async with (
            agent(tmp_path / "hot2", [missing]) as url,
            FerryClient(url, TOKEN) as client,
        ):
            with pytest.raises(RpcError) as down:
                await client._call("GET", "/v1/checkpoints")
            assert down.value.status == 502
            with pytest.raises(RpcError) as down:
                await client.estimate("llm", 20)
            assert down.value.status == 502 and "does not exist" in str(down.value)

    asyncio.run(go())


def test_a_cost_is_printed_in_digits_a_script_reads() -> None:
    """A fast estimate's cost under 0.0001 was printed "9.7e-05", which the line's reader
    (and this suite's own check of it) did not take for a number."""
    from agent.cli.agent_tools import _money

    assert [_money(a) for a in (0, 9.7e-05, 0.0029, 0.5, 1, 1234.567)] == [
        "0.00", "0.000097", "0.0029", "0.50", "1.00", "1,234.57"
    ]  # fmt: skip
