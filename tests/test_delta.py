"""Delta coding between successive checkpoints: bit-exact codecs, bounded chains, pulls that
reuse a local base, and bad bases that never produce wrong bytes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli.run import main as ferry
from agent.daemon.config import load_config
from agent.node.pushqueue import PushQueue
from tests.conftest import adamw_series, open_test_store, tree_bytes
from tests.faultproxy import FaultProxy
from tests.harness import queue_agent as agent
from tests.harness import until
from transfer.codec import (
    KNOWN_ENCODINGS,
    decode,
    decode_on_keyframe,
    encode,
    encode_as,
    needs_base,
    pairs_with_keyframe,
    plane_width,
)
from transfer.engine import PullPlan, Sources, TransferOptions, pull, push
from transfer.engine.catalog import list_checkpoints, load_manifest
from transfer.engine.settle import settle
from transfer.format.manifest import chain_depths

MiB = 1 << 20
SMALL = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]

# Float bit patterns that break naive coders: NaNs, infinities, denormals, signed zeros.
SPECIAL_F32 = np.array(
    [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4e38, 1.0], np.float32
).tobytes()


def float_like() -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, odd lengths, and byte strings built from special float patterns."""
    specials = st.lists(st.integers(0, 9), max_size=300).map(
        lambda idx: b"".join(SPECIAL_F32[4 * i : 4 * i + 4] for i in idx)
    )
    return st.one_of(st.binary(max_size=5000), specials, specials.map(lambda b: b[1:]))


@given(float_like(), float_like(), st.sampled_from(sorted(KNOWN_ENCODINGS)))
@settings(max_examples=300, deadline=None)
def test_every_encoding_round_trips_for_any_bytes_and_base(
    data: bytes, base: bytes, enc: str
) -> None:
    payload = encode_as(enc, data, 1, base if needs_base(enc) else None)
    assert decode(enc, payload, len(data), base if needs_base(enc) else None) == data


@given(float_like(), st.one_of(st.none(), float_like()))
@settings(max_examples=200, deadline=None)
def test_chosen_encoding_round_trips(data: bytes, base: bytes | None) -> None:
    enc, payload = encode(data, 1, base)
    assert decode(enc, payload, len(data), base if needs_base(enc) else None) == data


