"""A checkpoint still being written never becomes durable (issue 13).

The trial that found it: ``.metadata`` first (as ``cp -r`` and ``rsync`` copy it), then the
shard growing 8 MB at a time; the agent pushed the first 7 MB as ``durable``, ``ferry pull``
restored the torn shard saying every chunk verified, and hot retention later evicted the
complete hot copy. Here, on real local tiers and a real hot dir: the agent waits for the
files to be quiet and pushes the settled copy; a file rewritten in place during a push
aborts it (nothing committed, its packs collected); a DCP ``.metadata`` naming a shard
longer than the file on disk is refused; a hot copy that differs from the pushed one is not
evicted.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from agent.node.hotdir import HotDir
from agent.node.hotretention import plan_hot
from agent.node.journal import Journal
from tests.conftest import random_bytes, tree_bytes, write_file
from tests.harness import QUEUE_OPTS as OPTS
from tests.harness import make_queue, tier_states, until
from tests.harness import queue_agent as agent
from transfer.engine import PullPlan, list_checkpoints, pull, push
from transfer.errors import SourceChangedError
from transfer.format.layout import PACKS_PREFIX
from transfer.store import open_store


def test_a_step_whose_shard_grows_after_its_marker_is_pushed_only_once_settled(
    tmp_path: Path,
) -> None:
    hot, tier = tmp_path / "hot", tmp_path / "tier"
    tier.mkdir()
    step = hot / "racejob" / "step_000001"
    final = random_bytes(6 * 400_000, seed=3)

    async def go() -> None:
        queue, stores = make_queue([str(tier)], tmp_path / "state", quiet_seconds=1.0)
        async with agent(queue, hot):
            write_file(step / ".metadata", b"not a DCP pickle: the stability check alone")
            shard = step / "__0_0.distcp"
            for i in range(1, 7):  # grows for ~1.8 s, each pause well under quiet_seconds
                write_file(shard, final[: i * 400_000])
                await asyncio.sleep(0.3)
                row = tier_states(queue, "racejob", 1).get(str(tier))
                assert row is None or row["state"] != "durable", row
            await until(lambda: tier_states(queue, "racejob", 1)[str(tier)]["state"] == "durable")
        dest = tmp_path / "restored"
        await pull(stores[0], dest, PullPlan("racejob", 1))
        assert (dest / "__0_0.distcp").read_bytes() == final
        for s in stores:
            await s.close()

    asyncio.run(go())


class _RewriteOnce:
    """A Progress that rewrites one byte of ``path`` in place after the first chunk: a
    writer touching the checkpoint while it is being pushed."""

    def __init__(self, path: Path) -> None:
        self.path, self.done = path, False

    def start(self, total_bytes: int, what: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        if not self.done:
            self.done = True
            time.sleep(0.01)  # a later mtime tick than the scan's
            with open(self.path, "r+b") as f:
                f.seek(5)
                f.write(b"\xff")

    def finish(self) -> None:
        pass


def test_a_shard_rewritten_in_place_during_a_push_commits_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "job" / "step_000010"
    write_file(ckpt / "__0_0.distcp", random_bytes(1_500_000, seed=1))
    write_file(ckpt / ".metadata", b"meta")
    (tmp_path / "store").mkdir()
    store = open_store(str(tmp_path / "store"))

    async def go() -> None:
        with pytest.raises(SourceChangedError, match="written to while it was being pushed"):
            await push(
                store,
                ckpt,
                job="j",
                step=10,
                node="n",
                options=OPTS,
                progress=_RewriteOnce(ckpt / "__0_0.distcp"),
            )
        assert await list_checkpoints(store, "j") == []
        assert await store.list(PACKS_PREFIX) == []  # its packs were collected
        # settled, it pushes and pulls back byte-exact
        await push(store, ckpt, job="j", step=10, node="n", options=OPTS)
        await pull(store, tmp_path / "restored", PullPlan("j", 10))
        assert tree_bytes(tmp_path / "restored") == tree_bytes(ckpt)
        await store.close()

    asyncio.run(go())


class _DeleteOnStart:
    """A Progress that deletes ``path`` once the push has scanned the directory and before
    it reads a byte: a file removed under a running push (by training, by hand)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, total_bytes: int, what: str) -> None:
        self.path.unlink()

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


