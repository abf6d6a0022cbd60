"""The scale-down drill through ferry: 8 ranks save with real torch DCP onto 4 nodes' disks
(2 ranks each, rank 0's node also ``.metadata``), every node pushes its part, 2 survivors
pull the shares their new ranks read (world size 4), and 4 ranks ``dcp.load`` from the
survivors' copies: tensor-equal to a load from the whole save, the same next-step loss, a
rank pointed at the other survivor's copy fails, and a full pull stays byte-exact.

One test per question, on one save made once per module (each xdist worker that runs
tests of this module makes its own: the drill takes ~10 s)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.cli.run import main as ferry
from tests.conftest import init_test_store, open_test_store, tree_bytes

pytest.importorskip("torch")
from tests.dcp_drill import DrillError, load_drill, save_drill, split_by_node
from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.slow  # each test runs real gloo ranks (a 10 s drill save per worker)

WIDTH = 2048  # emb 512 x 2048 fp32: ~1.6 MB per rank file with its AdamW moments
STEP = 100
SMALL_CHUNKS = 16 << 10  # the drill's files are ~1.6 MB; a real rank file is GBs


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("drill")
    save_drill(root / "save", 8, width=WIDTH)
    return root / "save", split_by_node(root / "save", root / "nodes", 2)


def push_parts(url: str, nodes: list[Path], *extra: str) -> None:
    for k, node_dir in enumerate(nodes):
        args = ["push", str(node_dir), url, "--job", "drill", "--step", str(STEP)]
        assert ferry([*args, "--node", f"n{k}", "--part", *extra]) == 0


async def push_parts_small_chunks(url: str, nodes: list[Path]) -> None:
    from transfer.engine import PushPlan, push
    from transfer.options import TransferOptions

    store = open_test_store(url)
    options = TransferOptions(chunk_size=SMALL_CHUNKS, part_size=1 << 20)
    try:
        for k, node_dir in enumerate(nodes):
            await push(store, node_dir, job="drill", step=STEP, node=f"n{k}", options=options,
                       plan=PushPlan(part=True))  # fmt: skip
    finally:
        await store.close()


def pull_share(url: str, dest: Path, ranks: str, capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    args = ["pull", url, str(dest), "--job", "drill", "--step", str(STEP), "--json"]
    assert ferry([*args, "--world-size", "4", "--ranks", ranks]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_node_pushes_its_part_and_a_torn_part_is_refused(
    drill: tuple[Path, list[Path]],
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    save, nodes = drill
    # rank 0's node holds .metadata and 2 of 8 shards: as a whole save, it is torn
    args = ["push", str(nodes[0]), local_url, "--job", "drill", "--step", str(STEP)]
    assert ferry([*args, "--node", "n0"]) == 1
    assert "push it with --part" in capsys.readouterr().err
    torn = tmp_path / "torn"
    shutil.copytree(nodes[0], torn)
    shard = torn / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert ferry([args[0], str(torn), *args[2:], "--node", "n0", "--part"]) == 1
    assert "__1_0.distcp is" in capsys.readouterr().err  # a shard it holds must be whole
    push_parts(local_url, nodes)
    whole = tmp_path / "whole"
    assert ferry(["pull", local_url, str(whole), "--job", "drill", "--step", str(STEP)]) == 0
    assert tree_bytes(whole) == tree_bytes(save)


def test_survivors_fetch_their_shares_and_load_resharded(
    drill: tuple[Path, list[Path]], s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save, nodes = drill
    asyncio.run(push_parts_small_chunks(s3_url, nodes))
    raw = sum(p.stat().st_size for p in save.iterdir())
    a, b = tmp_path / "survivor-a", tmp_path / "survivor-b"
    for dest, ranks in ((a, "0,1"), (b, "2-3")):
        got = pull_share(s3_url, dest, ranks, capsys)
        assert got["share"]["layout"] == {"world_size": 4, "ranks": [0, 1] if dest == a else [2, 3]}
        # its half and the replicated items, in whole chunks (stored bytes are fewer still:
        # the AdamW moments of embedding rows no batch touched are zeros, and compress)
        assert got["share"]["bytes"] <= got["share"]["chunk_bytes"] <= 0.55 * raw, (got, raw)
        assert got["bytes_transferred"] <= 0.55 * raw, (got, raw)
    reference = load_drill(dict.fromkeys(range(4), save), 4, width=WIDTH)
    resharded = load_drill({0: a, 1: a, 2: b, 3: b}, 4, width=WIDTH)
    for kind in ("model", "optim"):
        assert resharded[kind].keys() == reference[kind].keys()
        for key, want in reference[kind].items():
            have = resharded[kind][key]
            assert type(have) is type(want), key
            if hasattr(want, "shape"):
                assert want.equal(have), key
            else:
                assert have == want, key
    assert resharded["loss"] == reference["loss"]
    assert resharded["loss_after"] == reference["loss_after"]
    # a rank pointed at the other survivor's share fails; it never loads holes as values
    with pytest.raises(DrillError) as failed:
        load_drill({0: b, 1: a, 2: b, 3: b}, 4, width=WIDTH)
    assert "RANK 0" in str(failed.value) or "rank 0" in str(failed.value).lower()
    # a partial copy is never pushed as a part of the step
    capsys.readouterr()
    assert ferry(["push", str(a), s3_url, "--job", "drill", "--step", "200", "--node", "x"]) == 1
    assert "is a partial copy (ranks [0, 1] of a world of 4" in capsys.readouterr().err


def test_a_survivors_share_costs_its_own_bytes_not_whole_chunks(
    drill: tuple[Path, list[Path]],
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At the default chunk size every rank file of the drill is one chunk, and each rank's
    share reaches into every file for the items every rank reads: cut every chunk_size
    bytes, a share of one rank of 8 fetched all 8 files. Cut at the items
    (engine/chunkspans.py), it fetches its own bytes and a few small items' groups."""
    save, nodes = drill
    push_parts(local_url, nodes)  # default 4 MiB chunks
    raw = sum(p.stat().st_size for p in save.iterdir() if p.suffix == ".distcp")
    for ranks in ("3", "6"):
        capsys.readouterr()
        dest = tmp_path / f"rank-{ranks}"
        args = ["pull", local_url, str(dest), "--job", "drill", "--step", str(STEP), "--json"]
        assert ferry([*args, "--world-size", "8", "--ranks", ranks]) == 0
        share = json.loads(capsys.readouterr().out)["share"]
        assert share["bytes"] <= share["chunk_bytes"] <= 1.15 * share["bytes"], share
        assert share["chunk_bytes"] < 0.2 * raw, (share, raw)


