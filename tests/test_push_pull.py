"""Byte-exact round trips through real stores, dedupe, concurrency and the commit protocol."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.cli.run import main as ferry
from tests.conftest import (
    adamw_series,
    make_checkpoint,
    open_test_store,
    random_bytes,
    store_objects,
    tree_bytes,
    tree_modes,
    write_file,
)
from tests.harness import WatchingStore
from transfer.engine import PullPlan, PushPlan, TransferOptions, pull, push
from transfer.engine.chunkindex import StoredChunk
from transfer.format.layout import MANIFESTS_PREFIX, PACKS_PREFIX
from transfer.store.base import PartReceipt

SMALL = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]


def ferry_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    code = ferry([*argv, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one JSON object"
    return json.loads(lines[0])  # type: ignore[no-any-return]


def test_round_trip_is_byte_exact_and_keeps_modes(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "ck" / "step_000120", shard_bytes=12_500_000)
    os.chmod(src / ".metadata", 0o600)
    pushed = ferry_json(
        capsys, "push", str(src), store_url, "--job", "llama", "--node", "n0", *SMALL
    )
    assert pushed["step"] == 120  # from the directory name
    assert pushed["files"] == 5
    assert pushed["bytes_raw"] == sum(len(b) for b in tree_bytes(src).values())
    assert 0 < pushed["bytes_transferred"] <= pushed["bytes_raw"] * 1.01 + 4096
    assert pushed["packs"] >= 2  # 19 MB of random data in 10 MiB packs

    dest = tmp_path / "restored"
    pulled = ferry_json(capsys, "pull", store_url, str(dest), "--job", "llama", *SMALL)
    assert pulled["step"] == 120
    assert tree_bytes(dest) == tree_bytes(src)
    assert tree_modes(dest) == tree_modes(src)
    assert (dest / "extra" / "empty.bin").stat().st_size == 0
    assert not [p for p in dest.parent.iterdir() if "staging" in p.name]


def test_repush_of_unchanged_checkpoint_writes_no_chunk(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000001")
    ferry_json(capsys, "push", str(src), store_url, "--job", "j", "--node", "n", *SMALL)
    packs_before = [k for k in store_objects(store_url) if k.startswith(PACKS_PREFIX)]

    again = ferry_json(capsys, "push", str(src), store_url, "--job", "j", "--node", "n", *SMALL)
    assert again["already_committed"] is True
    assert again["bytes_transferred"] == 0

    shutil.copytree(src, tmp_path / "step_000002")
    nxt = ferry_json(
        capsys,
        "push",
        str(tmp_path / "step_000002"),
        store_url,
        "--job",
        "j",
        "--node",
        "n",
        *SMALL,
    )
    assert nxt["chunks_new"] == 0 and nxt["chunks_deduped"] == nxt["chunks_total"] > 0
    manifest_size = nxt["bytes_transferred"]
    assert 0 < manifest_size < 10_000  # only the manifest was written
    assert [k for k in store_objects(store_url) if k.startswith(PACKS_PREFIX)] == packs_before


def test_changed_file_is_pushed_and_pulled_as_new_version(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = make_checkpoint(tmp_path / "step_000010", shard_bytes=4_000_000)
    ferry_json(capsys, "push", str(v1), store_url, "--job", "j", "--node", "n", *SMALL)
    v2 = tmp_path / "step_000020"
    shutil.copytree(v1, v2)
    with open(v2 / "__0_0.distcp", "r+b") as fh:  # change one byte in the second MiB
        fh.seek(1_500_000)
        fh.write(b"\xff" if fh.read(1) != b"\xff" else b"\x00")
    r = ferry_json(capsys, "push", str(v2), store_url, "--job", "j", "--node", "n", *SMALL)
    assert r["chunks_new"] == 1  # only the 1 MiB chunk that changed
    assert r["bytes_transferred"] < 1.2 * (1 << 20) + 10_000

    o1 = ferry_json(capsys, "pull", store_url, str(tmp_path / "o1"), "--job", "j", "--step", "10")
    ferry_json(capsys, "pull", store_url, str(tmp_path / "o2"), "--job", "j", "--step", "latest")
    # what it wrote and how long the disk was busy with it (the estimate's disk rate)
    assert o1["bytes_written"] == o1["bytes_raw"] and o1["write_busy_seconds"] > 0
    assert tree_bytes(tmp_path / "o1") == tree_bytes(v1)
    assert tree_bytes(tmp_path / "o2") == tree_bytes(v2)


def test_many_small_files_and_nested_dirs_cost_few_requests(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "step_000005"
    rng = random.Random(5)
    for i in range(300):
        write_file(
            src / f"d{i % 7}" / f"sub{i % 3}" / f"f{i}.bin", rng.randbytes(rng.randrange(0, 5000))
        )
    r = ferry_json(capsys, "push", str(src), store_url, "--job", "small", "--node", "n")
    assert r["files"] == 300
    packs = [k for k in store_objects(store_url) if k.startswith(PACKS_PREFIX)]
    assert len(packs) == 1, "small chunks are packed, not stored one object each"
    ferry_json(capsys, "pull", store_url, str(tmp_path / "out"), "--job", "small")
    assert tree_bytes(tmp_path / "out") == tree_bytes(src)


def test_multi_node_parts_merge_on_pull(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_file(
        tmp_path / "a" / "step_000300" / "__0_0.distcp", random_bytes(2_000_000, 1)
    ).parent
    write_file(a / ".metadata", b"same metadata")
    b = write_file(
        tmp_path / "b" / "step_000300" / "__1_0.distcp", random_bytes(2_000_000, 2)
    ).parent
    write_file(b / ".metadata", b"same metadata")
    ferry_json(capsys, "push", str(a), store_url, "--job", "mn", "--node", "node-a")
    ferry_json(capsys, "push", str(b), store_url, "--job", "mn", "--node", "node-b")

    both = ferry_json(capsys, "pull", store_url, str(tmp_path / "all"), "--job", "mn")
    assert sorted(both["nodes"]) == ["node-a", "node-b"]
    assert sorted(tree_bytes(tmp_path / "all")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    only_b = ferry_json(
        capsys, "pull", store_url, str(tmp_path / "b-only"), "--job", "mn", "--node", "node-b"
    )
    assert only_b["nodes"] == ["node-b"]
    assert tree_bytes(tmp_path / "b-only") == tree_bytes(b)


def test_concurrent_pushes_of_two_checkpoints(store_url: str, tmp_path: Path) -> None:
    one = make_checkpoint(tmp_path / "one", seed=1, shard_bytes=6_000_000)
    two = make_checkpoint(tmp_path / "two", seed=2, shard_bytes=6_000_000)
    opts = TransferOptions(chunk_size=1 << 20, part_size=5 << 20, pack_size=10 << 20, window=4)

    async def go() -> None:
        store = open_test_store(store_url)
        try:
            await asyncio.gather(
                push(store, one, job="c", step=1, node="n", options=opts),
                push(store, two, job="c", step=2, node="n", options=opts),
            )
            await pull(store, tmp_path / "p1", PullPlan("c", 1), options=opts)
            await pull(store, tmp_path / "p2", PullPlan("c", 2), options=opts)
        finally:
            await store.close()

    asyncio.run(go())
    assert tree_bytes(tmp_path / "p1") == tree_bytes(one)
    assert tree_bytes(tmp_path / "p2") == tree_bytes(two)


def test_manifest_is_never_visible_before_its_chunks(store_url: str, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "ck", shard_bytes=20_000_000)
    opts = TransferOptions(chunk_size=1 << 20, part_size=5 << 20, pack_size=10 << 20, window=3)

    async def go() -> WatchingStore:
        store = WatchingStore(open_test_store(store_url))
        try:
            await push(store, src, job="w", step=1, node="n", options=opts)
        finally:
            await store.close()
        return store

    store = asyncio.run(go())
    assert store.parts >= 4
    assert all(seen == [] for seen in store.manifests_seen_during_data)
    assert any(k.startswith(MANIFESTS_PREFIX) for k in store_objects(store_url))


def test_interrupted_push_leaves_no_manifest_and_no_partial_pack(
    store_url: str, tmp_path: Path
) -> None:
    src = make_checkpoint(tmp_path / "ck", shard_bytes=20_000_000)
    opts = TransferOptions(chunk_size=1 << 20, part_size=5 << 20, pack_size=10 << 20, window=2)

    async def go() -> None:
        store = WatchingStore(open_test_store(store_url), die_after_parts=3)
        try:
            await push(store, src, job="w", step=1, node="n", options=opts)
        finally:
            await store.close()

    with pytest.raises(ConnectionError, match="simulated network failure"):
        asyncio.run(go())
    keys = store_objects(store_url)
    assert not [k for k in keys if k.startswith(MANIFESTS_PREFIX)]
    assert not [k for k in keys if k.startswith(PACKS_PREFIX)], "a failed push cleans its packs"


def test_file_shared_by_nodes_is_read_through_its_own_manifests_packs(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # node-b's copy of zzz.shared dedupes into node-a's pack, so the two manifests index
    # their pack lists differently; the merge must resolve each file against its owner.
    shared = random_bytes(1_500_000, 9)
    a = tmp_path / "a" / "step_000001"
    write_file(a / "a0.bin", random_bytes(1_200_000, 1))
    write_file(a / "zzz.shared", shared)
    b = tmp_path / "b" / "step_000001"
    write_file(b / "b1.bin", random_bytes(1_300_000, 2))
    write_file(b / "zzz.shared", shared)
    ferry_json(capsys, "push", str(a), store_url, "--job", "sh", "--node", "node-a")
    ferry_json(capsys, "push", str(b), store_url, "--job", "sh", "--node", "node-b")
    ferry_json(capsys, "pull", store_url, str(tmp_path / "all"), "--job", "sh")
    assert tree_bytes(tmp_path / "all") == {**tree_bytes(a), **tree_bytes(b)}


def test_truncated_pack_is_reported_by_verify(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000003")
    ferry_json(capsys, "push", str(src), store_url, "--job", "t", "--node", "n")

    async def truncate() -> None:
        store = open_test_store(store_url)
        try:
            key = next(o.key for o in await store.list(PACKS_PREFIX))
            data = await store.get(key)
            await store.put(key, data[: len(data) // 2])
        finally:
            await store.close()

    asyncio.run(truncate())
    code = ferry(["verify", store_url, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and not doc["ok"]
    assert any("truncated" in b["reason"] for b in doc["bad_chunks"])


class MemoryResumeLog:
    """A resume log (transfer.engine.ResumeLog) in memory, as a caller would journal it."""

    def __init__(self) -> None:
        self.packs: list[StoredChunk] = []
        self.receipts: dict[str, list[PartReceipt]] = {}

    def chunks(self) -> list[StoredChunk]:
        return list(self.packs)

    def parts(self) -> dict[str, list[PartReceipt]]:
        return {pack_id: list(r) for pack_id, r in self.receipts.items()}

    def pack_durable(self, chunks: list[StoredChunk]) -> None:
        self.packs.extend(chunks)

    def part_sent(self, pack_id: str, receipt: PartReceipt) -> None:
        self.receipts.setdefault(pack_id, []).append(receipt)


def test_an_interrupted_push_resumes_from_its_journaled_packs(
    store_url: str, tmp_path: Path
) -> None:
    src = make_checkpoint(tmp_path / "ck", shard_bytes=30_000_000)
    opts = TransferOptions(chunk_size=1 << 20, part_size=5 << 20, pack_size=5 << 20, window=2)
    log = MemoryResumeLog()

    async def attempt(die_after: int | None) -> object:
        store = WatchingStore(open_test_store(store_url), die_after_parts=die_after)
        try:
            return await push(
                store, src, job="r", step=1, node="n", options=opts, plan=PushPlan(resume=log)
            )
        finally:
            await store.close()

    with pytest.raises(ConnectionError):
        asyncio.run(attempt(die_after=4))
    assert log.packs, "some packs became durable before the failure"
    assert not [k for k in store_objects(store_url) if k.startswith(MANIFESTS_PREFIX)]
    reused = sum(c.size for c in {c.id: c for c in log.packs}.values())
    raw = sum(len(b) for b in tree_bytes(src).values())
    stored_before = len({c.id for c in log.packs})
    resumed = asyncio.run(attempt(die_after=None))
    # what the interrupted attempt stored is said to be that, not deduplicated (it was):
    # the resumed push deduplicates what an uninterrupted push of the same files does
    assert resumed.chunks_resumed == stored_before  # type: ignore[attr-defined]

    async def uninterrupted() -> Any:
        store = open_test_store(store_url)
        try:
            return await push(store, src, job="whole", step=1, node="n", options=opts)
        finally:
            await store.close()

    assert resumed.chunks_deduped == asyncio.run(uninterrupted()).chunks_deduped  # type: ignore[attr-defined]
    assert resumed.bytes_transferred < raw - reused + (1 << 20)  # type: ignore[attr-defined]

    async def restore() -> None:
        store = open_test_store(store_url)
        try:
            await pull(store, tmp_path / "out", PullPlan("r", 1), options=opts)
        finally:
            await store.close()

    asyncio.run(restore())
    assert tree_bytes(tmp_path / "out") == tree_bytes(src)


def test_two_pushes_of_one_part_at_once_store_it_once(local_url: str, tmp_path: Path) -> None:
    """Issue 13: two concurrent pushes of the same step both uploaded everything (2x the
    bytes, half unreferenced). The second now waits on the first's lease, then finds the
    part committed and uploads nothing."""
    import socket
    import subprocess
    import sys
    import time

    src = tmp_path / "step_000005"
    write_file(src / "__0_0.distcp", random_bytes(24_000_000, 5))
    write_file(src / ".metadata", b"meta")
    cmd = [sys.executable, "-m", "agent", "push", str(src), local_url, "--job", "j",
           "--node", "n", "--chunk-size-mib", "1", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    # a third push (this test) holds the lease while both start: each must wait for it
    lease = Path(local_url) / "locks/push/j/000000000000000005/n.json"
    lease.parent.mkdir(parents=True)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "expires_at": time.time() + 60}
    lease.write_text(json.dumps(holder))
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    time.sleep(4)  # both start (~1 s) and find the lease taken
    assert [p.poll() for p in procs] == [None, None]
    lease.unlink()
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    docs = [json.loads(out) for out, _ in results]
    assert sorted(d["already_committed"] for d in docs) == [False, True]
    assert min(d["bytes_transferred"] for d in docs) == 0
    assert all("waiting for it" in err for _, err in results)
    stored = sum(p.stat().st_size for p in Path(local_url).rglob("*.pack"))
    assert stored < 25_000_000  # one copy (random data: ~raw size), not two
    assert not list(Path(local_url).glob("locks/push/**/*.json"))  # released


def test_breaking_a_dead_push_lease_logs_who_held_it_readably(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29 (g): the log printed a Python dict ("breaking the push lease of {'host':
    ..."). It says "holder T on host H pid P" and why the lease was broken."""
    import logging
    import socket
    import subprocess
    import sys
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process of this host that is gone: its lease is broken at once
    src = make_checkpoint(tmp_path / "step_000003")
    lease = Path(local_url) / "locks/push/j/000000000000000003/n.json"
    lease.parent.mkdir(parents=True)
    host = socket.gethostname()
    holder = {"host": host, "pid": dead.pid, "token": "9f3c", "expires_at": time.time() + 60}
    lease.write_text(json.dumps(holder))

    async def go() -> None:
        store = open_test_store(local_url)
        try:
            await push(store, src, job="j", step=3, node="n")
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, logger="transfer.engine.pushlease"):
        asyncio.run(go())
    (line,) = [r.getMessage() for r in caplog.records if "breaking" in r.getMessage()]
    assert line == (
        "breaking the push lease locks/push/j/000000000000000003/n.json of holder 9f3c on host "
        f"{host} pid {dead.pid} (its process is gone)"
    )
    assert "{" not in line and not lease.exists()


