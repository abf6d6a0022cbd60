"""The agent's background push side on real local-directory tiers and a real hot dir: the
watcher sees only committed saves, the queue pushes them to every tier (deltas included),
failures land in the journal, a restarted queue resumes, and multi-node steps get exactly one
completion marker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest

from agent.node.hotdir import HotDir
from agent.node.journal import Journal
from agent.node.pushqueue import PushQueue, completion_key
from agent.node.watcher import watch_hot_dir
from tests.conftest import init_test_store, random_bytes, tree_bytes, write_file
from tests.harness import MARKER, POLL, make_queue, save, tier_states, until
from tests.harness import QUEUE_OPTS as OPTS
from tests.harness import queue_agent as agent
from transfer.engine import PullPlan, pull, push
from transfer.engine.catalog import is_complete
from transfer.store import open_store
from transfer.store.local import LocalStore


def tiers_in(tmp_path: Path, *names: str) -> list[str]:
    """New stores (as `ferry init` makes them: a push queue never makes one)."""
    return [init_test_store(str(tmp_path / name)) for name in names]


def test_watcher_reports_each_committed_step_dir_once(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    save(hot / "llama" / "step_000010", {"a.distcp": b"x"})  # there before the agent
    save(hot / "llama" / ".llama.ferry-staging-1" / "step_000030", {"a": b"x"})
    save(hot / "llama" / ".step_000040", {"a": b"x"})  # hidden: a pull's staging dir
    save(hot / ".ferry" / "step_000050", {"a": b"x"})  # the agent's own state dir
    save(hot / "bad name" / "step_000060", {"a": b"x"})  # not a valid job name
    save(hot / "llama" / "latest", {"a": b"x"})  # no step number
    pending = hot / "llama" / "step_000020"
    write_file(pending / "__0_0.distcp", b"shard")  # a save still in progress
    seen: list[tuple[str, int, str]] = []
    failures = [1]

    async def on_committed(job: str, step: int, path: Path) -> None:
        if step == 20 and failures:
            failures.pop()
            raise RuntimeError("transient")  # offered again on the next poll
        seen.append((job, step, path.name))

    async def go() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            watch_hot_dir(HotDir(hot, MARKER), on_committed, poll_seconds=POLL, stop=stop)
        )
        await until(lambda: len(seen) == 1)
        await asyncio.sleep(4 * POLL)
        assert seen == [("llama", 10, "step_000010")]  # once, and the unfinished one not yet
        save(pending, {})
        await until(lambda: len(seen) == 2)
        # deleted and written again (training overwrote the step): reported again
        for f in (hot / "llama" / "step_000010").iterdir():
            f.unlink()
        (hot / "llama" / "step_000010").rmdir()
        await asyncio.sleep(3 * POLL)
        save(hot / "llama" / "step_000010", {"a.distcp": b"y"})
        await until(lambda: len(seen) == 3)
        await asyncio.sleep(3 * POLL)
        stop.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(go())
    assert seen == [
        ("llama", 10, "step_000010"),
        ("llama", 20, "step_000020"),
        ("llama", 10, "step_000010"),
    ]
    assert not failures  # the failing callback was called and retried


def test_committed_checkpoints_reach_every_tier_and_pull_back_identical(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    warm, cold = tiers_in(tmp_path, "warm", "cold")
    shard0 = random_bytes(600_000, 1)
    shard1 = random_bytes(300_000, 2)

    async def go() -> None:
        queue, stores = make_queue([warm, cold], tmp_path / "state")
        async with agent(queue, hot):
            ckpt = hot / "llama" / "step_000010"
            write_file(ckpt / "__0_0.distcp", shard0)
            write_file(ckpt / "__1_0.distcp", shard1)
            write_file(hot / "llama" / "step_000015" / "__0_0.distcp", shard0)  # never marked
            await asyncio.sleep(4 * POLL)
            assert queue.states() == []  # shards without the marker: not a checkpoint yet
            save(ckpt, {})
            await until(lambda: queue.idle and len(queue.states()) == 2)
            rows = tier_states(queue, "llama", 10)
            assert {t: r["state"] for t, r in rows.items()} == {warm: "durable", cold: "durable"}
            assert all(r["error"] is None and r["attempts"] == 1 for r in rows.values())

            # next save: shard 1 unchanged (deduplicated), shard 0 slightly changed (delta)
            changed = bytearray(shard0)
            changed[::4096] = bytes(len(changed[::4096]))
            save(
                hot / "llama" / "step_000020",
                {"__0_0.distcp": bytes(changed), "__1_0.distcp": shard1},
            )
            await until(lambda: queue.idle and len(queue.states()) == 4)
            second = tier_states(queue, "llama", 20)
            assert {r["state"] for r in second.values()} == {"durable"}
            result = second[cold]["result"]
            assert isinstance(result, dict)
            assert result["base_step"] == 10 and result["base_local"] is True
            assert result["chunks_deduped"] > 0 and result["chunks_delta"] > 0

            stats = queue.stats.tiers
            assert stats[warm].pushes_ok == stats[cold].pushes_ok == 2
            assert stats[cold].pushes_failed == 0 and stats[cold].bytes_transferred > 0

        restored = tmp_path / "restored"
        await pull(stores[1], restored, PullPlan("llama", 10), options=OPTS)
        assert tree_bytes(restored) == tree_bytes(hot / "llama" / "step_000010")
        restored2 = tmp_path / "restored2"
        await pull(stores[1], restored2, PullPlan("llama", None), options=OPTS)
        assert tree_bytes(restored2) == tree_bytes(hot / "llama" / "step_000020")
        steps = {p.name for p in (Path(cold) / "manifests" / "llama").iterdir()}
        assert steps == {f"{10:018d}", f"{20:018d}"}  # step 15 (no marker) was never pushed

    asyncio.run(go())


def test_a_failing_tier_is_reported_and_retried_while_the_other_becomes_durable(
    tmp_path: Path,
) -> None:
    """A tier whose mount is missing is retried for as long as it is (a newcomer's trial:
    a tier down for two minutes was given up after three attempts, ~98 s, and the step
    was pushed there only after a restart), while the other tier becomes durable; once
    mounted, the step lands there too."""
    hot = tmp_path / "hot"
    missing = str(tmp_path / "not-mounted")  # a store directory that does not exist
    (good,) = tiers_in(tmp_path, "good")

    async def go() -> None:
        queue, _ = make_queue([missing, good], tmp_path / "state", max_attempts=3)
        async with agent(queue, hot):
            save(hot / "job1" / "step_000010", {"__0_0.distcp": random_bytes(100_000)})
            await until(lambda: tier_states(queue, "job1", 10).get(missing, {}).get(
                "attempts", 0) >= 5)  # fmt: skip
            rows = tier_states(queue, "job1", 10)
            assert rows[good]["state"] == "durable" and rows[good]["attempts"] == 1
            assert rows[missing]["state"] == "failed" and rows[missing]["will_retry"]
            assert "not-mounted" in str(rows[missing]["error"])
            # what a restart would resume
            assert queue.journal.pending([missing, good]) == [
                ("job1", 10, hot / "job1" / "step_000010")
            ]
            assert queue.journal.pending([good]) == []
            await asyncio.to_thread(init_test_store, missing)  # mounted at last
            await until(lambda: tier_states(queue, "job1", 10)[missing]["state"] == "durable")

    asyncio.run(go())


def test_a_tier_that_refuses_the_push_is_given_up_after_its_attempts_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a tier that does not answer: one that answers no (here, the step is committed
    there under this node with other content) is tried max_attempts times, then left
    failed with an ERROR line."""
    hot = tmp_path / "hot"
    (tier,) = tiers_in(tmp_path, "tier")
    plain = Path(tier)
    other = save(tmp_path / "other" / "step_000010", {"__0_0.distcp": random_bytes(1000, 9)})

    async def go() -> dict[str, Any]:
        queue, stores = make_queue([tier], tmp_path / "state", max_attempts=3)
        await push(stores[0], other, job="job1", step=10, node="n1", options=OPTS)
        async with agent(queue, hot):
            save(hot / "job1" / "step_000010", {"__0_0.distcp": random_bytes(1000)})
            await until(lambda: len(queue.states()) == 1 and queue.idle)
            return tier_states(queue, "job1", 10)[str(plain)]

    with caplog.at_level("ERROR"):
        row = asyncio.run(go())
    assert (row["state"], row["attempts"], row["will_retry"]) == ("failed", 3, False)
    said = [r.__dict__["ferry_fields"] for r in caplog.records if r.levelname == "ERROR"]
    assert [f["outcome"] for f in said] == ["gave_up"], said  # (agent/daemon/logs.py's event)


