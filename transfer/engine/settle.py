"""Restores renamed into place before they reach the disk, and how they get there safely.

Why: a pull used to fsync every file before renaming its staging directory into place. On
a fresh restore most of the checkpoint is still dirty page cache at that point, so the
caller waited for all of it to reach the disk after the download was done; plain copy
tools (s5cmd, cp) do not wait. A restore is a copy of a checkpoint the store still holds:
a crash may cost a re-fetch, never data. What must never happen is a torn copy that looks
whole after a reboot.

The rule (docs/RELIABILITY.md, "Restores and crashes"):
1. Before the rename, a marker ``.<name>.ferry-unsynced`` holding this boot's id is made
   durable beside the destination (fsync of the marker and of the directory).
2. The rename; the kernel writes the data back on its own (writeback was started as each
   chunk landed: transfer/engine/writeback.py).
3. ``settle(parent)`` later looks at every marker there. Same boot: the pages are either on
   disk or still in memory, so fsync the restore's files (cheap by then) and drop the marker.
   Another boot (the machine went down before step 3): the restore may be torn, so it is
   removed (renamed to a staging name first, so an interrupted removal is swept like any
   staging directory) and its marker dropped.
The agent settles its hot dir before it serves and after each prefetch; ``ferry pull``
settles the destination's parent before it starts. Without a boot id (not Linux) a pull
fsyncs before the rename, as ``--fsync`` asks.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

from transfer.durable import fsync_dir
from transfer.engine.restorenames import UNSYNCED_MARK, marker_path, staging_path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def mark_unsynced(dest: Path, boot: str) -> None:
    """Step 1: the durable marker for a restore about to be renamed into ``dest``."""
    marker = marker_path(dest)
    tmp = marker.with_name(f"{marker.name}.tmp-{secrets.token_hex(4)}")
    doc = {"boot_id": boot, "dest": dest.name, "created": time.time()}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, marker)
    fsync_dir(dest.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and root itself)."""
    for here, dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(here))
        del dirs  # walked by os.walk itself


def settle(parent: Path) -> list[Path]:
    """Step 3 for every restore under ``parent`` that still has a marker. Returns the
    restores removed because they were made before the last reboot."""
    removed: list[Path] = []
    try:
        markers = [p for p in parent.iterdir() if p.name.endswith(UNSYNCED_MARK)]
    except FileNotFoundError:
        return removed
    current = boot_id()
    for marker in markers:
        dest = parent / marker.name[1 : -len(UNSYNCED_MARK)]
        try:
            made_in = json.loads(marker.read_text()).get("boot_id")
        except FileNotFoundError:
            continue  # another settle of this directory (a prefetch beside) dropped it first
        except (OSError, ValueError, AttributeError):
            made_in = None  # unreadable: assume the worst
        if dest.is_dir() and not dest.is_symlink():
            if made_in is not None and made_in == current:
                try:
                    fsync_tree(dest)
                except FileNotFoundError:
                    continue  # being evicted right now: its eviction drops it
            else:
                doomed = staging_path(dest, "unsynced-")
                os.rename(dest, doomed)
                fsync_dir(parent)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(dest)
        marker.unlink(missing_ok=True)
        fsync_dir(parent)
    return removed