def test_verify_counts_a_steps_delta_bases_apart(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ferry verify` of a delta-coded step also reads the earlier step's chunks its deltas
    decode against: its count says how many of the chunks read are those (a newcomer read
    "85 chunks" of a 70-chunk step as wrong)."""
    k, k1 = adamw_series(tmp_path / "hot", 2)
    for d in (k, k1):
        args = ["push", str(d), local_url, "--job", "j", "--node", "n", "--chunk-size-mib", "1"]
        assert ferry(args) == 0
    capsys.readouterr()
    assert ferry(["verify", local_url, "--job", "j", "--step", "40", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    own = {c.id for c in asyncio.run(_manifest_chunks(local_url, 40))}
    assert one["base_chunks"] > 0 and one["chunks"] == len(own) + one["base_chunks"], one
    assert ferry(["verify", local_url, "--job", "j", "--step", "40"]) == 0
    assert f"({one['base_chunks']} of them earlier steps' bases)" in capsys.readouterr().out
    assert ferry(["verify", local_url, "--job", "j", "--json"]) == 0  # both steps: no base
    assert json.loads(capsys.readouterr().out)["base_chunks"] == 0  # is outside what is read


async def _manifest_chunks(url: str, step: int) -> list[StoredChunk]:
    from transfer.engine.catalog import load_manifest

    store = open_test_store(url)
    try:
        m = await load_manifest(store, "j", step, "n")
        return [StoredChunk(c.id, c.size, c.enc, m.packs[c.pack], c.offset, c.stored)
                for f in m.files for c in f.chunks]  # fmt: skip
    finally:
        await store.close()
