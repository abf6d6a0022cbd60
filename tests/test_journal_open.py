"""Processes that open one new journal file at the same moment (two ``ferry push`` runs of
one step: the second then waits on the first's lease) all get it. SQLite answered the
others "database is locked" at once while the first switched the file to WAL: 3 of 40
rounds of three openers failed before agent/node/journal.py retried such an open (and
tests/test_push_pull.py's two concurrent pushes failed 2 runs in 8 under load)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from agent.node.journal import Journal

ROUNDS = 30
OPENERS = 3


def _open_at(path: str, start: float, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    while time.time() < start:  # all at once
        pass
    try:
        Journal(Path(path), "n").close()
        results.put("ok")
    except Exception as exc:  # reported to the test, which names it
        results.put(repr(exc))


def test_journals_opened_at_once_by_several_processes_all_open(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    failures = []
    for i in range(ROUNDS):
        path = tmp_path / str(i) / "journal.sqlite3"
        path.parent.mkdir()
        results = ctx.Queue()
        start = time.time() + 0.1
        procs = [
            ctx.Process(target=_open_at, args=(str(path), start, results)) for _ in range(OPENERS)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        failures += [r for r in (results.get(timeout=10) for _ in procs) if r != "ok"]
    assert failures == []