@given(float_like(), float_like(), st.sampled_from([1, 2, 4]))
@settings(max_examples=200, deadline=None)
def test_a_delta_decodes_on_its_keyframe_as_on_the_decoded_base(
    data: bytes, base: bytes, width: int
) -> None:
    """A cold restore decodes a delta straight from its keyframe base's stored payload
    (codec.decode_on_keyframe: both unplaned together): the same bytes as decoding the
    base first, for any data, any width, tails included."""
    base = base or b"\0"
    base = (base * (len(data) // len(base) + 1))[: len(data)]  # the same size
    planes = {1: "", 2: "bp2+", 4: "bp4+"}[width]
    kind, enc = f"{planes}zstd", f"xor+{planes}zstd"
    assert pairs_with_keyframe(enc, len(data), kind, len(base))
    stored_base = encode_as(kind, base, 1)
    delta = encode_as(enc, data, 1, base)
    out = memoryview(bytearray(len(data)))
    assert decode_on_keyframe(enc, delta, len(data), kind, stored_base, out) == data


def test_delta_against_a_wrong_base_never_yields_the_right_hash_silently() -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(0, 0.02, 1 << 18).astype(np.float32)
    new = (base + 1e-5).astype(np.float32)
    enc, payload = encode(new.tobytes(), 1, base.tobytes())
    assert needs_base(enc)
    wrong = decode(enc, payload, new.nbytes, os.urandom(base.nbytes))
    assert wrong != new.tobytes()  # pull catches this by hashing every decoded chunk


def test_random_data_costs_at_most_one_percent_over_raw() -> None:
    data, base = os.urandom(4 * MiB), os.urandom(4 * MiB)
    enc, payload = encode(data, 1, base)
    assert enc == "raw" and len(payload) <= len(data) * 1.01


# --- a synthetic AdamW-like series -------------------------------------------------------


def push_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert ferry([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_successive_checkpoints_are_delta_coded_and_pull_byte_exact(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    first = push_json(capsys, "push", str(k0), store_url, "--job", "d", "--node", "n", *SMALL)
    assert first["chunks_delta"] == 0 and first["base_step"] is None
    second = push_json(capsys, "push", str(k1), store_url, "--job", "d", "--node", "n", *SMALL)
    assert second["base_step"] == 20 and second["base_local"] is True  # sibling step dir
    assert second["chunks_delta"] > 0 and second["chunks_deduped"] > 0
    assert second["bytes_transferred"] < 0.6 * second["bytes_raw"]
    assert second["chunks_raw"] + second["chunks_delta"] == second["chunks_new"]

    out = tmp_path / "cold"
    pulled = push_json(capsys, "pull", store_url, str(out), "--job", "d", *SMALL)
    assert pulled["chunks_delta"] > 0
    assert tree_bytes(out) == tree_bytes(k1)


def test_a_cold_pull_of_deltas_sets_aside_a_bounded_share_of_each_range(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed from S3 without the base at hand, a delta whose base is a keyframe gets
    it read beside the range, in the reader thread; any other (a longer chain: here every
    one, by making the reader's base reads decline) is set aside for the loop, and past
    LEFT_BYTES a range stops and goes on where it stood (at 1 byte: after every chunk set
    aside). Each way the same bytes land, and the same bytes move."""
    from transfer.engine import fetch

    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    for k in (k0, k1):
        push_json(capsys, "push", str(k), s3_url, "--job", "d", "--node", "n", *SMALL)
    moved = {}
    for way in ("in the reader", "left, 1 GiB", "left, 1 byte"):
        if way != "in the reader":
            monkeypatch.setattr(fetch._Fetch, "remote_base", lambda self, reader, c: None)
            monkeypatch.setattr(fetch, "LEFT_BYTES", 1 if way.endswith("byte") else 1 << 30)
        out = tmp_path / way.replace(" ", "-").replace(",", "")
        pulled = push_json(capsys, "pull", s3_url, str(out), "--job", "d", *SMALL)
        assert pulled["chunks_delta"] > 2  # several set aside, so several stops at 1 byte
        assert tree_bytes(out) == tree_bytes(k1)
        moved[way] = pulled["bytes_transferred"]
    assert len(set(moved.values())) == 1, moved


def test_a_cold_pull_reads_neighbouring_deltas_bases_in_one_request(
    s3_url: str,
    s3_proxy: FaultProxy,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pulled onto an empty node, a delta-coded step needs its keyframe bases from the
    store too; the bases of the next delta chunks lie side by side in the base step's
    packs, so a reader asks for them a window at a time, not one request each. Counted at
    a proxy: fewer GETs than one per base by at least half the delta chunks, and the
    same bytes."""
    from transfer.engine import fetch

    k0, k1 = adamw_series(tmp_path / "hot", 2, mib=8)
    for k in (k0, k1):
        push_json(capsys, "push", str(k), s3_url, "--job", "d", "--node", "n", *SMALL)
    gets, moved = {}, {}
    for way, window in (("one request per base", 1), ("windows", fetch.BASE_WINDOW_BYTES)):
        monkeypatch.setattr(fetch, "BASE_WINDOW_BYTES", window)
        before = s3_proxy.stats.by_method["GET"]
        out = tmp_path / way.replace(" ", "-")
        via = ["--endpoint-url", s3_proxy.url, *SMALL]
        pulled = push_json(capsys, "pull", s3_url, str(out), "--job", "d", *via)
        assert tree_bytes(out) == tree_bytes(k1)
        gets[way] = s3_proxy.stats.by_method["GET"] - before
        moved[way] = pulled["bytes_transferred"]
    assert pulled["chunks_delta"] >= 8
    assert gets["windows"] <= gets["one request per base"] - pulled["chunks_delta"] // 2, gets
    assert moved["windows"] == moved["one request per base"], moved


def test_pull_onto_a_node_holding_the_base_downloads_only_the_deltas(
    store_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    push_json(capsys, "push", str(k0), store_url, "--job", "d", "--node", "n", *SMALL)
    second = push_json(capsys, "push", str(k1), store_url, "--job", "d", "--node", "n", *SMALL)
    held = tmp_path / "node2" / "step_000020"
    shutil.copytree(k0, held)
    out = tmp_path / "node2" / "step_000040"
    monkeypatch.chdir(tmp_path)  # the base named relative to here: reported absolute (a
    # pull through an agent said its own relative hot dir, meaningless to the caller)
    pulled = push_json(
        capsys, "pull", store_url, str(out), "--job", "d", "--base-dir", "node2/step_000020", *SMALL
    )
    assert tree_bytes(out) == tree_bytes(k1)
    assert pulled["chunks_local"] > 0
    # only what the second push wrote (its deltas) is downloaded, never the unchanged chunks
    assert pulled["bytes_transferred"] <= second["bytes_transferred"]
    # the report says the held copy was used, and where the time went
    assert pulled["base_dir"] == str(held) and pulled["bases_local"] == second["chunks_delta"]
    stages = pulled["stage_seconds"]
    assert {"receive", "base_read", "decode", "hash", "write"} <= set(stages)
    assert all(stages[s] > 0 for s in ("receive", "base_read", "decode", "hash", "write"))


def test_corrupt_local_base_falls_back_to_the_store(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2)
    push_json(capsys, "push", str(k0), local_url, "--job", "d", "--node", "n", *SMALL)
    push_json(capsys, "push", str(k1), local_url, "--job", "d", "--node", "n", *SMALL)
    held = tmp_path / "held"
    shutil.copytree(k0, held)
    with open(held / "__0_0.distcp", "r+b") as fh:  # damage every MiB of the local base
        for off in range(0, os.path.getsize(held / "__0_0.distcp"), MiB):
            fh.seek(off + 100)
            fh.write(b"\x00\x01\x02\x03")
    out = tmp_path / "out"
    push_json(capsys, "pull", local_url, str(out), "--job", "d", "--base-dir", str(held), *SMALL)
    assert tree_bytes(out) == tree_bytes(k1)


def test_push_reads_a_local_base_whole_only_for_the_chunks_it_delta_codes(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base's sample spans decide; a chunk stored on its own never reads (or hashes)
    the rest of its base. A local copy that is not the base (damaged) is caught when a
    delta is chosen, and the base comes from the store: the delta is still right."""
    from transfer.engine.resolver import ChunkResolver

    whole_reads: list[str] = []
    real = ChunkResolver.read_local

    def counting(self: ChunkResolver, cid: str, size: int, hint: tuple[str, int]) -> object:
        whole_reads.append(cid)
        return real(self, cid, size, hint)

    monkeypatch.setattr(ChunkResolver, "read_local", counting)
    opts = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB)
    rng = np.random.default_rng(3)
    noise = [tmp_path / "noise" / f"step_{s:06d}" for s in (20, 40)]
    for d in noise:  # nothing in common: a delta never pays
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(rng.bytes(3 * MiB))
        (d / ".metadata").write_bytes(b"dcp")
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)

    async def go() -> None:
        store = open_test_store(local_url)
        for s, d in zip((20, 40), noise, strict=True):
            await push(store, d, job="noise", step=s, node="n", options=opts)
        assert whole_reads == []  # three keyframes: no base read past its samples
        await push(store, k0, job="d", step=20, node="n", options=opts)
        _damage(k0 / "__0_0.distcp", MiB // 2)  # the local copy is no longer the base
        r = await push(store, k1, job="d", step=40, node="n", options=opts)
        assert r.chunks_delta > 0 and len(whole_reads) >= r.chunks_delta
        out = tmp_path / "out"
        await pull(store, out, PullPlan("d", 40), options=opts)
        assert tree_bytes(out) == tree_bytes(k1)

    asyncio.run(go())


def _damage(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * 64)


def test_missing_base_pack_fails_clearly_and_leaves_nothing(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2)
    push_json(capsys, "push", str(k0), local_url, "--job", "d", "--node", "n", *SMALL)

    async def packs() -> set[str]:
        store = open_test_store(local_url)
        return {o.key for o in await store.list("packs/")}

    first_packs = asyncio.run(packs())
    second = push_json(capsys, "push", str(k1), local_url, "--job", "d", "--node", "n", *SMALL)
    assert second["chunks_delta"] > 0
    for key in first_packs:  # the base's packs vanish (a broken GC, a manual delete)
        os.remove(Path(local_url) / key)
    out = tmp_path / "out"
    assert ferry(["pull", local_url, str(out), "--job", "d", "--step", "40"]) == 1
    assert "missing" in capsys.readouterr().err
    assert not out.exists()


def test_restore_chains_are_bounded_and_every_step_restores(tmp_path: Path) -> None:
    series = adamw_series(tmp_path / "hot", 6, seed=3)
    opts = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB, max_chain=2)
    store_dir = tmp_path / "store"
    store_dir.mkdir()

    async def go() -> list[int]:
        store = open_test_store(str(store_dir))
        for d in series:
            step = int(d.name.split("_")[1])
            await push(store, d, job="c", step=step, node="n", options=opts)
        depths = []
        for c in await list_checkpoints(store, "c"):
            m = await load_manifest(store, c.job, c.step, c.node)
            depths.append(max(chain_depths(m).values()))
            await pull(store, tmp_path / f"r{c.step}", PullPlan("c", c.step), options=opts)
        return depths

    depths = asyncio.run(go())
    assert max(depths) == 2, depths  # deltas were used, and never chained past max_chain
    for d in series:
        assert tree_bytes(tmp_path / f"r{int(d.name.split('_')[1])}") == tree_bytes(d)


def test_full_forces_a_keyframe(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2)
    push_json(capsys, "push", str(k0), local_url, "--job", "d", "--node", "n", *SMALL)
    r = push_json(capsys, "push", str(k1), local_url, "--job", "d", "--node", "n", "--full")
    assert r["chunks_delta"] == 0 and r["base_step"] is None


def _push_with_the_agent(
    saves: list[Path], url: str, job: str, delta: bool, where: str, tmp_path: Path
) -> list[dict]:  # type: ignore[type-arg]
    """The agent's push queue, made from a config that sets ``delta`` in the file or in the
    environment, pushing each save as it lands in the hot dir."""
    hot, config_file = tmp_path / f"hot-{job}", tmp_path / f"{job}.toml"
    text = (
        f'node = "n"\nhot_dir = "{hot}"\nstate_dir = "{tmp_path / f"state-{job}"}"\n'
        f'tiers = ["{url}"]\nquiet_seconds = 0\n[transfer]\n'
        "chunk_size_mib = 1\npart_size_mib = 5\npack_size_mib = 10\n"
    )
    env = {}
    if where == "file":
        text += f"delta = {str(delta).lower()}\n"
    else:
        env["FERRY_TRANSFER_DELTA"] = str(delta).lower()
    config_file.write_text(text)
    config = load_config(config_file, env=env)
    assert config.sources["transfer.delta"].startswith(where)

    async def go() -> list[dict]:  # type: ignore[type-arg]
        queue = PushQueue.from_config(config, [(url, open_test_store(url))])
        async with agent(queue, hot):
            for pushed, save in enumerate(saves, 1):
                shutil.copytree(save, hot / job / f".{save.name}")
                (hot / job / f".{save.name}").rename(hot / job / save.name)  # whole, committed
                await until(lambda n=pushed: queue.idle and len(queue.states()) == n)
            return [row["result"] for row in reversed(queue.states())]

    return asyncio.run(go())


@pytest.mark.parametrize("door", ["cli", "agent file", "agent env"])
def test_delta_off_is_reachable_from_both_front_doors(
    door: str, local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``delta``, declared once (TransferSettings), switched off from the CLI (``--no-delta``),
    the agent's [transfer] table or ``FERRY_TRANSFER_DELTA``: the second save is stored with
    no delta-coded chunk, where the same pushes with it on code some."""
    saves = adamw_series(tmp_path / "saves", 2)
    for delta in (True, False):
        job = "on" if delta else "off"
        if door == "cli":
            argv = ["--job", job, "--node", "n", *SMALL, "--delta" if delta else "--no-delta"]
            results = [push_json(capsys, "push", str(save), local_url, *argv) for save in saves]
        else:
            results = _push_with_the_agent(saves, local_url, job, delta, door[6:], tmp_path)
        assert [r["step"] for r in results] == [20, 40]
        coded = push_json(capsys, "ls", local_url, "--job", job)["checkpoints"]
        if delta:
            assert results[1]["chunks_delta"] > 0 and results[1]["base_step"] == 20
            assert coded[1]["delta_chunks"] > 0
        else:
            assert [r["chunks_delta"] for r in results] == [0, 0]
            assert results[1]["base_step"] is None and results[1]["chunks_deduped"] > 0
            assert [c["delta_chunks"] for c in coded] == [0, 0]


def test_a_pull_cancelled_at_any_moment_leaves_nothing_or_what_the_next_pull_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled at any moment, a pull leaves the complete restore (the rename won), or
    nothing, or its staging directory, which the next pull into the same place adopts:
    never a partial destination, never two leftovers."""
    import importlib

    from transfer.engine.staging import DestinationLock, Staging

    # (transfer.engine re-exports the pull() function under the module's name)
    pull_module = importlib.import_module("transfer.engine.pull")

    # Widen the window in which a cancel lands while a worker thread is still creating the
    # staging directory (on a loaded machine it is real, just rarely hit).
    open_staging = pull_module.open_staging

    def slow_open_staging(dest: Path, held: DestinationLock | None = None) -> Staging:
        made = open_staging(dest, held)
        time.sleep(0.1)
        return made

    monkeypatch.setattr(pull_module, "open_staging", slow_open_staging)
    (k0,) = adamw_series(tmp_path / "hot", 1)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    out = tmp_path / "out"
    opts = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB, window=1)

    async def push_it() -> None:
        await push(open_test_store(str(store_dir)), k0, job="c", step=1, node="n", options=opts)

    async def pull_then_cancel(delay: float) -> None:
        task = asyncio.create_task(
            pull(open_test_store(str(store_dir)), out / "dest", PullPlan("c", 1), options=opts)
        )
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(push_it())
    for delay in (0.0, 0.001, 0.05, 0.15, 0.2, 0.3):
        asyncio.run(pull_then_cancel(delay))
        left = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if "dest" in left:  # complete (the rename won: with its unsynced marker, settle.py)
            assert left == [".dest.ferry-unsynced", "dest"], left
            assert settle(out) == []  # same boot: flushed and confirmed
        else:
            assert len(left) <= 1 and all(n.startswith(".dest.ferry-staging-") for n in left)
            asyncio.run(
                pull(open_test_store(str(store_dir)), out / "dest", PullPlan("c", 1), options=opts)
            )
            settle(out)
            assert sorted(p.name for p in out.iterdir()) == ["dest"]  # the leftover adopted
        assert tree_bytes(out / "dest") == tree_bytes(k0)
        shutil.rmtree(out)


def test_base_manifests_limit_local_reads_to_unchanged_chunks(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Knowing the held checkpoint's manifests, a pull reads from it only the chunks that sit
    there unchanged (plus delta bases), not every position; a wrong claim costs nothing but a
    miss (bytes are still verified). A held checkpoint named by its step (step_000020) has
    its manifests found in the store by the pull itself."""
    import importlib

    from transfer.engine.catalog import resolve_manifests

    pull_mod = importlib.import_module("transfer.engine.pull")  # the module, not pull()

    opts = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB)
    k0, k1 = adamw_series(tmp_path / "hot", 2, frozen=0.5)
    unnamed = tmp_path / "held-copy"  # a name that gives no step: nothing to look up
    shutil.copytree(k0, unnamed)
    reads: list[int] = []
    real = pull_mod.read_local_into

    def counting(*args: object) -> bool:
        reads.append(1)
        return real(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(pull_mod, "read_local_into", counting)

    async def go() -> dict[str, tuple[int, int]]:
        store = open_test_store(local_url)
        await push(store, k0, job="d", step=20, node="n", options=opts)
        await push(store, k1, job="d", step=40, node="n", options=opts)
        base_m = await resolve_manifests(store, "d", 20)
        wrong_m = await resolve_manifests(store, "d", 40)  # claims k1's chunks are in k0
        got = {}
        cases = (
            ("none", None, unnamed),
            ("base", base_m, k0),
            ("wrong", wrong_m, k0),
            ("named", None, k0),
        )
        for name, manifests, held in cases:
            reads.clear()
            dest = tmp_path / f"out-{name}"
            r = await pull(store, dest, PullPlan("d", 40), Sources(held, manifests), options=opts)
            assert tree_bytes(dest) == tree_bytes(k1)
            got[name] = (len(reads), r.chunks_local)
        return got

    got = asyncio.run(go())
    assert got["base"][1] == got["none"][1] == got["wrong"][1] > 0  # same chunks reused
    assert got["base"][0] < got["none"][0]  # changed chunks' positions are not read twice
    assert got["wrong"][0] == got["none"][0]
    assert got["named"] == got["base"]


# --- the keyframe policy (transfer/engine/keyframes.py) ----------------------------------


def test_the_codec_asks_the_policy_and_falls_back_to_the_best_plain_encoding() -> None:
    rng = np.random.default_rng(5)
    base = rng.normal(0, 0.02, 64 * 1024).astype(np.float32)
    data = (base + rng.normal(0, 1e-6, base.size).astype(np.float32)).tobytes()
    asked: list[tuple[int, int]] = []

    def refuse(delta: int, keyframe: int) -> bool:
        asked.append((delta, keyframe))
        return False

    assert needs_base(encode(data, 1, base.tobytes())[0])  # a delta wins here...
    enc, payload = encode(data, 1, base.tobytes(), refuse)
    assert not needs_base(enc) and decode(enc, payload, len(data)) == data  # ...refused
    ((delta, keyframe),) = asked
    assert 0 < delta < keyframe < len(data)  # estimates of the whole chunk, from samples
    assert needs_base(encode(data, 1, base.tobytes(), lambda d, k: True)[0])


@pytest.mark.parametrize("width", [1, 2, 4])
def test_a_width_hint_narrows_the_candidates_and_the_fallback_keeps_to_it(width: int) -> None:
    rng = np.random.default_rng(6)
    base = rng.normal(0, 0.02, 64 * 1024).astype(np.float32)
    data = (base + rng.normal(0, 1e-6, base.size).astype(np.float32)).tobytes()
    enc, payload = encode(data, 1, base.tobytes(), width=width)
    assert needs_base(enc) and plane_width(enc) == width
    assert decode(enc, payload, len(data), base.tobytes()) == data
    enc, payload = encode(data, 1, base.tobytes(), lambda d, k: False, width)  # refused
    assert not needs_base(enc) and plane_width(enc) == width
    assert decode(enc, payload, len(data)) == data
    assert plane_width(encode(data, 1)[0]) == 4  # unhinted, fp32 data picks its planes


def test_the_policy_weighs_the_saving_and_the_cold_restore() -> None:
    from transfer.engine.chunkindex import ChunkIndex, StoredChunk
    from transfer.engine.keyframes import delta_policy, may_delta

    index = ChunkIndex()
    index.add(StoredChunk("k", 100, "bp4+zstd", "p", 0, 80))  # a keyframe: 80 stored
    index.add(StoredChunk("d1", 100, "xor+bp4+zstd", "p", 80, 30, "k"))
    assert index.cold_cost("k") == 80 and index.cold_cost("d1") == 110
    opts = TransferOptions(delta_min_saving=0.25, max_cold_cost=2.0, max_chain=2)
    on_keyframe = delta_policy(index, "k", opts)
    assert on_keyframe(60, 80)  # saves 25%; a cold restore fetches 60 + 80 <= 2 x 80
    assert not on_keyframe(61, 80)  # saves under 25%
    on_delta = delta_policy(index, "d1", opts)
    assert on_delta(50, 80)  # cold: 50 + 110 = 160 = 2 x 80
    assert not on_delta(51, 80)  # saves 36%, but a cold restore would fetch 161
    assert may_delta(index, "d1", opts)  # depth 1 + 1 <= 2
    index.add(StoredChunk("d2", 100, "xor+bp4+zstd", "p", 110, 5, "d1"))
    assert not may_delta(index, "d2", opts)  # depth 3 > max_chain


def test_the_policy_reaches_the_writer_from_the_cli(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k0, k1 = adamw_series(tmp_path / "hot", 2)
    for ckpt in (k0, k1):  # any saving: the moments' deltas are kept
        r = push_json(capsys, "push", str(ckpt), local_url, "--job", "a", "--node", "n", *SMALL,
                      "--delta-min-saving", "0", "--max-cold-cost", "1000")  # fmt: skip
    assert r["chunks_delta"] > 0
    for ckpt in (k0, k1):  # a delta must save 99%: every changed chunk is a keyframe
        r = push_json(capsys, "push", str(ckpt), local_url, "--job", "b", "--node", "n", *SMALL,
                      "--delta-min-saving", "0.99")  # fmt: skip
    assert r["chunks_delta"] == 0 and r["base_step"] == 20
    out = tmp_path / "out"
    assert ferry(["pull", local_url, str(out), "--job", "b", "--step", "40"]) == 0
    assert tree_bytes(out) == tree_bytes(k1)
