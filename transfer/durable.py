"""Durable local writes: the one fsync of a directory that every layer needs (the local
store's commits, a pull's rename into place, a prefetch's moves). Here, not in the local
store, so that the engine and the agent never import a concrete store."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or create in ``path`` durable (and visible to NFS clients)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