class StuckManifestStore(LocalStore):
    """A tier that hangs on the commit (a manifest write), like a stalled NFS server."""

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        if key.startswith("manifests/"):
            await asyncio.sleep(60)
        await super().put(key, data, create_only=create_only)


def test_drain_cancels_a_stuck_push_and_a_fresh_queue_resumes_it(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    (tier,) = tiers_in(tmp_path, "tier")
    ckpt = save(hot / "job1" / "step_000010", {"__0_0.distcp": random_bytes(200_000, 5)})
    state = tmp_path / "state"

    async def go() -> None:
        journal = Journal(state / "journal.sqlite3", "n1")
        stuck = PushQueue(
            [(tier, StuckManifestStore(Path(tier)))], journal, node="n1", options=OPTS
        )
        await stuck.start()
        assert stuck.enqueue("job1", 10, ckpt)
        assert not stuck.enqueue("job1", 10, ckpt)  # deduplicated while queued
        await until(lambda: any(r["pushing"] for r in stuck.states()))
        loop = asyncio.get_running_loop()
        began = loop.time()
        await stuck.drain(0.2)
        assert loop.time() - began < 2
        assert [r["state"] for r in stuck.states()] == ["staged"]
        stuck.close()

        # the restarted agent: a fresh queue over the same journal resumes it
        fresh, _ = make_queue([tier], state)
        await fresh.start()
        await until(lambda: fresh.idle)
        assert [r["state"] for r in fresh.states()] == ["durable"]
        assert fresh.journal.pending() == []
        assert not fresh.enqueue("job1", 10, ckpt)  # durable everywhere: nothing to do
        await fresh.drain(1)
        fresh.close()

    asyncio.run(go())


def test_a_checkpoint_restored_here_is_never_pushed_as_this_nodes_part(tmp_path: Path) -> None:
    (tier,) = tiers_in(tmp_path, "tier")
    ckpt = save(tmp_path / "hot" / "job1" / "step_000010", {"a": b"other nodes' data"})

    async def go() -> None:
        queue, _ = make_queue([tier], tmp_path / "state")
        queue.exclude("job1", 10)  # what a prefetch does before it pulls
        assert not queue.enqueue("job1", 10, ckpt)
        assert queue.states() == [] and queue.journal.pending() == []
        await queue.drain(0)
        queue.close()

    asyncio.run(go())
    assert not (Path(tier) / "manifests").exists()


def test_a_retry_waiting_when_the_step_is_restored_here_is_dropped(tmp_path: Path) -> None:
    """A push that failed waits for its retry; meanwhile a prefetch restores the step here
    (without naming this node's own files): the retry must not push what the directory
    now holds, other nodes' data, as this node's part."""
    later = tmp_path / "tier-not-mounted-yet"
    ckpt = save(tmp_path / "hot" / "job1" / "step_000010", {"a": b"own data"})

    async def go() -> None:
        queue, _ = make_queue([str(later)], tmp_path / "state", retry_seconds=0.3)
        await queue.start()
        assert queue.enqueue("job1", 10, ckpt)
        await until(lambda: tier_states(queue, "job1", 10)[str(later)]["state"] == "failed")
        queue.exclude("job1", 10)  # a prefetch restores it here
        (ckpt / "b").write_bytes(b"another node's data")
        await asyncio.to_thread(init_test_store, str(later))  # a retry would succeed now
        await until(lambda: queue.idle, within=10)
        await queue.drain(0)
        queue.close()

    asyncio.run(go())
    assert not (later / "manifests").exists()


def test_own_files_are_not_taken_from_a_step_restored_here_before(tmp_path: Path) -> None:
    """A step an earlier restore added to without naming this node's files (an older
    agent, or a restore of the whole step) holds others' data: what it holds now is not
    recorded as this node's own, and it is not pushed."""
    (tier,) = tiers_in(tmp_path, "tier")
    ckpt = save(tmp_path / "hot" / "job1" / "step_000010", {"a": b"own", "b": b"another's"})

    async def go() -> None:
        queue, _ = make_queue([tier], tmp_path / "state")
        queue.exclude("job1", 10)
        queue.keep_own_part("job1", 10, ckpt, frozenset({"a", "b"}))
        assert queue.journal.own_files("job1", 10) is None
        assert queue.busy_steps() == set() and queue.journal.pending() == []
        await queue.drain(0)
        queue.close()

    asyncio.run(go())
    assert not (Path(tier) / "manifests").exists()


def test_a_restore_evicted_after_the_watcher_saw_it_is_not_pushed(tmp_path: Path) -> None:
    """The watcher scans the hot dir in a thread; hot retention, on the loop, may evict a
    restored step it found meanwhile, and forgets with it that the step was restored here.
    The watcher's report then queued a push of a directory no longer there, as this node's
    own part: it failed, was retried, and kept the step "busy" when the step was restored
    again (the soak, under load). A step whose directory is gone is not queued."""
    (tier,) = tiers_in(tmp_path, "tier")
    ckpt = save(tmp_path / "hot" / "job1" / "step_000010", {"a": b"other nodes' data"})

    async def go() -> None:
        queue, _ = make_queue([tier], tmp_path / "state")
        queue.exclude("job1", 10)  # restored here
        hidden = ckpt.with_name(".evicted-step_000010")
        ckpt.rename(hidden)  # hot retention: renamed away, then its rows forgotten
        queue.journal.forget("job1", 10)
        assert not queue.enqueue("job1", 10, ckpt)  # the watcher's late report
        assert queue.busy_steps() == set() and queue.journal.pending() == []
        await queue.drain(0)
        queue.close()

    asyncio.run(go())
    assert not (Path(tier) / "manifests").exists()


def test_completion_marker_is_written_once_when_every_expected_node_pushed(
    tmp_path: Path,
) -> None:
    (tier,) = tiers_in(tmp_path, "tier")
    nodes = ("a", "b")
    parts = {
        n: {f"__{i}_0.distcp": random_bytes(150_000, 10 * i + ord(n)) for i in (0, 1)}
        for n in nodes
    }
    parts["b"] = {k.replace("__", "__b"): v for k, v in parts["b"].items()}  # b's own ranks

    async def go() -> None:
        queues = {}
        for n in nodes:
            queues[n], _ = make_queue([tier], tmp_path / f"state-{n}", node=n, expected_nodes=nodes)
            await queues[n].start()
        store = open_store(tier)

        def pushed(n: str, step: int) -> Callable[[], bool]:
            return lambda: queues[n].idle and bool(tier_states(queues[n], "job1", step))

        # a alone: its part is durable, the step is not complete
        queues["a"].enqueue("job1", 10, save(tmp_path / "a" / "job1" / "step_000010", parts["a"]))
        await until(pushed("a", 10))
        assert tier_states(queues["a"], "job1", 10)[tier]["state"] == "durable"
        assert not await is_complete(store, "job1", 10, nodes)
        assert not (Path(tier) / completion_key("job1", 10)).exists()
        # then b: now it is, and b (the last) wrote the marker
        queues["b"].enqueue("job1", 10, save(tmp_path / "b" / "job1" / "step_000010", parts["b"]))
        await until(pushed("b", 10))
        assert await is_complete(store, "job1", 10, nodes)
        assert await is_complete(store, "job1", 10, ())  # single-node jobs: always
        doc = json.loads((Path(tier) / completion_key("job1", 10)).read_bytes())
        assert doc["job"] == "job1" and doc["step"] == 10 and doc["nodes"] == ["a", "b"]
        assert [queues[n].stats.completions_written for n in nodes] == [0, 1]
        # a late check by a finds it written: no second create
        assert not await queues["a"]._complete_if_all_pushed(store, "job1", 10)

        # both at once: whoever sees both parts may try, exactly one create succeeds
        for n in nodes:
            queues[n].enqueue("job1", 20, save(tmp_path / n / "job1" / "step_000020", parts[n]))
        await until(lambda: pushed("a", 20)() and pushed("b", 20)())
        assert await is_complete(store, "job1", 20, nodes)
        assert sum(queues[n].stats.completions_written for n in nodes) == 2

        # a resharded restore merges both nodes' parts
        merged = tmp_path / "merged"
        await pull(store, merged, PullPlan("job1", 20), options=OPTS)
        assert set(tree_bytes(merged)) == {*parts["a"], *parts["b"], MARKER}
        for n in nodes:
            await queues[n].drain(0)
            queues[n].close()

    asyncio.run(go())


def test_journal_keeps_durable_packs_of_an_unfinished_push_until_it_commits(
    tmp_path: Path,
) -> None:
    from agent.node.journal import Journal
    from transfer.engine.chunkindex import StoredChunk

    journal = Journal(tmp_path / "j.sqlite3", "n")
    journal.record_staged("job", 5, tmp_path, ["t1"])
    chunk = StoredChunk("a" * 64, 10, "zstd", "b" * 32, 0, 7, None)
    journal.resume("job", 5, "t1").pack_durable([chunk])
    journal.close()
    reopened = Journal(tmp_path / "j.sqlite3", "n")  # survives a restart
    assert reopened.resume("job", 5, "t1").chunks() == [chunk]
    assert reopened.resume("job", 5, "t2").chunks() == []
    reopened.record_durable("job", 5, "t1", {"bytes_raw": 10})
    assert reopened.resume("job", 5, "t1").chunks() == []


def test_push_resume_log_survives_a_torn_tail(tmp_path: Path) -> None:
    """``ferry push``'s resume log: a process killed while appending the next record keeps
    the ones it committed (a torn tail is ignored), and the log goes once the push commits."""
    from agent.node.journal import cli_push_journal
    from transfer.engine.chunkindex import StoredChunk

    chunk = StoredChunk("a" * 64, 5, "raw", "b" * 32, 0, 5)
    args = (tmp_path, "s3://b/p", "llm", 10, "n", tmp_path / "step_000010")
    script = f"""if True:
        import os, signal
        from pathlib import Path
        from agent.node.journal import cli_push_journal
        from transfer.engine.chunkindex import StoredChunk
        state = Path(r"{tmp_path}")
        journal = cli_push_journal(state, "s3://b/p", "llm", 10, "n", state / "step_000010")
        journal.resume("llm", 10, "s3://b/p").pack_durable([StoredChunk{astuple(chunk)!r}])
        os.kill(os.getpid(), signal.SIGKILL)
    """
    repo = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (wal,) = (tmp_path / "pushes").glob("*.sqlite3-wal")  # where the kill left the record
    with open(wal, "ab") as fh:
        fh.write(os.urandom(100))  # killed while appending the next record
    journal = cli_push_journal(*args)
    assert journal.resume("llm", 10, "s3://b/p").chunks() == [chunk]
    journal.remove()
    assert not journal.path.exists() and not list((tmp_path / "pushes").iterdir())
    again = cli_push_journal(*args)
    assert again.resume("llm", 10, "s3://b/p").chunks() == []
    again.close()


def test_a_file_that_comes_after_the_push_is_said_to_be_in_no_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's trial: a node without .metadata (its files are its part, pushed once
    quiet) wrote its second shard 6 s after its first; the part was pushed without it,
    and nothing on that node ever said so. Its files are now looked at again after the
    push, and a file that came or grew since is named in an ERROR line."""
    from agent.node import pushqueue

    monkeypatch.setattr(pushqueue, "RECHECK_SECONDS", (0.5,))
    hot = tmp_path / "hot"
    (tier,) = tiers_in(tmp_path, "tier")
    step = save(hot / "job1" / "step_000010", {"__4_0.distcp": random_bytes(1000, 4)})

    async def go() -> None:
        queue, _ = make_queue([tier], tmp_path / "state", quiet_seconds=0.1)
        await queue.start()
        assert queue.enqueue("job1", 10, step)
        await until(lambda: tier_states(queue, "job1", 10)[tier]["state"] == "durable")
        (step / "__5_0.distcp").write_bytes(random_bytes(1000, 5))  # the late shard
        await until(lambda: any(r.levelname == "ERROR" for r in caplog.records), within=10)
        await queue.drain(0)
        queue.close()

    with caplog.at_level("ERROR"):
        asyncio.run(go())
    said = [r.__dict__["ferry_fields"] for r in caplog.records if r.levelname == "ERROR"]
    assert [(f["outcome"], f["files"]) for f in said] == [("changed_after_push", "__5_0.distcp")], (
        said
    )
