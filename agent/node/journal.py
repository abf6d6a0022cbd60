"""The agent's push journal: which checkpoints this node has seen, and how far each got in
each tier, in one SQLite file under ``state_dir`` (``<hot_dir>/.ferry/journal.sqlite3``).

Per (job, step, node, tier) a row moves ``staged`` -> ``durable``, or to ``failed`` with the
error text (then back to ``durable`` when a retry succeeds). A restarted agent resumes every
checkpoint that is not durable in every configured tier (``pending``).

Resumption is per checkpoint, and within one per pack: a resumed push runs again, and
everything an earlier attempt already committed is deduplicated (an unchanged re-push writes
nothing, or finds its manifest already committed). While a push runs, its resume log
(``PushResume``, the engine's ``ResumeLog``) records the chunks of each pack that becomes
durable and the receipt of each part before it is sent, so a push killed half way and run
again reuses those packs and completes the upload of the one it left unfinished; the rows go
when the push commits. ``ferry push`` keeps the same log, in a journal file of its own per
push under ``$XDG_STATE_HOME/ckpt-ferry`` (``cli_push_journal``), removed once it commits.
What a killed push sent and never recorded leaves packs that no manifest references; those
are orphans for retention/GC, never read.

Calls are short and synchronous on the event loop thread, deliberately: the file is on the
node-local disk, a write is a single small transaction (a few per checkpoint, plus one per
pack and per part while a push runs), and with WAL + ``synchronous=NORMAL`` a commit does not
fsync (only WAL checkpoints do). A killed process keeps every record it committed (the page
cache survives it); an fsync per pack record ran on the event loop and, on ext4, waited for
the packs' own dirty data (0.5 s of a 1.69 GB local push's 8 s). Losing the last commits to a
power cut is harmless (but for a step's own files, ``own_files``: written with
``synchronous=FULL``, before a prefetch adds anything beside them): a checkpoint whose
``durable`` row was lost is re-pushed and found already committed, a lost pack record only
costs re-sending that pack, and a record torn by a kill is rolled back whole (the push also
checks that each pack still exists). Staying on one thread also keeps the sqlite3
connection single-threaded (``check_same_thread`` enforces it).
SQLite's WAL needs every user of a file on one host (shared memory): the agent's state dir
must be local, and a ``ferry push`` file is only ever used by the node it is named for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transfer.engine.chunkindex import StoredChunk
from transfer.format.names import check_name, check_step
from transfer.store.base import PartReceipt

STAGED = "staged"
DURABLE = "durable"
FAILED = "failed"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pushes (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    node TEXT NOT NULL,
    tier TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('staged', 'durable', 'failed')),
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    bytes_raw INTEGER,
    bytes_transferred INTEGER,
    seconds REAL,
    result TEXT,
    staged_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (job, step, node, tier)
);
-- A push's resume log (PushResume): the chunks of each pack that became durable ...
CREATE TABLE IF NOT EXISTS durable_packs (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    node TEXT NOT NULL,
    tier TEXT NOT NULL,
    chunks TEXT NOT NULL
);
-- ... and the receipts of the parts of unfinished packs (what completing them needs),
-- written before each part is sent: a restarted push completes the upload with them where
-- ListParts omits part checksums.
CREATE TABLE IF NOT EXISTS landed_parts (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    node TEXT NOT NULL,
    tier TEXT NOT NULL,
    pack TEXT NOT NULL,
    receipt TEXT NOT NULL
);
-- Checkpoints this agent restored into the hot dir (prefetch): another node's data, never
-- to be pushed as this node's part.
CREATE TABLE IF NOT EXISTS restored (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job, step)
);
-- ... unless the restore added to this node's own part before the part was durable in every
-- tier: its files (a JSON list of paths), recorded before anything was added, are pushed
-- alone until it is.
CREATE TABLE IF NOT EXISTS own_files (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    files TEXT NOT NULL,
    PRIMARY KEY (job, step)
);
"""

