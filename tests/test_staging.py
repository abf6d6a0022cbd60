"""Restores resume: a pull into a destination adopts the staging directory an interrupted
pull into it left, keeps every chunk that hash-checks in place and fetches only the rest
(transfer/engine/staging.py). The kill trials (test_crash_trials.py) do it for real."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import adamw_series, open_test_store, run, tree_bytes
from transfer.engine import PullEvents, PullPlan, pull, push
from transfer.engine.settle import settle
from transfer.engine.staging import RESUME_KEEP_SECONDS, sweep_stale_staging
from transfer.options import TransferOptions

MiB = 1 << 20
OPTS = TransferOptions(chunk_size=MiB, part_size=5 * MiB, pack_size=10 * MiB)


def _store_with(tmp_path: Path) -> tuple[str, Path]:
    (k0,) = adamw_series(tmp_path / "hot", 1, mib=2)
    url = str(tmp_path / "store")
    Path(url).mkdir()
    run(push(open_test_store(url), k0, job="j", step=1, node="n", options=OPTS))
    return url, k0


def _leftover_of(dest: Path, like: Path, name: str = "0123abcd") -> Path:
    """What a pull into ``dest`` killed near its end leaves: ``like``'s files, hidden."""
    left = dest.parent / f".{dest.name}.ferry-staging-{name}"
    shutil.copytree(like, left)
    return left


def test_a_pull_adopts_the_leftover_and_fetches_only_what_does_not_verify(
    tmp_path: Path,
) -> None:
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    dest.parent.mkdir()
    left = _leftover_of(dest, k0)
    shard = left / "__0_0.distcp"  # 4 chunks: the 2nd torn, the last never written
    with open(shard, "r+b") as fh:
        fh.seek(MiB + 4096)
        fh.write(b"\xff" * 100)
        fh.truncate(3 * MiB)
    (left / "__1_0.distcp").unlink()  # 2 chunks, never created
    (left / "stray.bin").write_bytes(b"not in this checkpoint")  # another version's file
    (left / "sub").mkdir()
    (left / "link").symlink_to(tmp_path)

    result = run(pull(open_test_store(url), dest, PullPlan("j", 1), options=OPTS))
    assert tree_bytes(dest) == tree_bytes(k0)  # exactly: nothing else came along
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in k0.iterdir())
    total = result.chunks_total
    assert result.chunks_resumed == total - 4, result  # all but 2 + 2 chunks
    assert result.bytes_transferred < 4.5 * MiB  # 4 chunks' worth, not the 6 MiB of it all
    _only_the_destination_left(dest)


def test_a_leftover_of_wrong_bytes_is_adopted_and_none_of_them_pass(tmp_path: Path) -> None:
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    dest.parent.mkdir()
    garbage = _leftover_of(dest, k0, "00000002")
    for f in garbage.iterdir():
        f.write_bytes(os.urandom(f.stat().st_size))  # same sizes, wrong bytes
    result = run(pull(open_test_store(url), dest, PullPlan("j", 1), options=OPTS))
    assert result.chunks_resumed == 0  # the garbage was adopted, and none of it kept
    assert tree_bytes(dest) == tree_bytes(k0)


