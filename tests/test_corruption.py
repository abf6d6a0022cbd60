"""Corruption on every read path: a flipped byte in a stored chunk, a truncated pack, a
manifest naming a chunk whose pack is gone. ``ferry verify`` reports every one of them; pull
fails naming a chunk and leaves nothing; a prefetch takes the chunk from another source when
one exists (the next tier; the tier when a peer serves bad bytes), else fails naming it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.cli.run import main as ferry
from agent.rpc.client import FerryClient
from tests.conftest import (
    adamw_series,
    init_test_store,
    make_checkpoint,
    open_test_store,
    tree_bytes,
)
from tests.harness import TOKEN, DyingProxy, agent, prefetch_through, push_series
from transfer.engine.catalog import load_manifest
from transfer.format.layout import pack_key

# one 1 MiB chunk per pack: each injury below hits a different, known chunk
ONE_PER_PACK = ["--chunk-size-mib", "1", "--part-size-mib", "1", "--pack-size-mib", "1"]


async def _injure(store_url: str, job: str, step: int, node: str) -> dict[str, str]:
    """Flip the middle byte of one pack, cut another to half, delete a third.
    Returns {chunk id: what happened to it} for every chunk that these injuries break."""
    store = open_test_store(store_url)
    try:
        m = await load_manifest(store, job, step, node)
        chunks: dict[str, list[tuple[str, int, int]]] = {}  # pack -> (id, offset, stored)
        for c in {c.id: c for f in m.files for c in f.chunks}.values():
            chunks.setdefault(m.packs[c.pack], []).append((c.id, c.offset, c.stored))
        packs = sorted(chunks, key=lambda p: -max(o + n for _, o, n in chunks[p]))[:3]
        assert len(packs) == 3, "the checkpoint needs three packs"
        broken: dict[str, str] = {}
        for pack, what in zip(packs, ("flipped", "truncated", "missing"), strict=True):
            key = pack_key(pack)
            if what == "missing":
                await store.delete(key)
                broken.update((cid, what) for cid, _, _ in chunks[pack])
                continue
            data = bytearray(await store.get(key))
            middle = len(data) // 2
            if what == "flipped":
                data[middle] ^= 0x01
                hit = [cid for cid, o, n in chunks[pack] if o <= middle < o + n]
            else:
                del data[middle:]
                hit = [cid for cid, o, n in chunks[pack] if o + n > middle]
            broken.update((cid, what) for cid in hit)
            await store.put(key, bytes(data))
        return broken
    finally:
        await store.close()


def test_verify_reports_every_injury_and_pull_names_one(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000007", shard_bytes=4_000_000)
    assert ferry(["push", str(src), store_url, "--job", "j", "--node", "n", *ONE_PER_PACK]) == 0
    injured = asyncio.run(_injure(store_url, "j", 7, "n"))
    capsys.readouterr()

    assert ferry(["verify", store_url, "--json"]) == 1
    out, err = capsys.readouterr()
    bad = {b["chunk"]: b for b in json.loads(out)["bad_chunks"]}
    assert set(bad) == set(injured), (bad, injured)  # every one, and nothing else
    words = {"flipped": "corrupt", "truncated": "truncated", "missing": "missing"}
    for cid, what in injured.items():
        assert words[what] in bad[cid]["reason"], bad[cid]
        assert bad[cid]["used_by"][0].startswith("j/7/n:"), bad[cid]  # names the file
        assert cid in err  # the human-readable report names each chunk too

    dest = tmp_path / "restored"
    assert ferry(["pull", store_url, str(dest), "--job", "j"]) == 1
    err = capsys.readouterr().err
    assert any(cid in err for cid in injured), err
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_verify_reads_every_stored_copy_of_a_chunk(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: the same save pushed under two jobs is stored twice (each job
    dedupes within itself); the second job's copy corrupt, ``ferry verify`` of the store
    said "all good" (it read one copy per chunk id) while a pull of that job failed."""
    src = make_checkpoint(tmp_path / "step_000007", shard_bytes=4_000_000)
    for job in ("a", "b"):
        assert ferry(["push", str(src), local_url, "--job", job, "--node", "n", *ONE_PER_PACK]) == 0
    injured = asyncio.run(_injure(local_url, "b", 7, "n"))
    capsys.readouterr()
    assert ferry(["verify", local_url, "--json"]) == 1
    bad = {b["chunk"]: b for b in json.loads(capsys.readouterr().out)["bad_chunks"]}
    assert set(bad) == set(injured), (bad, injured)
    assert all(u.startswith("b/7/n:") for b in bad.values() for u in b["used_by"]), bad
    assert ferry(["verify", local_url, "--job", "a"]) == 0  # job a's copies are sound