_STATE_COLUMNS = (
    "job, step, node, tier, path, state, error, attempts, bytes_raw, bytes_transferred, "
    "seconds, result, staged_at, updated_at"
)


#: how long opening a journal waits for another process that is opening it too
OPEN_SECONDS = 30.0


def _open(path: Path) -> sqlite3.Connection:
    """The journal's database, in WAL mode with its tables. Two processes may open one file
    at the same moment (two ``ferry push`` runs of one step, one of which then waits on the
    other's lease): switching a new file to WAL needs it alone for a moment, and SQLite
    answers the other "database is locked" at once instead of waiting (2 in 8 runs of
    tests/test_push_pull.py's two concurrent pushes under load). Such a try is closed and
    made again, for up to OPEN_SECONDS."""
    deadline = time.monotonic() + OPEN_SECONDS
    while True:
        db = sqlite3.connect(path, timeout=1.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            busy = exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            if not busy or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


class Journal:
    """The journal of one node (``node``), stored at ``path`` (created with its directory)."""

    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self.node = check_name("node", node)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _open(path)
        self._db.row_factory = sqlite3.Row

    def close(self) -> None:
        self._db.close()

    def record_staged(self, job: str, step: int, path: Path, tiers: Sequence[str]) -> None:
        """A committed checkpoint was seen: one ``staged`` row per tier that has none yet (a
        checkpoint seen again keeps its durable/failed rows)."""
        check_name("job", job)
        check_step(step)
        now = time.time()
        with self._db:
            self._db.executemany(
                "INSERT OR IGNORE INTO pushes (job, step, node, tier, path, state, staged_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, 'staged', ?, ?)",
                [(job, step, self.node, tier, str(path), now, now) for tier in tiers],
            )

    def record_durable(self, job: str, step: int, tier: str, result: dict[str, Any]) -> None:
        """The push to ``tier`` committed; ``result`` is ``PushResult.to_dict()``."""
        with self._db:
            _forget_resume(self._db, (job, step, self.node, tier))  # its manifest has them
            self._update(
                job,
                step,
                tier,
                "state = 'durable', error = NULL, attempts = attempts + 1, bytes_raw = ?, "
                "bytes_transferred = ?, seconds = ?, result = ?",
                (
                    result.get("bytes_raw"),
                    result.get("bytes_transferred"),
                    result.get("seconds"),
                    json.dumps(result, default=str),
                ),
            )

    def resume(self, job: str, step: int, tier: str) -> PushResume:
        """The resume log of this node's push of (job, step) to ``tier``."""
        return PushResume(self._db, (job, step, self.node, tier))

    def remove(self) -> None:
        """Close the journal and delete its file (``ferry push``'s, once the push commits)."""
        self.close()
        for suffix in ("", "-wal", "-shm"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)

    def record_waiting(self, job: str, step: int, tier: str, reason: str) -> None:
        """Not pushed yet because the checkpoint is still being written: stays ``staged``
        (it will be pushed), with the reason where the error would go."""
        with self._db:
            self._update(job, step, tier, "state = 'staged', error = ?", (reason,))

    def record_failed(self, job: str, step: int, tier: str, error: str) -> None:
        with self._db:
            self._update(
                job, step, tier, "state = 'failed', error = ?, attempts = attempts + 1", (error,)
            )

    def _update(
        self, job: str, step: int, tier: str, assignments: str, values: tuple[Any, ...]
    ) -> None:
        cur = self._db.execute(
            f"UPDATE pushes SET {assignments}, updated_at = ? "
            "WHERE job = ? AND step = ? AND node = ? AND tier = ?",
            (*values, time.time(), job, step, self.node, tier),
        )
        if cur.rowcount != 1:
            raise KeyError(f"{job} step {step} tier {tier} was never staged")

    def durable_tiers(self, job: str, step: int) -> set[str]:
        rows = self._db.execute(
            "SELECT tier FROM pushes WHERE job = ? AND step = ? AND node = ? AND state = ?",
            (job, step, self.node, DURABLE),
        )
        return {r["tier"] for r in rows}

    def record_restored(self, job: str, step: int, own_files: Sequence[str] | None = None) -> None:
        """(job, step) is being restored here: it holds other nodes' data. ``own_files``:
        it held this node's own part (those files), which is still to be pushed, alone; the
        first record of them stands (taken before anything was added beside them)."""
        check_name("job", job)
        check_step(step)
        if own_files is not None:  # on the disk before anything is added beside the files
            self._db.execute("PRAGMA synchronous=FULL")  # (lost, a partial copy is not pushed)
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR IGNORE INTO restored (job, step, at) VALUES (?, ?, ?)",
                    (job, step, time.time()),
                )
                if own_files is not None:
                    self._db.execute(
                        "INSERT OR IGNORE INTO own_files (job, step, files) VALUES (?, ?, ?)",
                        (job, step, json.dumps(sorted(own_files))),
                    )
        finally:
            if own_files is not None:
                self._db.execute("PRAGMA synchronous=NORMAL")

    def own_files(self, job: str, step: int) -> tuple[str, ...] | None:
        """The files of this node's own part of a step a restore added to (record_restored),
        or None: the step's directory is all its own, or (restored) none of it is."""
        row = self._db.execute(
            "SELECT files FROM own_files WHERE job = ? AND step = ?", (job, step)
        ).fetchone()
        return None if row is None else tuple(json.loads(row["files"]))

    def pushable(self, job: str, step: int) -> bool:
        """Whether this node has a part of (job, step) to push: not restored here, or
        restored into its own part (own_files)."""
        row = self._db.execute(
            "SELECT 1 FROM restored r WHERE job = ? AND step = ? AND NOT EXISTS "
            "(SELECT 1 FROM own_files o WHERE o.job = r.job AND o.step = r.step)",
            (job, step),
        ).fetchone()
        return row is None

    def is_restored(self, job: str, step: int) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM restored WHERE job = ? AND step = ?", (job, step)
        ).fetchone()
        return row is not None

    def pending(self, tiers: Sequence[str] | None = None) -> list[tuple[str, int, Path]]:
        """(job, step, path) of every checkpoint of this node not durable in every tier of
        ``tiers`` (default: the tiers it was staged for), oldest step first."""
        rows = self._db.execute(
            "SELECT job, step, tier, path, state FROM pushes WHERE node = ? "
            "AND NOT EXISTS (SELECT 1 FROM restored r WHERE r.job = pushes.job "
            "AND r.step = pushes.step AND NOT EXISTS (SELECT 1 FROM own_files o "
            "WHERE o.job = r.job AND o.step = r.step)) ORDER BY step, job",
            (self.node,),
        )
        staged_for: dict[tuple[str, int], set[str]] = {}
        durable: dict[tuple[str, int], set[str]] = {}
        paths: dict[tuple[str, int], Path] = {}
        for r in rows:
            key = (r["job"], r["step"])
            paths[key] = Path(r["path"])
            staged_for.setdefault(key, set()).add(r["tier"])
            if r["state"] == DURABLE:
                durable.setdefault(key, set()).add(r["tier"])
        return [
            (job, step, path)
            for (job, step), path in paths.items()
            if not set(tiers if tiers is not None else staged_for[(job, step)])
            <= durable.get((job, step), set())
        ]

    def forget(self, job: str, step: int) -> None:
        """Drop every row of (job, step): its directory left the hot dir (retention evicted
        it), so there is nothing left to push, resume or exclude. Keeps the file small."""
        with self._db:
            for table in ("pushes", *_RESUME_TABLES, "restored", "own_files"):
                self._db.execute(f"DELETE FROM {table} WHERE job = ? AND step = ?", (job, step))

    def was_durable(self, job: str, step: int) -> bool:
        """Whether this node ever pushed (job, step) to a tier, or restored it from one."""
        row = self._db.execute(
            "SELECT 1 FROM pushes WHERE job = ? AND step = ? AND state = 'durable' "
            "UNION SELECT 1 FROM restored WHERE job = ? AND step = ?",
            (job, step, job, step),
        ).fetchone()
        return row is not None

    def row_count(self) -> int:
        (n,) = self._db.execute(
            "SELECT (SELECT COUNT(*) FROM pushes) + (SELECT COUNT(*) FROM durable_packs)"
            " + (SELECT COUNT(*) FROM restored) + (SELECT COUNT(*) FROM own_files)"
        ).fetchone()
        return int(n)

    def states(self) -> list[dict[str, Any]]:
        """Every row of this node, for the RPC: newest step first, tiers in staging order."""
        rows = self._db.execute(
            f"SELECT {_STATE_COLUMNS} FROM pushes WHERE node = ? ORDER BY step DESC, job, rowid",
            (self.node,),
        )
        out = []
        for r in rows:
            doc = dict(r)
            doc["result"] = json.loads(doc["result"]) if doc["result"] else None
            out.append(doc)
        return out