def test_the_start_up_sweep_keeps_one_resumable_leftover_per_destination(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "job"
    parent.mkdir()
    (parent / "step_000002").mkdir()  # restored already: its leftovers are garbage

    def hidden(name: str, age: float = 0.0) -> Path:
        p = parent / name
        p.mkdir()
        then = time.time() - age
        os.utime(p, (then, then))
        return p

    newest = hidden(".step_000001.ferry-staging-aaaaaaaa", age=10)
    older = hidden(".step_000001.ferry-staging-bbbbbbbb", age=20)
    done = hidden(".step_000002.ferry-staging-cccccccc")
    stale = hidden(".step_000003.ferry-staging-dddddddd", age=RESUME_KEEP_SECONDS + 1)
    fill = hidden(".step_000004.ferry-staging-fill-eeeeeeee")
    killed_lock = parent / ".step_000005.ferry-lock"  # a restore killed while it held it
    killed_lock.write_text("pid 1 on elsewhere")
    removed = sweep_stale_staging(parent)
    assert sorted(removed) == sorted([older, done, stale, fill, killed_lock])
    assert newest.exists() and (parent / "step_000002").exists()


def test_an_interrupted_restore_says_so_when_it_keeps_its_staging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer's trial: a pull stopped by Ctrl-C ended "... resumes from it
    (CancelledError)", a name from the code, not what happened."""
    import asyncio

    from transfer.engine.pull import _kept_if_resumable

    class Kept:  # what _kept_if_resumable uses of a Staging
        path = tmp_path / "staging"

        def release(self) -> None:
            pass

    async def stopped() -> None:
        async with _kept_if_resumable(Kept()):  # type: ignore[arg-type]
            raise asyncio.CancelledError

    with caplog.at_level("WARNING"), pytest.raises(asyncio.CancelledError):
        run(stopped())
    assert "the same pull resumes from it (interrupted)" in caplog.text, caplog.text


def _pull_in_a_thread(url: str, dest: Path) -> tuple[threading.Thread, dict[str, Any]]:
    """A pull into ``dest`` running in a thread; ``out``: its result or error, and the
    staging path it said it waits for (``waiting``) as soon as it says it."""
    out: dict[str, Any] = {"told": threading.Event()}

    def waiting(path: Path, holder: str, waited: float) -> None:
        out["waiting"], out["holder"] = path, holder
        out["told"].set()

    def go() -> None:
        try:
            events = PullEvents(waiting=waiting)
            out["result"] = run(
                pull(open_test_store(url), dest, PullPlan("j", 1), None, events, OPTS)
            )
        except BaseException as exc:  # (handed to the test)
            out["error"] = exc

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def _only_the_destination_left(dest: Path) -> None:
    """Once settled: no staging, lock file or marker beside ``dest``, only ``dest``."""
    settle(dest.parent)
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]


def _held(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a living restore into the same destination holds it
    return fd


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["lets go", "lands"])
def test_a_pull_waits_for_a_restore_into_the_same_place_then_takes_up_what_it_left(
    first: str, tmp_path: Path
) -> None:
    """A second pull started beside a running one (or one still cleaning up after a Ctrl-C)
    made a second staging directory, moved every byte again, and the directory that lost
    the rename stayed behind for ever. Now it waits (here for an older version's restore,
    which locks only its staging directory), then adopts what the first left, or finds
    the step there when the first one lands."""
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    dest.parent.mkdir()
    left = _leftover_of(dest, k0)
    fd = _held(left)
    try:
        thread, out = _pull_in_a_thread(url, dest)
        assert out["told"].wait(30), out
        assert out["waiting"] == left
        time.sleep(0.5)  # still waiting: nothing beside the held one, nothing landed
        assert sorted(dest.parent.iterdir()) == [left]
        if first == "lands":
            os.rename(left, dest)  # (its seal), then it lets go
    finally:
        os.close(fd)  # (else: cancelled, its staging kept for the next)
    thread.join(30)
    result = out["result"]
    assert result.bytes_transferred == 0, result
    if first == "lands":
        assert result.already_there, result
    else:
        assert result.chunks_resumed == result.chunks_total, result
    assert tree_bytes(dest) == tree_bytes(k0)
    _only_the_destination_left(dest)


def test_a_pull_that_lands_sweeps_older_leftovers_of_its_destination(tmp_path: Path) -> None:
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    dest.parent.mkdir()
    older = _leftover_of(dest, k0, "0000000a")
    then = time.time() - 60
    os.utime(older, (then, then))
    _leftover_of(dest, k0, "0000000b")  # the newest: adopted
    result = run(pull(open_test_store(url), dest, PullPlan("j", 1), options=OPTS))
    assert result.chunks_resumed == result.chunks_total
    _only_the_destination_left(dest)


@pytest.mark.timeout(60)
def test_a_pull_waits_while_another_holds_the_destination_and_says_who(tmp_path: Path) -> None:
    """Two pulls into one destination started together each made a staging directory and
    fetched everything; the one that lost the rename failed and left its staging behind.
    The one that finds the destination locked waits, naming the holder."""
    from transfer.engine.staging import lock_destination

    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    held = lock_destination(dest)  # as a running restore into dest holds it
    try:
        thread, out = _pull_in_a_thread(url, dest)
        assert out["told"].wait(30), out
        assert out["waiting"] == held.path and f"pid {os.getpid()}" in out["holder"], out
        time.sleep(0.5)
        assert sorted(dest.parent.iterdir()) == [held.path]  # nothing started beside it
    finally:
        held.release()
    thread.join(30)
    assert out["result"].bytes_transferred > 0, out
    assert tree_bytes(dest) == tree_bytes(k0)
    _only_the_destination_left(dest)


