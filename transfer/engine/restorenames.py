"""The hidden names a restore leaves beside its destination ``<dir>/<name>``: one home, so
the staging sweep, the settle pass, the hot dir's listing and the prefetch agree on them.

- ``.<name>.ferry-staging-<hex8>``: a restore's own staging directory (resumable);
  ``.<name>.ferry-staging-fill-<hex8>`` / ``-unsynced-<hex8>``: scratch, swept, never resumed.
- ``.<name>.ferry-unsynced``: the marker of a restore renamed into place before its bytes
  reached the disk (transfer/engine/settle.py).
- ``.<name>.ferry-lock``: held (``flock``) by the one restore into ``<name>`` at a time,
  which removes it when it ends; it names the holder's pid and host (staging.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

UNSYNCED_MARK = ".ferry-unsynced"
STAGING_MARK = ".ferry-staging-"  # hidden dirs of unfinished restores (swept at start)
LOCK_MARK = ".ferry-lock"


def staging_path(dest: Path, kind: str = "") -> Path:
    """A new hidden name beside ``dest`` for work toward it: a restore's own staging
    (``kind`` empty: resumable), or ``fill-`` / ``unsynced-`` scratch (swept, never
    resumed). Only the staging sweep and ``leftovers`` parse these names."""
    return dest.parent / f".{dest.name}{STAGING_MARK}{kind}{secrets.token_hex(4)}"


def lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{LOCK_MARK}"


def marker_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{UNSYNCED_MARK}"