def test_agent_prefetches_a_share_then_completes_it_in_place(
    drill: tuple[Path, list[Path]], local_url: str, tmp_path: Path
) -> None:
    """POST /v1/prefetch with a layout: the survivor's agent fetches its share, reports it
    partial (never "holds the step"), answers a second ask from what it holds, and a later
    prefetch of the whole step completes the copy in place: byte-exact, then committed."""
    from agent.rpc.client import FerryClient, RpcError
    from tests.harness import TOKEN, agent

    save, nodes = drill
    asyncio.run(push_parts_small_chunks(local_url, nodes))
    hot = tmp_path / "hot"
    hot.mkdir()
    copy = hot / "drill" / f"step_{STEP:06d}"

    async def go() -> list[dict[str, Any]]:
        done = []
        async with agent(hot, [local_url], node="survivor") as url, FerryClient(url, TOKEN) as c:
            done.append(await c.estimate("drill", STEP, layout=(4, [0, 1])))
            for bad, status in (("abc", 400), ("4:9", 404)):  # not a layout; no such share
                params = {"job": "drill", "step": str(STEP), "layout": bad}
                with pytest.raises(RpcError) as refused:
                    await c._call("GET", "/v1/estimate", params=params)
                assert refused.value.status == status, refused.value
            # the same share in a prefetch is refused as it is asked for (it was 202, then
            # the prefetch failed when it ran)
            with pytest.raises(RpcError) as refused:
                await c.prefetch("drill", STEP, layout=(4, [1, 4]))
            assert refused.value.status == 404 and "4 is not a rank of a world of 4" in str(
                refused.value
            ), refused.value
            for layout in ((4, [0, 1]), (4, [1]), None):
                if layout is None:  # the whole step, what the share holds already kept
                    done.append(await c.estimate("drill", STEP))
                done.append(await c.wait_prefetch(await c.prefetch("drill", STEP, layout=layout)))
                if layout == (4, [1]):
                    done.append(await c.checkpoints())
        return done

    estimate, first, narrower, listed, rest, whole = asyncio.run(go())
    # the estimate of the rest counts what the partial copy holds as held (it counted the
    # whole step missing: 2.5x what the prefetch then moved, in a newcomer's trial)
    moved_rest = sum(whole["bytes_by_source"].values())
    assert abs(rest["bytes_missing"] - moved_rest) <= 0.25 * moved_rest, (rest, whole)
    raw = sum(p.stat().st_size for p in save.iterdir())
    # the estimate is the share's: its bytes, and the stored bytes of its chunks
    assert estimate["share"] == {"world_size": 4, "ranks": [0, 1], "bytes": estimate["bytes_total"]}
    assert estimate["bytes_total"] <= 0.55 * raw
    # (the restore reads through small gaps between the chunks it needs, in one request)
    moved = sum(first["bytes_by_source"].values())
    assert estimate["bytes_missing"] <= moved <= 1.1 * estimate["bytes_missing"], (estimate, moved)
    assert first["state"] == "ready" and first["satisfied_by"] == "restored", first
    assert first["layout"] == {"world_size": 4, "ranks": [0, 1]}
    assert sum(first["bytes_by_source"].values()) <= 0.55 * raw
    assert narrower["satisfied_by"] == "held" and sum(narrower["bytes_by_source"].values()) == 0
    assert whole["state"] == "ready" and whole["satisfied_by"] == "filled_in", whole
    assert tree_bytes(copy) == tree_bytes(save)  # the record is gone with the partial copy
    assert not (copy / ".ferry-share.json").exists()
    (entry,) = listed["jobs"]["drill"]
    assert entry["local"] is False  # a partial copy never holds the step
    assert entry["share"]["layout"] == {"world_size": 4, "ranks": [0, 1]}