@pytest.mark.timeout(60)
def test_pulls_into_one_destination_started_together_move_the_bytes_once(tmp_path: Path) -> None:
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out" / "step_000001"
    pulls = [_pull_in_a_thread(url, dest) for _ in range(3)]
    for thread, _ in pulls:
        thread.join(30)
    results = [out.get("result", out.get("error")) for _, out in pulls]
    assert all(not isinstance(r, BaseException) for r in results), results
    assert sorted(r.already_there for r in results) == [False, True, True], results
    fetched = [r for r in results if not r.already_there]
    assert sum(r.bytes_transferred for r in results) == fetched[0].bytes_transferred > 0
    assert tree_bytes(dest) == tree_bytes(k0)
    _only_the_destination_left(dest)


def _step_files(url: str) -> list[Any]:
    """The files of the store's step 1, as a pull lists them."""
    from transfer.engine.pull import resolve_plan
    from transfer.engine.pullplan import merged_files

    return merged_files(run(resolve_plan(open_test_store(url), PullPlan("j", 1))))


def _reads_counted(monkeypatch: pytest.MonkeyPatch, each: Any = None) -> list[str]:
    """The chunks the already-there check reads back (the real reads, counted; ``each``
    runs before every one)."""
    from transfer.engine import localcheck

    real, reads = localcheck.read_local_chunk, []

    def counted(root: Path, path: str, *args: Any) -> Any:
        reads.append(path)
        if each is not None:
            each()
        return real(root, path, *args)

    monkeypatch.setattr(localcheck, "read_local_chunk", counted)
    return reads


def test_a_directory_missing_a_file_of_the_step_is_refused_before_a_byte_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory holding most of the step (a copy someone stopped) was read, gigabytes of
    it, before the pull refused it for the file it lacks: every file's presence and size is
    looked at first, and nothing is read once one is missing."""
    from transfer.errors import DestinationError

    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out"
    shutil.copytree(k0, dest)
    (dest / ".metadata").unlink()
    reads = _reads_counted(monkeypatch)
    with pytest.raises(
        DestinationError, match=r"is not empty, and not j step 1 \(.metadata: missing"
    ):
        run(pull(open_test_store(url), dest, PullPlan("j", 1), options=OPTS))
    assert reads == []
    # the same directory whole: every chunk read back, nothing fetched
    shutil.copy2(k0 / ".metadata", dest / ".metadata")
    result = run(pull(open_test_store(url), dest, PullPlan("j", 1), options=OPTS))
    assert result.already_there and len(reads) == result.chunks_total, (result, reads)


def test_a_cancelled_already_there_check_stops_after_the_chunk_it_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the check of a directory already holding the step (a thread reading
    it back) went unheeded until the whole step was read. Cancelled, the check stops after
    the chunk it is on."""
    import asyncio

    from transfer.engine.pull import _checked_there

    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out"
    shutil.copytree(k0, dest)
    files = _step_files(url)
    assert sum(len(f.chunks) for f in files) >= 4  # (room to tell one read from all)
    began, release = threading.Event(), threading.Event()

    def first_read_waits() -> None:  # (until the check is cancelled: no race with a timer)
        began.set()
        assert release.wait(30)

    reads = _reads_counted(monkeypatch, first_read_waits)

    async def go() -> None:
        task = asyncio.ensure_future(_checked_there(dest, files, "j step 1", False))
        assert await asyncio.to_thread(began.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()  # the chunk it is on is read, then it stops

    run(go())  # (its end waits for the check's thread)
    assert len(reads) == 1, reads


def test_fsync_of_a_step_already_there_flushes_only_its_files(tmp_path: Path) -> None:
    """``--fsync`` on a pull that finds the step already there flushed the user's whole
    directory: a symlink loop beside the step failed it (ELOOP) and a FIFO hung it. Only
    the step's files, and their directories, are flushed."""
    url, k0 = _store_with(tmp_path)
    dest = tmp_path / "out"
    shutil.copytree(k0, dest)
    os.mkfifo(dest / "a-fifo")  # (opened for reading, it blocks until a writer comes)
    os.symlink("loop", dest / "loop")
    out: dict[str, Any] = {}

    def go() -> None:
        plan = PullPlan("j", 1, fsync=True)
        out["result"] = run(pull(open_test_store(url), dest, plan, options=OPTS))

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # (let it go, if the FIFO holds it: open it for writing once)
        with contextlib.suppress(OSError):
            os.close(os.open(dest / "a-fifo", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the pull hung (on a FIFO beside the step?)")
    assert out["result"].already_there, out
