"""The hot dir's layout (agent/node/hotdir.py): which entries are checkpoints, which are
committed. Every module that looks at the hot dir goes through it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.node.hotdir import IN_PROGRESS_SECONDS, HotDir, step_dir_name
from transfer.errors import FormatError


def _step(root: Path, job: str, step: int, *, committed: bool = True) -> Path:
    path = root / job / step_dir_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if committed:
        (path / ".metadata").write_bytes(b"m")
    return path


def test_checkpoints_are_visible_committed_step_dirs_newest_first(tmp_path: Path) -> None:
    hot = HotDir(tmp_path, ".metadata")
    for step in (20, 100, 60):
        _step(tmp_path, "job-a", step)
    _step(tmp_path, "job-a", 120, committed=False)  # training is still writing it
    (tmp_path / "job-a" / ".step_000140.ferry-staging-1").mkdir()  # a pull in progress
    (tmp_path / "job-a" / "notes").mkdir()  # no step's name
    os.symlink(tmp_path / "job-a" / "step_000020", tmp_path / "job-a" / "step_000200")
    assert [c.step for c in hot.checkpoints("job-a")] == [100, 60, 20]
    assert sorted(d.step for d in hot.step_dirs("job-a")) == [20, 60, 100, 120]
    assert hot.checkpoints("job-b") == []  # no directory yet
    assert hot.step_path("job-a", 7) == tmp_path / "job-a" / "step_000007"


def test_only_a_name_that_ends_in_its_step_is_a_step(tmp_path: Path) -> None:
    """A directory beside the saves whose name holds digits elsewhere (a model's size, a
    year) is not a step: the agent would push ``llama-7b`` as step 7."""
    hot = HotDir(tmp_path, ".metadata")
    for name in ("checkpoint-500", "global_step42", "iter_0000300", "step_000060"):
        (tmp_path / "job-a" / name).mkdir(parents=True)
        (tmp_path / "job-a" / name / ".metadata").write_bytes(b"m")
    for name in ("llama-7b", "run2024v3", "eval_v2_results"):
        (tmp_path / "job-a" / name).mkdir()
        (tmp_path / "job-a" / name / ".metadata").write_bytes(b"m")
    assert sorted(c.step for c in hot.checkpoints("job-a")) == [42, 60, 300, 500]


def test_jobs_skip_hidden_symlinked_and_misnamed_directories(tmp_path: Path) -> None:
    hot = HotDir(tmp_path, ".metadata")
    _step(tmp_path, "job-a", 1)
    _step(tmp_path, ".ferry", 1)  # the agent's state dir
    (tmp_path / "bad name!").mkdir()
    os.symlink(tmp_path / "job-a", tmp_path / "job-link")
    (tmp_path / "job-file").write_text("not a directory")
    assert hot.jobs() == ["job-a"]
    assert [(c.job, c.step) for c in hot.all_checkpoints()] == [("job-a", 1)]
    assert HotDir(tmp_path / "missing", ".metadata").jobs() == []


def test_a_job_name_that_would_leave_the_hot_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="invalid job name"):
        HotDir(tmp_path, ".metadata").job_path("../elsewhere")


def test_a_peer_never_reads_a_chunk_through_a_symlink(tmp_path: Path) -> None:
    """What a peer serves comes from the hot dir's own files: a symlink planted in it (to a
    file outside, say) is never followed, as the restore's reads of a local copy."""
    from agent.peers.chunks import read_at, read_verified
    from transfer.format.chunkid import chunk_id

    real = tmp_path / "real"
    real.write_bytes(b"0123456789")
    link = tmp_path / "link"
    link.symlink_to(real)
    assert read_at((str(real), 2, 5)) == b"23456"
    assert read_verified((str(real), 0, 10), chunk_id(b"0123456789")) == b"0123456789"
    assert read_verified((str(real), 0, 10), chunk_id(b"something else")) is None
    assert read_at((str(link), 2, 5)) is None
    assert read_at((str(real), 8, 5)) is None  # short: not every byte is there


def test_the_watcher_says_when_two_directories_name_one_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.node.watcher import scan_hot_dir

    hot = HotDir(tmp_path, ".metadata")
    first = _step(tmp_path, "job-a", 10)
    _, found = scan_hot_dir(hot)
    assert [c.path for c in found] == [first] and "names step" not in caplog.text
    twin = tmp_path / "job-a" / "checkpoint-10"
    twin.mkdir()
    (twin / ".metadata").write_bytes(b"m")
    _, found = scan_hot_dir(hot, frozenset({first}))
    assert [c.path for c in found] == [twin]
    assert f"{twin} names step 10 of job job-a, as step_000010 does" in caplog.text


def test_saves_the_watcher_would_never_push_are_named_with_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer's trial copied saves into a running agent's hot dir without a job's
    directory, under a job name with a space, and as ``latest``: nothing was pushed and
    nothing said so. Each is now named, once, with what to do."""
    import asyncio
    import logging

    from agent.node.watcher import watch_hot_dir

    hot = HotDir(tmp_path, ".metadata")
    _step(tmp_path, "llama", 20)  # where it belongs: no warning
    _step(tmp_path, "sweep-3", 40)  # a job named like a step (found in review): no warning
    (tmp_path / "llama" / "notes").mkdir()  # no save in it: no warning
    loose = _step(tmp_path, ".", 160)  # right in the hot dir
    spaced = _step(tmp_path, "my job", 160).parent
    latest = _step(tmp_path, "llama", 180).rename(tmp_path / "llama" / "latest")
    # a save written under a temporary name, renamed to its step's once whole: no warning,
    # unless it has sat there whole for ten minutes (a crash before the rename)
    _step(tmp_path, "llama", 200).rename(tmp_path / "llama" / "step_000200.tmp")
    stuck = _step(tmp_path, "llama", 220).rename(tmp_path / "llama" / "step_000220.partial")
    long_ago = time.time() - IN_PROGRESS_SECONDS - 5
    os.utime(stuck / ".metadata", (long_ago, long_ago))
    found = dict(hot.misplaced())
    assert "whole for 10 minutes and not renamed" in found.pop(stuck)
    assert set(found) == {loose.resolve(), spaced, latest}
    assert "a save right in the hot dir" in found[loose.resolve()]
    assert "not a job name" in found[spaced] and "names no step" in found[latest]

    async def watch_twice() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            watch_hot_dir(hot, lambda *_: None, poll_seconds=0.02, stop=stop)
        )
        await asyncio.sleep(0.2)  # several polls
        stop.set()
        await task

    with caplog.at_level(logging.WARNING, logger="agent.node.watcher"):
        asyncio.run(watch_twice())
    said = [r.getMessage() for r in caplog.records if "names no step" in r.getMessage()]
    assert len(said) == 1 and str(latest) in said[0]  # once, however many polls