def test_a_torn_step_never_lands_whole_and_a_leftover_never_leaks_into_a_share(
    drill: tuple[Path, list[Path]],
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every part in, one shard missing from the union (node 3 pushed without it): a pull
    of the step fails naming it, and nothing lands. And a share pull that adopts a killed
    restore's staging dir (here full of 0xAA) leaves zeros, not stale bytes, outside the
    share: a rank reading there must fail, not load what an earlier restore left."""
    from transfer.engine.catalog import Catalog, resolve_manifests
    from transfer.engine.dcpshare import Layout
    from transfer.engine.share import plan_share
    from transfer.engine.staging import STAGING_MARK

    save, nodes = drill
    torn = tmp_path / "node3"
    shutil.copytree(nodes[3], torn)
    (torn / "__7_0.distcp").unlink()
    push_parts(local_url, [*nodes[:3], torn])
    dest = tmp_path / "whole"
    capsys.readouterr()
    assert ferry(["pull", local_url, str(dest), "--job", "drill", "--step", str(STEP)]) == 1
    err = capsys.readouterr().err
    assert "drill step 100 is not whole: .metadata names __7_0.distcp" in err, err
    assert not dest.exists()

    whole_store = Path(init_test_store(str(tmp_path / "whole-store")))
    push_parts(str(whole_store), nodes)

    async def share_over_leftover() -> tuple[Any, Path]:
        store = open_test_store(str(whole_store))
        try:
            manifests = await resolve_manifests(store, "drill", STEP)
            share = await plan_share(Catalog(store), manifests, Layout(4, (0,)))
            into = tmp_path / "share"
            leftover = tmp_path / f".share{STAGING_MARK}0123abcd"
            leftover.mkdir()
            for f in (f for m in manifests for f in m.files):
                (leftover / f.path).write_bytes(b"\xaa" * f.size)
            await pull(store, into, PullPlan("drill", STEP, manifests=manifests, share=share))
            return share, into
        finally:
            await store.close()

    from transfer.engine import PullPlan, pull

    share, into = asyncio.run(share_over_leftover())
    for path in sorted(share.storage):
        if path not in share.ranges:
            assert not (into / path).exists(), path  # nothing of it is in the share
            continue
        data = bytearray((into / path).read_bytes())
        for lo, hi in share.ranges[path]:
            assert data[lo:hi] == (save / path).read_bytes()[lo:hi]
            data[lo:hi] = bytes(hi - lo)
        assert not any(data), f"{path}: bytes outside the share are not zero"
    # and they are holes, not written zeros: the copy takes about the share on disk
    on_disk = sum(p.stat().st_blocks * 512 for p in into.iterdir())
    assert on_disk <= 1.1 * share.nbytes + (64 << 10), (on_disk, share.nbytes)


def test_survivors_with_different_layouts_read_each_chunk_once_in_all(
    drill: tuple[Path, list[Path]],
    s3_env: Any,
    s3_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 survivors, 4 layouts (ranks 0, 1, 2, 3 of 4), one fan-out group: each chunk is
    owned by a member whose share needs it, so the group reads the union of its shares
    about once from S3 (pack bytes counted at a proxy in front of the real server), where
    each alone reads its own share and the items every rank reads are read four times."""
    from bench.fleet import CountingProxy

    _, nodes = drill
    asyncio.run(push_parts_small_chunks(s3_url, nodes))
    union = asyncio.run(_union_of_rank_shares(s3_url))
    proxy = CountingProxy(s3_env.url, s3_env.bucket)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # every S3 byte passes the proxy
    read = {}
    try:
        for tag, fanout in (("alone", False), ("fan", True)):
            tally = proxy.begin(s3_url.split("/", 3)[3])
            done = asyncio.run(_prefetch_ranks(tmp_path, s3_url, tag, fanout))
            assert all(d["state"] == "ready" and d["satisfied_by"] == "restored" for d in done)
            read[tag] = tally.bytes["data_down"] / union
    finally:
        proxy.stop()
    assert read["fan"] <= 1.1, read
    assert read["alone"] > read["fan"], read


async def _union_of_rank_shares(url: str) -> int:
    """Stored bytes of the chunks the shares of ranks 0..3 of 4 need, together."""
    from transfer.engine.catalog import Catalog, resolve_manifests
    from transfer.engine.chunkindex import ChunkIndex
    from transfer.engine.dcpshare import Layout
    from transfer.engine.pull import share_chunk_ids
    from transfer.engine.pullplan import merged_files
    from transfer.engine.share import plan_shares

    store = open_test_store(url)
    try:
        manifests = await resolve_manifests(store, "drill", STEP)
        index = ChunkIndex()
        for m in manifests:
            index.add_manifest(m)
        asks = {r: (Layout(4, (r,)), None) for r in range(4)}
        shares = await plan_shares(Catalog(store), manifests, asks)
        files = merged_files(manifests)
        ids = set().union(*(share_chunk_ids(files, s) for s in shares.values()))
        return sum(index[cid].stored for cid in ids)
    finally:
        await store.close()


async def _prefetch_ranks(tmp_path: Path, url: str, tag: str, fanout: bool) -> list[Any]:
    """4 agents prefetch rank r's share of 4 each, at once (one fan-out group, or not)."""
    import contextlib

    from agent.rpc.client import FerryClient
    from tests.harness import TOKEN, agent

    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for i in range(4):
            hot = tmp_path / f"{tag}-{i}" / "hot"
            urls.append(await stack.enter_async_context(agent(hot, [url], node=f"{tag}{i}")))
        clients = [await stack.enter_async_context(FerryClient(u, TOKEN)) for u in urls]
        layouts = {u: (4, [i]) for i, u in enumerate(urls)}
        group = {"fanout": None, "fanout_layouts": None}
        ids = []
        for c, u in zip(clients, urls, strict=True):
            if fanout:
                group = {"fanout": (urls, u), "fanout_layouts": layouts}
            ids.append(await c.prefetch("drill", STEP, layout=layouts[u], **group))  # type: ignore[arg-type]
        waits = (c.wait_prefetch(i, within_s=120) for c, i in zip(clients, ids, strict=True))
        return list(await asyncio.gather(*waits))


def test_every_nodes_agent_pushes_its_part_and_the_last_one_in_completes_the_step(
    drill: tuple[Path, list[Path]], local_url: str, tmp_path: Path
) -> None:
    """A node-local save on 4 nodes, one agent each (expected_nodes n0..n3): rank 0's node
    commits on .metadata, the others (commit_marker "") once their files are quiet; each
    pushes its part, and the step is complete (marker written) once all four are in and
    together hold every file .metadata names. A pull of it is the save, byte for byte."""
    import contextlib
    import time

    from tests.harness import agent
    from transfer.engine.catalog import is_complete

    save, nodes = drill
    expected = ("n0", "n1", "n2", "n3")

    async def go() -> bool:
        async with contextlib.AsyncExitStack() as stack:
            for k, node_dir in enumerate(nodes):
                hot = tmp_path / f"n{k}" / "hot"
                shutil.copytree(node_dir, hot / "drill" / f"step_{STEP:06d}")
                env = {"FERRY_EXPECTED_NODES": ",".join(expected)}
                marker = 'commit_marker = ""\n' if k else None  # (an empty variable is unset)
                await stack.enter_async_context(
                    agent(hot, [local_url], f"n{k}", extra_env=env, config_text=marker)
                )
            store = open_test_store(local_url)
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if await store.exists(f"complete/drill/{STEP:018d}.json"):
                        return await is_complete(store, "drill", STEP, ())  # by its marker
                    await asyncio.sleep(0.2)
                return False
            finally:
                await store.close()

    assert asyncio.run(go())
    whole = tmp_path / "whole"
    assert ferry(["pull", local_url, str(whole), "--job", "drill", "--step", str(STEP)]) == 0
    assert tree_bytes(whole) == tree_bytes(save)


def test_a_standby_replicates_its_share_before_the_decision(
    drill: tuple[Path, list[Path]], local_url: str, tmp_path: Path
) -> None:
    """PUT /v1/standby/{job} with the layout this node will run: each new durable step's
    share is copied here in the background (a partial copy), and the decision's prefetch of
    that share is ready at once, moving nothing."""
    import time

    from agent.rpc.client import FerryClient
    from tests.harness import TOKEN, agent

    _, nodes = drill
    asyncio.run(push_parts_small_chunks(local_url, nodes))
    hot = tmp_path / "hot"
    hot.mkdir()

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        fast = {"FERRY_STANDBY_POLL_SECONDS": "0.2"}
        async with (
            agent(hot, [local_url], "s", extra_env=fast) as url,
            FerryClient(url, TOKEN) as c,
        ):
            entry = await c.standby("drill", layout=(4, [2, 3]))
            assert entry["layout"] == {"world_size": 4, "ranks": [2, 3]}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                doc = await c._call("GET", "/v1/standby")
                (entry,) = doc["jobs"]
                if entry["replicated_step"] == STEP:
                    break
                await asyncio.sleep(0.2)
            decision = await c.wait_prefetch(await c.prefetch("drill", STEP, layout=(4, [2, 3])))
            return entry, decision

    entry, decision = asyncio.run(go())
    assert entry["replicated_step"] == STEP, entry
    assert entry["last_replication"]["layout"] == {"world_size": 4, "ranks": [2, 3]}
    assert decision["satisfied_by"] == "held", decision
    assert sum(decision["bytes_by_source"].values()) == 0
    assert (hot / "drill" / f"step_{STEP:06d}" / ".ferry-share.json").exists()


def test_survivors_load_their_shares_straight_from_the_store(
    drill: tuple[Path, list[Path]], s3_env: Any, s3_url: str, s3_proxy: FaultProxy
) -> None:
    """Four new ranks each ``dcp.load`` through FerryReader from the S3 store the four nodes
    pushed their parts to: no pull, no file written; the state equals a load of the whole
    save, each rank fetches the chunks of its own share, not the step, and the step's
    manifests are read once for the load (by the coordinator), not once per rank."""
    save, nodes = drill
    asyncio.run(push_parts_small_chunks(s3_url, nodes))
    raw = sum(p.stat().st_size for p in save.iterdir())
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL"] = s3_proxy.url  # (a counting forwarder: no faults)
    source = {"store": s3_url, "job": "drill", "step": STEP, "env": env}
    reference = load_drill(dict.fromkeys(range(4), save), 4, width=WIDTH)
    streamed = load_drill(dict.fromkeys(range(4), source), 4, width=WIDTH)
    asked = s3_proxy.stats.by_area
    assert asked["GET manifests"] == len(nodes), asked  # 4 x 4 when each rank read them
    assert asked["LIST"] + asked["GET ferry-store.json"] <= 3, asked  # the coordinator's alone
    # process_group=ALONE with dcp.load(no_dist=True): each rank reads for itself, the same
    asked.clear()
    alone = load_drill(dict.fromkeys(range(4), source | {"alone": True}), 4, width=WIDTH)
    for kind in ("model", "optim"):
        for key, want in streamed[kind].items():
            have = alone[kind][key]
            assert want.equal(have) if hasattr(want, "shape") else have == want, key
    assert asked["GET manifests"] == 4 * len(nodes), asked
    for kind in ("model", "optim"):
        assert streamed[kind].keys() == reference[kind].keys()
        for key, want in reference[kind].items():
            have = streamed[kind][key]
            assert want.equal(have) if hasattr(want, "shape") else have == want, key
    assert streamed["loss_after"] == reference["loss_after"]
    for rank, (covered, fetched) in streamed["restored"].items():
        # a quarter of the sharded items and the replicated ones, in whole 1 MiB chunks
        # (0.26-0.27 of the save each, measured)
        assert covered <= 0.35 * raw, (rank, covered, raw)
        assert 0 < fetched <= covered, (rank, fetched, covered)


def test_a_step_the_store_lacks_fails_every_rank_in_one_line(
    drill: tuple[Path, list[Path]], s3_env: Any, s3_url: str
) -> None:
    """Only the coordinator reads the store before DCP's first collective; when it cannot,
    every rank gets its error (none waits for a broadcast that never comes)."""
    _, nodes = drill
    asyncio.run(push_parts_small_chunks(s3_url, nodes[:1]))
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    source = {"store": s3_url, "job": "drill", "step": STEP + 1, "env": env}
    with pytest.raises(DrillError) as failed:
        load_drill(dict.fromkeys(range(2), source), 2, width=WIDTH)
    text = str(failed.value)
    for rank in range(2):
        assert f"rank {rank}:" in text, text
    assert text.count(f"no committed checkpoint for job 'drill' step {STEP + 1}") >= 2, text


def test_an_interrupt_on_the_coordinator_reaches_every_rank(
    drill: tuple[Path, list[Path]], s3_env: Any, s3_url: str
) -> None:
    """Whatever stops the coordinator's read (a KeyboardInterrupt here: DCP carries on to
    its gather after any BaseException), the other ranks hear of it and fail too: a first
    version broadcast only after an Exception, and rank 1 waited out the group's timeout."""
    _, nodes = drill
    asyncio.run(push_parts_small_chunks(s3_url, nodes[:1]))
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    source = {"store": s3_url, "job": "drill", "step": STEP, "env": env}
    source["interrupt_coordinator"] = True
    with pytest.raises(DrillError) as failed:
        load_drill(dict.fromkeys(range(2), source), 2, width=WIDTH)
    text = str(failed.value)
    assert "rank 1:" in text and "the coordinator (rank 0): KeyboardInterrupt: injected" in text
    assert "still running" not in text and "killed" not in text, text


@pytest.mark.parametrize("how", ["alone", "fan-out group", "examples/scale_down.py"])
def test_survivors_holding_their_parts_receive_only_their_shares_and_load_resharded(
    drill: tuple[Path, list[Path]],
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """The scale-down as it happens: 4 nodes' agents push their parts (the last one in
    writes the completion marker, with its file map), then the scheduler asks the two
    survivors, each still holding its own part, for the shares their new ranks read (world
    size 4): each receives what its share lacks, not the step (every other byte a hole,
    fewer bytes than the share pulled onto an empty node); its own files are untouched;
    the 4 new ranks load tensor-equal to a load of the whole save. Alone, as one fan-out
    group (the others may count on a member for chunks of its own part, which it serves
    from there), and as the scheduler example runs it (``--new-world-size 4``: estimates,
    pins, one fan-out group with every survivor's layout, COMMIT)."""
    import contextlib
    import time

    from agent.rpc.client import FerryClient
    from tests.harness import TOKEN, agent

    monkeypatch.setattr("agent.peers.fanout.WAIT_SECONDS", 120.0)
    grouped = how != "alone"

    save, nodes = drill
    expected = ("n0", "n1", "n2", "n3")
    survivors = {"n0": [0, 1], "n2": [2, 3]}

    async def go() -> dict[str, dict[str, Any]]:
        async with contextlib.AsyncExitStack() as stack:
            urls = {}
            for k in range(len(nodes)):
                env = {"FERRY_EXPECTED_NODES": ",".join(expected)}
                marker = 'commit_marker = ""\n' if k else None
                urls[f"n{k}"] = await stack.enter_async_context(
                    agent(hot(k), [local_url], f"n{k}", extra_env=env, config_text=marker)
                )
            store = open_test_store(local_url)
            try:
                deadline = time.monotonic() + 60
                while not await store.exists(f"complete/drill/{STEP:018d}.json"):
                    assert time.monotonic() < deadline, "the step was never completed"
                    await asyncio.sleep(0.2)
                # (the real save's step counters and param_groups: every rank's file holds
                # some, and the marker says where, so each survivor reads few parts)
                marker = json.loads(await store.get(f"complete/drill/{STEP:018d}.json"))
                # (7 of the 8 rank files hold some here)
                assert len(marker["common"]["files"]) > len(nodes), marker.get("common")
            finally:
                await store.close()
            clients = {
                node: await stack.enter_async_context(FerryClient(urls[node], TOKEN))
                for node in survivors
            }
            layouts = {urls[node]: (4, ranks) for node, ranks in survivors.items()}
            members = list(layouts)
            ids = {}
            if how == "examples/scale_down.py":
                ids = await scheduler_example([urls[n] for n in survivors], token)
                ids = dict(zip(survivors, ids.values(), strict=True))
            for node, ranks in survivors.items() if not ids else ():
                c = clients[node]
                estimates[node] = await c.estimate("drill", STEP, layout=(4, ranks))
                group: dict[str, Any] = {}
                if grouped:  # one fan-out group: each reads about half from the store
                    group = {"fanout": (members, urls[node]), "fanout_layouts": layouts}
                ids[node] = await c.prefetch("drill", STEP, layout=(4, ranks), **group)
            # (a member waiting on another for a chunk it never fetches would hold its
            # prefetch for WAIT_SECONDS, raised here past the wait below: a stall fails)
            waits = [clients[n].wait_prefetch(ids[n], within_s=60) for n in survivors]
            return dict(zip(survivors, await asyncio.gather(*waits), strict=True))

    def hot(k: int) -> Path:
        return tmp_path / f"n{k}" / "hot"

    copies = {}
    for k, node_dir in enumerate(nodes):  # each node's training wrote its part there
        copies[f"n{k}"] = hot(k) / "drill" / f"step_{STEP:06d}"
        shutil.copytree(node_dir, copies[f"n{k}"])
    written = {n: {p.name: p.stat().st_ino for p in copies[n].iterdir()} for n in survivors}
    estimates: dict[str, dict[str, Any]] = {}
    token = tmp_path / "token"
    token.write_text(TOKEN)
    done = asyncio.run(go())
    moved_by: dict[str, int] = {}
    for node, status in done.items():
        assert status["state"] == "ready" and status["satisfied_by"] == "filled_in", status
        after = {p.name: p.stat().st_ino for p in copies[node].iterdir()}
        assert all(after[name] == ino for name, ino in written[node].items()), node
        moved = sum(status["bytes_by_source"].values())
        moved_by[node] = moved
        # the estimate the scheduler asked first knew the node holds only its own part (in
        # a group a member also reads, and serves, chunks of the others' shares)
        if how != "examples/scale_down.py":
            assert estimates[node]["source"].startswith("tier:"), estimates[node]
        if not grouped:
            assert abs(estimates[node]["bytes_missing"] - moved) <= 0.25 * moved, estimates
        assert_only_the_share(copies[node], save, set(written[node]))
    reference = load_drill(dict.fromkeys(range(4), save), 4, width=WIDTH)
    a, b = copies["n0"], copies["n2"]
    resharded = load_drill({0: a, 1: a, 2: b, 3: b}, 4, width=WIDTH)
    for kind in ("model", "optim"):
        for key, want in reference[kind].items():
            have = resharded[kind][key]
            assert want.equal(have) if hasattr(want, "shape") else have == want, key
    assert resharded["loss_after"] == reference["loss_after"]
    # less than the same share pulled onto an empty node: its own part is reused
    for node, ranks in survivors.items() if not grouped else ():
        got = pull_share(local_url, tmp_path / f"cli-{node}", ",".join(map(str, ranks)), capsys)
        assert moved_by[node] < got["bytes_transferred"], (node, moved_by[node], got)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "scale_down.py"


async def scheduler_example(urls: list[str], token: Path) -> dict[str, str]:
    """``examples/scale_down.py --new-world-size 4`` against the survivors' agents (a
    subprocess, while this loop serves them); {agent URL: its prefetch's id}."""
    import sys

    args = ["--job", "drill", "--step", str(STEP), "--survivors", *urls]
    args += ["--token-file", str(token), "--new-world-size", "4", "--timeout", "60"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), *args, stdout=asyncio.subprocess.PIPE
    )
    out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0 and "COMMIT scale-down" in out, out
    assert "(ranks 0-1)" in out and "(ranks 2-3)" in out, out  # its estimates, per share
    line = next(x for x in out.splitlines() if x.startswith("prefetching: "))
    ids = dict(pair.rsplit("=", 1) for pair in line.removeprefix("prefetching: ").split(", "))
    return {url: ids[name] for url, name in zip(urls, ids, strict=True)}


def assert_only_the_share(copy: Path, save: Path, own: set[str]) -> None:
    """A partial copy (its record there) holding its own files whole and, of every other
    storage file, the bytes of the ranges its record names: everything else is a hole."""
    from transfer.engine.share import read_record

    record = read_record(copy)
    assert record is not None and isinstance(record["ranges"], dict), record
    for path in sorted(p.name for p in copy.iterdir() if p.name.endswith(".distcp")):
        have, want = (copy / path).read_bytes(), (save / path).read_bytes()
        if path in own:
            assert have == want and record["ranges"][path] == [[0, len(want)]], path
            continue
        pos = 0
        for lo, hi in record["ranges"].get(path, []):
            assert have[lo:hi] == want[lo:hi] and not any(have[pos:lo]), path
            pos = hi
        assert not any(have[pos:]), path


def test_ranks_load_a_resharded_step_from_local_files_with_local_reader(
    drill: tuple[Path, list[Path]],
) -> None:
    """Three new ranks (the save's 8 shards split unevenly: each new rank narrows old
    rows) load the save through LocalReader: the state, the loss and the step after it
    equal torch's own reader's, bit for bit."""
    save, _ = drill
    want = load_drill(dict.fromkeys(range(3), save), 3, width=WIDTH)
    got = load_drill(dict.fromkeys(range(3), save), 3, width=WIDTH, reader="local")
    assert got["local_shapes"] == want["local_shapes"]
    assert {shape[0] for shape in got["local_shapes"][0].values()} >= {171}  # 512 rows / 3
    for kind in ("model", "optim"):
        assert got[kind].keys() == want[kind].keys()
        for key, value in want[kind].items():
            have = got[kind][key]
            assert value.equal(have) if hasattr(value, "shape") else have == value, key
    assert (got["loss"], got["loss_after"]) == (want["loss"], want["loss_after"])
