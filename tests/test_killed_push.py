"""A push killed mid-write (issue 29): SIGTERM stops it cleanly, and what a kill -9 leaves
behind is counted by ``ferry du`` and removed by ``ferry retention``, never a committed
checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import open_test_store, random_bytes, run, tree_bytes, write_file
from transfer.engine import PullPlan, pull, push
from transfer.format import layout

JOB = "j"


def _store_with_one_step(tmp_path: Path) -> tuple[str, Path]:
    """A local store holding step 1, and a step 2 slow to push (incompressible bytes at
    zstd level 19: a few seconds on these machines, so a signal lands mid-write)."""
    url = str(tmp_path / "store")
    os.mkdir(url)
    one = tmp_path / "hot" / "step_1"
    write_file(one / "a.bin", random_bytes(100_000, 1))
    run(push(open_test_store(url), one, job=JOB, step=1, node="n0"))
    two = tmp_path / "hot" / "step_2"
    write_file(two / "a.bin", random_bytes(48 << 20, 2))
    return url, two


def _pushing(url: str, src: Path) -> subprocess.Popen[str]:
    """``ferry push`` of ``src``, returned once bytes of its first pack are on disk (the temp
    file is created before the compressor emits anything; the lease's own temp file, a
    moment long, does not count)."""
    cmd = [sys.executable, "-m", "agent", "push", str(src), url, "--job", JOB,
           "--node", "n0", "--zstd-level", "19", "--full"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(_size(p) for p in _temp_files(url) if ".pack" in p.name):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the push never began a pack"
        time.sleep(0.05)
    return proc


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # renamed into its pack meanwhile
        return 0


def _temp_files(url: str) -> list[Path]:
    return [p for p in Path(url).rglob(".*") if ".tmp-" in p.name]


def _leases(url: str) -> list[Path]:
    return sorted(p for p in (Path(url) / layout.PUSH_LOCKS_PREFIX).rglob("*") if p.is_file())


def _assert_step_1_pulls(url: str, tmp_path: Path) -> None:
    dest = tmp_path / f"pulled-{time.monotonic_ns()}"
    run(pull(open_test_store(url), dest, PullPlan(JOB, 1)))
    assert tree_bytes(dest) == tree_bytes(tmp_path / "hot" / "step_1")


def test_sigterm_stops_a_push_cleanly(tmp_path: Path) -> None:
    """SIGTERM printed nothing and left the push lease and a 132-151 MB ``.pack.tmp-*``.
    Now: one line, exit 143, no lease, no temp file, step 2 not committed, step 1 intact."""
    url, two = _store_with_one_step(tmp_path)
    proc = _pushing(url, two)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    (line,) = err.strip().splitlines()
    assert line.startswith("ferry push: terminated (SIGTERM); stopped cleanly: the step is")
    assert "only if `ferry ls` lists it" in line  # (it may have been stopped as it committed)
    assert _leases(url) == [] and _temp_files(url) == []
    assert not (Path(url) / layout.manifest_key(JOB, 2, "n0")).exists()
    _assert_step_1_pulls(url, tmp_path)


def test_what_a_killed_push_leaves_is_counted_and_collected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 leaves the temp file: ``du`` said "0 B in 0 unreferenced packs" and neither a
    rerun nor ``retention --grace 0`` removed it. Now ``du`` counts it and retention, once no
    live push holds a lease, aborts it; the committed step is untouched."""
    from agent.cli.run import main as ferry

    url, two = _store_with_one_step(tmp_path)
    proc = _pushing(url, two)
    proc.kill()
    proc.wait()
    left = _temp_files(url)
    assert left and sum(p.stat().st_size for p in left) > 0

    assert ferry(["du", url]) == 0
    out = capsys.readouterr().out
    assert f"in {len(left)} unfinished pack uploads" in out.splitlines()[0]

    assert ferry(["retention", url, "--grace", "0", "--dry-run"]) == 0
    assert f"would abort {len(left)} unfinished pack uploads" in capsys.readouterr().out
    assert _temp_files(url) == left  # a dry run changes nothing

    assert ferry(["retention", url, "--grace", "0"]) == 0
    assert f"aborted {len(left)} unfinished pack uploads" in capsys.readouterr().out
    assert _temp_files(url) == []
    _assert_step_1_pulls(url, tmp_path)


def test_a_live_push_keeps_its_unfinished_upload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other side of the rule: while a push holds its lease, retention without a grace
    period aborts nothing (the upload is that push's), and the push then commits (a deleted
    temp file would fail its rename)."""
    from agent.cli.run import main as ferry

    url, two = _store_with_one_step(tmp_path)
    proc = _pushing(url, two)
    try:
        assert ferry(["retention", url, "--grace", "0"]) == 0
        out = capsys.readouterr().out
        assert "1 pushes running: without grace, none goes" in out
        assert not re.search(r"aborted [1-9]", out), out
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    dest = tmp_path / "pulled-2"
    run(pull(open_test_store(url), dest, PullPlan(JOB, 2)))
    assert tree_bytes(dest) == tree_bytes(two)
