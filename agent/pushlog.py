"""A resume log for ``ferry push`` (the CLI has no agent journal): each pack that becomes
durable in the store appends one line listing its chunks, so a push killed half way and run
again reuses those packs instead of uploading them a second time. The log is removed when
the push commits.

One file per (store, job, step, node, source directory) under ``$XDG_STATE_HOME/ckpt-ferry``
(default ``~/.local/state/ckpt-ferry``). A torn last line (a kill while appending) is skipped:
losing a record only costs an upload, and push checks that each pack still exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from transfer.engine.chunkindex import StoredChunk


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ckpt-ferry"


class PushLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_push(
        cls, state_dir: Path, store_url: str, job: str, step: int, node: str, source: Path
    ) -> PushLog:
        key = json.dumps([store_url, job, step, node, str(source.absolute())])
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cls(state_dir / "pushes" / f"{job}-{step}-{digest}.jsonl")

    def chunks(self) -> list[StoredChunk]:
        """Chunks of the packs an earlier attempt made durable."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        found: list[StoredChunk] = []
        for line in lines:
            try:
                found.extend(StoredChunk(*fields) for fields in json.loads(line))
            except (ValueError, TypeError):
                continue  # torn by a kill while appending
        return found

    def append(self, chunks: list[StoredChunk]) -> None:
        """Record one durable pack's chunks (called as each pack completes)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        line = json.dumps([dataclasses.astuple(c) for c in chunks]) + "\n"
        with open(self.path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