def test_verify_decodes_each_copy_against_the_base_its_own_manifest_names(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reviewer's trial: the same delta-coded series under two jobs, job a's copy of a
    base chunk flipped. Job b's deltas were decoded against job a's base copy and reported
    bad, though a pull of job b (its own copies) succeeds."""
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    for job in ("a", "b"):
        for k in (k0, k1):
            argv = ["push", str(k), local_url, "--job", job, "--node", "n", *ONE_PER_PACK]
            assert ferry(argv) == 0

    async def flip_a_base() -> tuple[str, str]:
        store = open_test_store(local_url)
        try:
            m = await load_manifest(store, "a", 40, "n")
            base = next(c for c in m.bases)
            key = pack_key(m.packs[base.pack])
            data = bytearray(await store.get(key))
            data[base.offset + base.stored // 2] ^= 0x01
            await store.put(key, bytes(data))
            return base.id, m.packs[base.pack]
        finally:
            await store.close()

    cid, pack = asyncio.run(flip_a_base())
    capsys.readouterr()
    assert ferry(["verify", local_url, "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)["bad_chunks"]
    assert any(b["chunk"] == cid and b["pack"] == pack for b in bad), bad
    assert not [u for b in bad for u in b["used_by"] if u.startswith("b/")], bad
    assert ferry(["verify", local_url, "--job", "b"]) == 0
    assert ferry(["pull", local_url, str(tmp_path / "b40"), "--job", "b", "--step", "40"]) == 0


def test_a_cold_pull_of_deltas_names_a_corrupt_base_and_leaves_nothing(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A delta's base read from the store beside the range (engine/fetch.py) is decoded
    unverified, as a local base is; when it is corrupt, the delta's hash check fails and
    the pull names the base, not the delta that needed it."""
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    for k in (k0, k1):
        assert ferry(["push", str(k), store_url, "--job", "d", "--node", "n", *ONE_PER_PACK]) == 0

    async def flip_a_base() -> str:
        store = open_test_store(store_url)
        try:
            m = await load_manifest(store, "d", 40, "n")
            base = next(c for c in m.bases)  # needed only as a base: not k+1's own chunk
            key = pack_key(m.packs[base.pack])
            data = bytearray(await store.get(key))
            data[base.offset + base.stored // 2] ^= 0x01
            await store.put(key, bytes(data))
            return base.id
        finally:
            await store.close()

    bad = asyncio.run(flip_a_base())
    err = _cold_pull_of_step_40_fails(store_url, tmp_path, capsys)
    assert bad in err and "corrupt" in err, err


def test_a_cold_pull_of_deltas_names_a_base_cut_short_and_leaves_nothing(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bases of neighbouring deltas come from the store a run at a time (one read
    each: engine/fetch.py's _BaseWindow); a base pack cut short in the middle of a base
    fails the pull naming a chunk stored at or past the cut, as truncated, and nothing is
    left. (The pack may also hold chunks k+1 shares with k unchanged: whichever read the
    pull's workers reach first is named, a base or such a chunk.)"""
    k0, k1 = adamw_series(tmp_path / "hot", 2, mib=8)
    several = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]
    for k in (k0, k1):
        assert ferry(["push", str(k), store_url, "--job", "d", "--node", "n", *several]) == 0

    async def cut_a_base_pack() -> list[str]:
        store = open_test_store(store_url)
        try:
            m = await load_manifest(store, "d", 40, "n")
            base = sorted(m.bases, key=lambda b: (b.pack, b.offset))[1]
            key = pack_key(m.packs[base.pack])
            cut = base.offset + base.stored // 2
            await store.put(key, (await store.get(key))[:cut])
            return [
                c.id for c in m.all_chunks() if c.pack == base.pack and c.offset + c.stored > cut
            ]
        finally:
            await store.close()

    gone = asyncio.run(cut_a_base_pack())
    err = _cold_pull_of_step_40_fails(store_url, tmp_path, capsys)
    assert "truncated" in err and any(cid in err for cid in gone), err


def _cold_pull_of_step_40_fails(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    """Pull job d's step 40 into an empty directory: it fails, leaves neither the
    destination nor a staging directory, and returns what it said."""
    capsys.readouterr()
    dest = tmp_path / "restored"
    assert ferry(["pull", store_url, str(dest), "--job", "d", "--step", "40"]) == 1
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]
    return capsys.readouterr().err


def test_prefetch_falls_back_to_the_next_tier_and_names_the_chunk_when_none_is_good(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiers = [init_test_store(str(tmp_path / name)) for name in ("warm", "cold")]
    src = make_checkpoint(tmp_path / "src" / "step_000007", shard_bytes=4_000_000)
    for tier in tiers:
        assert ferry(["push", str(src), tier, "--job", "j", "--node", "n", *ONE_PER_PACK]) == 0
    capsys.readouterr()
    injured = asyncio.run(_injure(tiers[0], "j", 7, "n"))

    async def prefetch(hot: Path) -> dict:  # type: ignore[type-arg]
        async with agent(hot, tiers) as url, FerryClient(url, TOKEN) as client:
            return await client.wait_prefetch(await client.prefetch("j", 7), within_s=60)

    done = asyncio.run(prefetch(tmp_path / "hot-1"))
    assert done["state"] == "ready", done
    assert tree_bytes(Path(done["dest"])) == tree_bytes(src)
    assert done["bytes_by_source"][f"tier:{tiers[1]}"] > 0

    asyncio.run(_injure(tiers[1], "j", 7, "n"))  # now no tier has good copies
    done = asyncio.run(prefetch(tmp_path / "hot-2"))
    assert done["state"] == "failed", done
    assert "chunk " in done["error"] and any(cid in done["error"] for cid in injured), done
    assert not list((tmp_path / "hot-2" / "j").iterdir())  # nothing partial, no staging


class TamperingPeer(DyingProxy):
    """A real HTTP proxy in front of a peer agent that damages every chunk it relays:
    ``flip`` one byte, ``truncate`` to half, or ``pad`` with extra bytes."""

    def __init__(self, target: str, how: str) -> None:
        super().__init__(target, budget=1 << 30)
        self.how, self.relayed = how, 0

    async def handle(self, request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                self.target + request.path,
                headers={"Authorization": request.headers.get("Authorization", "")},
            ) as r,
        ):
            body = bytearray(await r.read())
            status = r.status
        if status == 200 and body:
            self.relayed += 1
            if self.how == "flip":
                body[len(body) // 2] ^= 0x80
            elif self.how == "truncate":
                del body[len(body) // 2 :]
            else:
                body += b"\0" * 4096
        return web.Response(status=status, body=bytes(body))


@pytest.mark.parametrize("how", ["flip", "truncate", "pad"])
def test_a_peer_serving_bad_bytes_is_ignored_and_the_tier_used(
    local_url: str, tmp_path: Path, how: str
) -> None:
    hot_a = tmp_path / "node-a"
    (k0,) = adamw_series(hot_a / "llm", 1, seed=21)

    async def go() -> None:
        await push_series(local_url, [k0])
        async with agent(hot_a, [local_url], "a") as url_a:
            tamper = TamperingPeer(url_a, how)
            done = await prefetch_through(tamper, tmp_path / "b", [local_url], "b")
        assert done["state"] == "ready", done
        assert tree_bytes(Path(done["dest"])) == tree_bytes(k0)
        assert tamper.relayed > 0  # the peer was asked, and lied
        assert done["bytes_by_source"].get("peer", 0) == 0  # none of its bytes were used
        assert done["bytes_by_source"][f"tier:{local_url}"] > 0

    asyncio.run(go())