_RESUME_TABLES = ("durable_packs", "landed_parts")
_PUSH_KEY = "job = ? AND step = ? AND node = ? AND tier = ?"


class PushResume:
    """The resume log of one push (the engine's ``ResumeLog``): rows of the journal's
    ``durable_packs`` and ``landed_parts`` under (job, step, node, tier), one small
    transaction each (not fsynced: the module's docstring says why that is safe)."""

    def __init__(self, db: sqlite3.Connection, key: tuple[str, int, str, str]) -> None:
        self._db = db
        self._key = key

    def chunks(self) -> list[StoredChunk]:
        rows = self._db.execute(f"SELECT chunks FROM durable_packs WHERE {_PUSH_KEY}", self._key)
        return [StoredChunk(*fields) for (doc,) in rows for fields in json.loads(doc)]

    def parts(self) -> dict[str, list[PartReceipt]]:
        rows = self._db.execute(
            f"SELECT pack, receipt FROM landed_parts WHERE {_PUSH_KEY}", self._key
        )
        found: dict[str, list[PartReceipt]] = {}
        for pack_id, doc in rows:
            found.setdefault(pack_id, []).append(json.loads(doc))
        return found

    def pack_durable(self, chunks: list[StoredChunk]) -> None:
        doc = json.dumps([dataclasses.astuple(c) for c in chunks])
        with self._db:
            self._db.execute("INSERT INTO durable_packs VALUES (?, ?, ?, ?, ?)", (*self._key, doc))

    def part_sent(self, pack_id: str, receipt: PartReceipt) -> None:
        with self._db:
            self._db.execute(
                "INSERT INTO landed_parts VALUES (?, ?, ?, ?, ?, ?)",
                (*self._key, pack_id, json.dumps(receipt)),
            )

    def forget(self) -> None:
        """The push committed: its manifest references every pack."""
        with self._db:
            _forget_resume(self._db, self._key)


def _forget_resume(db: sqlite3.Connection, key: tuple[str, int, str, str]) -> None:
    for table in _RESUME_TABLES:
        db.execute(f"DELETE FROM {table} WHERE {_PUSH_KEY}", key)


def cli_push_journal(
    state_dir: Path, store_url: str, job: str, step: int, node: str, source: Path
) -> Journal:
    """The journal of one ``ferry push`` (the CLI has no agent journal), whose resume log
    (``resume(job, step, store_url)``) lets the same push, killed and run again, resume:
    one file per (store, job, step, node, source directory), so pushes never share one (not
    even across hosts that share a home directory: the node names differ)."""
    key = json.dumps([store_url, job, step, node, str(source.absolute())])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    pushes = state_dir / "pushes"
    pushes.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Journal(pushes / f"{check_name('job', job)}-{step}-{digest}.sqlite3", node)
