"""Crash trials: SIGKILL a ``ferry agent`` in the middle of a background push or a prefetch,
and a ``ferry push`` CLI process, at seeded random moments; then restart / re-run and check:
no torn checkpoint is ever visible, every committed checkpoint verifies, the interrupted work
resumes, orphaned multipart uploads get aborted, and how many bytes were sent twice.

The moment is a random fraction of the bytes the operation moves, observed at the real S3
proxy in front of the store (tests/faultproxy.py, no faults here), so trials do not depend on
machine speed. CI runs FERRY_CRASH_TRIALS (default 3) per operation; the full count is
``FERRY_CRASH_TRIALS=20 python -m pytest -s tests/test_crash_trials.py`` (see
docs/RELIABILITY.md), which prints the figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tree_bytes
from tests.faultproxy import FaultProxy
from tests.harness import REPO, Node, assert_same_tree, make_node, rpc, running, save
from transfer.engine import list_checkpoints, push, verify
from transfer.format.layout import PACKS_PREFIX
from transfer.options import TransferOptions
from transfer.store import StoreOptions, open_store

TRIALS = int(os.environ.get("FERRY_CRASH_TRIALS", "3"))
SEED = int(os.environ.get("FERRY_CRASH_SEED", "2026"))
JOB = "llm"
MiB = 1 << 20
SHARDS = (36 * MiB, 30 * MiB, 24 * MiB)  # 90 MiB a checkpoint, far more than is in flight
WINDOW = 4  # parts in flight: the most a kill can waste is about this many parts + one pack
SIZES = {
    "FERRY_TRANSFER_CHUNK_SIZE_MIB": "1",
    "FERRY_TRANSFER_PART_SIZE_MIB": "5",
    "FERRY_TRANSFER_PACK_SIZE_MIB": "10",
    "FERRY_TRANSFER_WINDOW": str(WINDOW),
}
CLI_SIZES = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]
# md5: part checksums SeaweedFS's ListParts returns (ETags), so resumes salvage unfinished packs
CLI_CHECKSUM = os.environ.get("FERRY_CRASH_CHECKSUM", "crc32")
# a kill can waste what is in flight (window parts) plus the parts of packs not yet complete
WASTE_BOUND = (WINDOW + 2) * 5 * MiB + 10 * MiB


@dataclass
class Figures:
    operation: str
    sent_before: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    finished_before_kill: int = 0

    def add(self, before: int, after: int, needed: int) -> None:
        self.sent_before.append(before)
        self.resent.append(max(0, before + after - needed))

    def report(self) -> str:
        done, again = sum(self.sent_before), sum(self.resent)
        ratio = again / done if done else 0.0
        worst = max(self.resent, default=0)
        return (
            f"crash trials [{self.operation}]: {len(self.sent_before)} killed mid-way "
            f"(+{self.finished_before_kill} finished first), {done / MiB:.0f} MiB sent before "
            f"the kills, {again / MiB:.1f} MiB of it sent again after resuming = "
            f"{100 * ratio:.1f}% (worst trial {worst / MiB:.1f} MiB)"
        )


def write_checkpoint(root: Path, seed: int) -> Path:
    """Incompressible shards (so bytes stored = bytes raw), ``.metadata`` last."""
    rng = np.random.default_rng(seed)
    return save(root, {f"__{r}_0.distcp": rng.bytes(n) for r, n in enumerate(SHARDS)})


def wait_for(predicate: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def store_call(url: str, fn):  # type: ignore[no-untyped-def]
    """Run ``fn(store)`` against the store directly (not through the proxy)."""

    async def go():  # type: ignore[no-untyped-def]
        store = open_store(url, StoreOptions())
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


def committed(url: str) -> set[int]:
    return {c.step for c in store_call(url, lambda s: list_checkpoints(s, JOB))}


def pending_uploads(url: str) -> list[str]:
    return [u.key for u in store_call(url, lambda s: s.list_uploads(PACKS_PREFIX))]


def assert_all_verify(url: str, steps: set[int]) -> None:
    """Exactly ``steps`` are committed, and every byte of them verifies."""
    assert committed(url) == steps
    if steps:
        result = store_call(url, lambda s: verify(s, job=JOB))
        assert result.ok, result.bad


def kill_at(
    proxy: FaultProxy,
    rng: random.Random,
    done: Callable[[], bool],
    kill: Callable[[], None],
    *,
    upload: bool = True,
) -> tuple[bool, int]:
    """SIGKILL once a random fraction of the checkpoint's bytes has passed the proxy (sent
    towards the store for an upload, else received from it), or not at all if the operation
    finishes first. Returns (killed, bytes sent towards the store before the kill)."""
    stats = proxy.stats

    def moved() -> int:
        return stats.bytes_up if upload else stats.bytes_down

    up, start = stats.bytes_up, moved()
    target = rng.uniform(0.05, 0.95) * sum(SHARDS)
    wait_for(lambda: done() or moved() - start >= target, 120, "the operation to progress")
    if done():
        return False, stats.bytes_up - up
    kill()
    time.sleep(0.2)  # the proxy finishes reading what was already on the wire
    return True, stats.bytes_up - up


def sigkill(node: Node) -> None:
    assert node.proc is not None
    node.proc.send_signal(signal.SIGKILL)
    assert node.proc.wait(10) == -signal.SIGKILL


def test_agent_sigkilled_mid_push(s3_url: str, s3_proxy: FaultProxy, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    # the start-up sweep of orphaned uploads keeps its default age guard (1 h): the resumed
    # push must itself salvage or abort every upload the killed one had begun
    node = make_node(tmp_path, "a", [s3_url], FERRY_ENDPOINT_URL=s3_proxy.url, **SIZES)
    figures = Figures("agent push")
    steps: set[int] = set()
    with running(node):
        for trial in range(TRIALS):
            step = 10 * (trial + 1)
            start = s3_proxy.stats.bytes_up
            src = write_checkpoint(node.hot / JOB / f"step_{step:06d}", SEED + trial)
            killed, before = kill_at(
                s3_proxy, rng, lambda s=step: s in committed(s3_url), lambda: sigkill(node)
            )
            if killed:
                # nothing torn: the step is either fully committed or not visible at all
                assert_all_verify(s3_url, steps | ({step} & committed(s3_url)))
                node.start()  # same state dir: the journal resumes the push
            else:
                figures.finished_before_kill += 1
            node.wait_durable(JOB, step, within=120)
            steps.add(step)
            if killed:
                figures.add(before, s3_proxy.stats.bytes_up - start - before, sum(SHARDS))
                assert figures.resent[-1] <= WASTE_BOUND, figures.report()
            assert pending_uploads(s3_url) == [], "the resumed push left no upload pending"
            for f in src.iterdir():  # keep the disk small; the store has it now
                f.unlink()
    assert_all_verify(s3_url, steps)
    print("\n" + figures.report())


def test_cli_push_sigkilled_then_rerun_resumes(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(SEED + 1)
    figures = Figures(f"cli push, --checksum {CLI_CHECKSUM}")
    steps: set[int] = set()
    for trial in range(TRIALS):
        step = 10 * (trial + 1)
        src = write_checkpoint(tmp_path / f"step_{step:06d}", SEED + 100 + trial)
        cmd = [sys.executable, "-m", "agent", "push", str(src), s3_url, "--job", JOB,
               "--node", "n", "--endpoint-url", s3_proxy.url, "--window", str(WINDOW),
               "--checksum", CLI_CHECKSUM, *CLI_SIZES]  # fmt: skip
        start = s3_proxy.stats.bytes_up
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            killed, before = kill_at(s3_proxy, rng, lambda p=proc: p.poll() is not None, proc.kill)
        finally:
            proc.wait(30)
        if killed:
            assert proc.returncode == -signal.SIGKILL
            assert step not in committed(s3_url), "killed before its commit: nothing visible"
            assert_all_verify(s3_url, steps)
            # run again: it resumes from its log (agent/node/journal.py) of the packs made durable
            rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
            assert rerun.returncode == 0, rerun.stderr
            figures.add(before, s3_proxy.stats.bytes_up - start - before, sum(SHARDS))
            assert figures.resent[-1] <= WASTE_BOUND, figures.report()
        else:
            assert proc.returncode == 0
            figures.finished_before_kill += 1
        assert pending_uploads(s3_url) == [], "the rerun salvaged or aborted every upload"
        steps.add(step)
        for f in src.iterdir():
            f.unlink()
    assert_all_verify(s3_url, steps)
    assert not list((tmp_path / "xdg-state").rglob("*.sqlite3*")), "logs go once committed"
    print("\n" + figures.report())

    # a push killed and never run again leaves uploads pending: the agent's start-up sweep
    # aborts them
    src = write_checkpoint(tmp_path / "step_000999", SEED)
    cmd = [sys.executable, "-m", "agent", "push", str(src), s3_url, "--job", JOB,
           "--endpoint-url", s3_proxy.url, *CLI_SIZES]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or pending_uploads(s3_url) != [], 60, "uploads")
        proc.kill()
    finally:
        proc.wait(30)
    assert pending_uploads(s3_url), "the abandoned push left uploads pending"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.url)
    node = make_node(tmp_path, "sweeper", [s3_url], FERRY_ORPHAN_UPLOAD_SECONDS="0.001")
    with running(node):
        wait_for(lambda: pending_uploads(s3_url) == [], 30, "the orphaned uploads to go")


def test_agent_sigkilled_mid_prefetch(s3_url: str, s3_proxy: FaultProxy, tmp_path: Path) -> None:
    rng = random.Random(SEED + 2)
    src = write_checkpoint(tmp_path / "src" / f"step_{10:06d}", SEED + 200)
    options = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB)
    store_call(s3_url, lambda s: push(s, src, job=JOB, step=10, node="a", options=options))
    node = make_node(tmp_path, "b", [s3_url], FERRY_ENDPOINT_URL=s3_proxy.url, **SIZES)
    dest = node.hot / JOB / "step_000010"
    interrupted = resumed = 0
    with running(node):
        for _ in range(TRIALS):
            pid = rpc(node.url, "prefetch", JOB, 10)
            killed, _ = kill_at(
                s3_proxy,
                rng,
                lambda p=pid: (
                    rpc(node.url, "prefetch_status", p)["state"] != "running"
                    and rpc(node.url, "prefetch_status", p)["state"] != "queued"
                ),
                lambda: sigkill(node),
                upload=False,
            )
            interrupted += killed
            if killed:
                assert not dest.exists(), "a killed prefetch never leaves a partial checkpoint"
                node.start()  # keeps the staging directory the kill left, to resume from
                left = [p.name for p in dest.parent.iterdir()]
                assert len(left) <= 1 and all(".ferry-staging-" in n for n in left), left
                status = rpc(node.url, "prefetch_and_wait", JOB, 10, within_s=120)
                assert status["state"] == "ready", status
                resumed += status["chunks_resumed"]
            else:
                assert rpc(node.url, "prefetch_status", pid)["state"] == "ready"
            beside = [p.name for p in dest.parent.iterdir() if p != dest]
            assert beside in ([], [".step_000010.ferry-unsynced"]), beside  # (settle.py's)
            assert tree_bytes(dest) == tree_bytes(src)
            shutil.rmtree(dest)  # next trial starts cold again
        status = rpc(node.url, "prefetch_and_wait", JOB, 10, within_s=120)
        assert status["state"] == "ready", status
        assert_same_tree(dest, src)
    # what a killed prefetch had written was kept, checked in place, and not fetched again
    assert resumed > 0 or not interrupted, (resumed, interrupted)
    print(f"\ncrash trials [agent prefetch]: {interrupted} of {TRIALS} killed mid-way, "
          f"{resumed} chunks resumed")  # fmt: skip


def test_cli_pull_sigkilled_then_rerun_resumes(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """A killed ``ferry pull`` leaves its staging directory; the same pull run again keeps
    what is there and verified, fetches only the rest, and leaves nothing beside the dest."""
    rng = random.Random(SEED + 3)
    src = write_checkpoint(tmp_path / "src" / f"step_{10:06d}", SEED + 300)
    options = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB)
    store_call(s3_url, lambda s: push(s, src, job=JOB, step=10, node="a", options=options))
    interrupted = resumed = 0
    for trial in range(TRIALS):
        dest = tmp_path / f"restore-{trial}" / "step_000010"
        cmd = [sys.executable, "-m", "agent", "pull", s3_url, str(dest), "--job", JOB,
               "--step", "10", "--endpoint-url", s3_proxy.url, "--json", *CLI_SIZES]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            killed, _ = kill_at(
                s3_proxy, rng, lambda p=proc: p.poll() is not None, proc.kill, upload=False
            )
        finally:
            proc.wait(30)
        interrupted += killed
        if killed:
            assert not dest.exists()
            rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
            assert rerun.returncode == 0, rerun.stderr
            result = json.loads(rerun.stdout)
            resumed += result["chunks_resumed"]
            fetched = result["bytes_transferred"]
            assert fetched <= sum(SHARDS) - result["chunks_resumed"] * MiB + 2 * MiB, result
        assert tree_bytes(dest) == tree_bytes(src)
        beside = sorted(p.name for p in dest.parent.iterdir() if p != dest)
        assert beside in ([], [".step_000010.ferry-unsynced"]), beside  # (settle.py's)
    assert resumed > 0 or not interrupted, (resumed, interrupted)
    print(f"\ncrash trials [cli pull]: {interrupted} of {TRIALS} killed, {resumed} resumed")


@pytest.mark.parametrize("checksum", ["md5", "crc32"])
def test_salvage_keeps_the_leading_parts_of_an_abandoned_upload(s3_url: str, checksum: str) -> None:
    """Parts 1 and 3 landed (2 was in flight at the kill): the object becomes part 1. With
    CRC32 part checksums that needs a server whose ListParts returns them (AWS does;
    SeaweedFS 4 does not): otherwise the upload is aborted, never left pending."""
    from transfer.store.s3 import S3Store
    from transfer.store.s3config import S3Settings

    part = 5 * MiB
    data = np.random.default_rng(1).bytes(3 * part)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)

    async def go() -> None:
        settings = S3Settings(bucket, endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        store = S3Store(settings, prefix, checksum=checksum)
        upload = await store.begin_upload("packs/ab/abandoned.pack")
        await upload.write_part(1, 0, data[:part])
        await upload.write_part(3, 2 * part, data[2 * part :])
        kept = await store.salvage_upload("packs/ab/abandoned.pack")
        if checksum == "md5" or kept is not None:
            assert kept == part
            assert await store.get("packs/ab/abandoned.pack") == data[:part]
        assert await store.list_uploads("packs/") == []
        upload = await store.begin_upload("packs/cd/nothing.pack")  # no leading part
        await upload.write_part(2, part, data[part : 2 * part])
        assert await store.salvage_upload("packs/cd/nothing.pack") is None
        assert await store.list_uploads("packs/") == []
        assert not await store.exists("packs/cd/nothing.pack")
        await store.close()

    asyncio.run(go())


def test_salvage_with_journaled_receipts_works_whatever_listparts_says(s3_url: str) -> None:
    """Issue 13: SeaweedFS's ListParts omits part checksums, so a CRC32 upload could not be
    completed and a resumed push re-sent a third of what it had sent. The receipts the dead
    writer journaled before each send (``prepare_part``) fill them in: parts 1 and 2 are
    kept on any server, the second landed though its writer never heard back; a receipt
    that does not match the landed part (another size) is not used."""
    from transfer.store.s3 import S3Store
    from transfer.store.s3config import S3Settings

    part = 5 * MiB
    data = np.random.default_rng(2).bytes(3 * part)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)

    async def go() -> None:
        settings = S3Settings(bucket, endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        store = S3Store(settings, prefix, checksum="crc32")
        upload = await store.begin_upload("packs/ef/resumed.pack")
        receipts = []
        for n in (1, 2):
            piece = data[(n - 1) * part : n * part]
            receipt = await upload.prepare_part(n, piece)
            assert receipt is not None and "ChecksumCRC32" in receipt
            receipts.append(receipt)
            await upload.write_part(n, (n - 1) * part, piece, receipt)
        kept = await store.salvage_upload("packs/ef/resumed.pack", receipts)
        assert kept == 2 * part
        assert await store.get("packs/ef/resumed.pack") == data[: 2 * part]

        upload = await store.begin_upload("packs/ef/other.pack")
        await upload.write_part(1, 0, data[:part])
        stale = [{**receipts[0], "Size": part + 1}]
        kept = await store.salvage_upload("packs/ef/other.pack", stale)
        assert kept in (None, part)  # None where ListParts has no checksum (SeaweedFS)
        assert await store.list_uploads("packs/") == []
        await store.close()

    asyncio.run(go())


def test_cli_push_to_a_directory_sigkilled_then_rerun_leaves_no_temp_file(
    local_url: str, tmp_path: Path
) -> None:
    """A local store cannot tell which parts of a dead writer's pack landed whole (pwrite in
    any order, no per-part checksum): the rerun sends that pack again, reuses the packs
    the kill left complete, and removes the dead writer's temp file (it was left for
    retention, 252 MB of it in a newcomer's trial)."""
    store = Path(local_url)
    src = write_checkpoint(tmp_path / "step_000010", SEED)
    cmd = [sys.executable, "-m", "agent", "push", str(src), local_url, "--job", JOB,
           "--node", "n", *CLI_SIZES]  # fmt: skip
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg-state")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:  # killed once a pack is complete and the next is being written
        wait_for(
            lambda: (
                proc.poll() is not None
                or (any(store.rglob("*.pack")) and any(store.rglob(".*.tmp-*")))
            ),
            60,
            "a complete pack and a pack being written",
        )
        proc.kill()
    finally:
        proc.wait(30)
    if proc.returncode == -signal.SIGKILL:
        assert any(store.rglob(".*.tmp-*")), "the kill left a pack half written"
        assert 10 not in committed(local_url)
    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert not list(store.rglob(".*.tmp-*")), "the rerun removed the dead writer's temp files"
    assert_all_verify(local_url, {10})