def test_a_file_deleted_during_a_push_fails_naming_it_and_commits_nothing(
    local_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 29 (j): a file deleted during a push ended in a bare `[Errno 2] No such file or
    directory`. One line names it and says it vanished while the push read it; nothing is
    committed; the directory as it is now then pushes."""
    import agent.cli.run
    from agent.cli.run import main as ferry

    ckpt = tmp_path / "job" / "step_000010"
    write_file(ckpt / "__0_0.distcp", random_bytes(1_500_000, seed=1))
    write_file(ckpt / "__1_0.distcp", random_bytes(700_000, seed=2))
    write_file(ckpt / ".metadata", b"metadata")  # (shards without it: an unfinished save)
    write_file(ckpt / "notes.txt", b"x")
    url = local_url
    store = open_store(url)
    victim = ckpt / "__1_0.distcp"

    async def go() -> None:
        with pytest.raises(SourceChangedError) as vanished:
            await push(store, ckpt, job="j", step=10, node="n", options=OPTS,
                       progress=_DeleteOnStart(victim))  # fmt: skip
        assert str(vanished.value).startswith(f"{victim} vanished while the push read it")
        assert "nothing was committed" in str(vanished.value)
        assert await list_checkpoints(store, "j") == []

    asyncio.run(go())
    write_file(victim, random_bytes(700_000, seed=2))
    monkeypatch.setattr(agent.cli.run, "_progress", lambda args: _DeleteOnStart(victim))
    capsys.readouterr()
    assert ferry(["push", str(ckpt), url, "--job", "j", "--node", "n"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Errno" not in err, err
    assert err.startswith(f"ferry push: error: {victim} vanished while the push read it"), err

    async def after() -> None:
        assert await list_checkpoints(store, "j") == []
        await push(store, ckpt, job="j", step=10, node="n", options=OPTS)  # as it is now
        await pull(store, tmp_path / "restored", PullPlan("j", 10))
        assert tree_bytes(tmp_path / "restored") == tree_bytes(ckpt)
        await store.close()

    asyncio.run(after())


def test_a_dcp_save_whose_metadata_names_a_longer_shard_is_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    ckpt = tmp_path / "step_000005"
    state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(1000)}
    dcp.save(state, checkpoint_id=str(ckpt))
    shard = next(ckpt.glob("*.distcp"))
    whole = shard.read_bytes()
    os.truncate(shard, len(whole) // 2)  # the copy of the shard is still under way
    (tmp_path / "store").mkdir()
    store = open_store(str(tmp_path / "store"))

    async def go() -> None:
        with pytest.raises(SourceChangedError, match=r"\.metadata needs"):
            await push(store, ckpt, job="j", step=5, node="n", options=OPTS)
        assert await list_checkpoints(store, "j") == []
        shard.write_bytes(whole)
        await push(store, ckpt, job="j", step=5, node="n", options=OPTS)
        assert [c.step for c in await list_checkpoints(store, "j")] == [5]
        await store.close()

    asyncio.run(go())


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_a_hot_copy_that_differs_from_its_pushed_copy_is_not_evicted(tmp_path: Path) -> None:
    hot, tier = tmp_path / "hot", tmp_path / "tier"
    tier.mkdir()
    steps = [hot / "j" / f"step_{s:06d}" for s in (1, 2, 3, 4)]
    for i, step in enumerate(steps):
        write_file(step / "__0_0.distcp", random_bytes(200_000, seed=i))
        write_file(step / ".metadata", b"meta")

    async def go() -> None:
        store = open_store(str(tier))
        journal = Journal(tmp_path / "journal.sqlite3", "n1")
        for s, step in zip((1, 2, 3, 4), steps, strict=True):
            await push(store, step, job="j", step=s, node="n1", options=OPTS)
        # step 1 grows after its push (a writer that was not done)
        await asyncio.to_thread(_append, steps[0] / "__0_0.distcp", b"more")
        plan = await plan_hot(
            HotDir(hot, ".metadata"),
            node="n1",
            keep_last=2,
            budget_bytes=None,
            tiers=[(str(tier), store)],
            journal=journal,
            protected=(),
        )
        by_step = {s.step: s for s in plan.steps}
        assert by_step[1].action == "keep" and "differs from the copy pushed" in by_step[1].reason
        assert by_step[2].action == "evict", by_step[2]  # the control: same age, unchanged
        await store.close()
        journal.close()

    asyncio.run(go())