def test_cli_push_interrupted_by_ctrl_c_resumes_as_much_as_after_a_kill(
    s3_url: str, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT) of ``ferry push`` to S3 while its one pack's upload is half sent:
    the interrupted push used to abort that upload, so the same command again sent every
    byte again (a newcomer's trial: kill -9 kept more than Ctrl-C). It now leaves the
    upload as a kill does, and the rerun completes it with the parts that landed."""
    src = write_checkpoint(tmp_path / "step_000010", SEED + 7)
    one_pack = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "200"]
    cmd = [sys.executable, "-m", "agent", "push", str(src), s3_url, "--job", JOB, "--node", "n",
           "--endpoint-url", s3_proxy.url, "--window", str(WINDOW), *one_pack]  # fmt: skip
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg-state")}
    start = s3_proxy.stats.bytes_up
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(
            lambda: proc.poll() is not None or s3_proxy.stats.bytes_up - start >= sum(SHARDS) // 2,
            120,
            "half the checkpoint sent",
        )
        proc.send_signal(signal.SIGINT)
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # (interrupted: not finished first)
    assert b"interrupted" in err and 10 not in committed(s3_url)
    before = s3_proxy.stats.bytes_up - start
    assert pending_uploads(s3_url), "the interrupted push left its upload for the rerun"
    rerun = subprocess.run(
        [*cmd, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr
    doc = json.loads(rerun.stdout)
    resent = before + (s3_proxy.stats.bytes_up - start - before) - sum(SHARDS)
    assert doc["chunks_resumed"] > 0, doc
    assert resent <= (WINDOW + 2) * 5 * MiB, (resent, doc)  # what was in flight, at most
    assert pending_uploads(s3_url) == [], "the rerun completed the upload"
    assert_all_verify(s3_url, {10})
