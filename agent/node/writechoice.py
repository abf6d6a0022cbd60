"""What an agent's write probe chose for its disk, left for the one-shot CLI on that node.

An agent probes its hot dir's disk at start both ways (agent/node/prefetch.py
``measure_disk``) and, under ``write_path = "auto"``, buffers its restores where the page
cache took the bytes at least as fast as the device. A one-shot ``ferry pull`` cannot afford
that probe (64 MiB written a few times each way, per command), so it went warm everywhere,
and on a node where buffered is the faster way it paid for it (issue 32: a cold pull of a
289 MB save 0.76 s warm, 0.61 s buffered). So the agent leaves what it chose, per device,
in the user's state dir, and a CLI pull under ``auto`` into a directory on that device takes
it; with no record (no agent here, another device, a record from before the last boot or
older than ``MAX_AGE_SECONDS``) it goes warm, as before.

The record is a choice between two correct ways to write, never a guarantee: a file that
cannot be read, or holds anything unexpected, is no record. Keyed by the kernel's boot id
and the device number (device numbers may be given out anew at boot)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.node.journal import default_state_dir

#: the record's file, in ``default_state_dir()``: {"<boot id>:<st_dev>": {...}}
RECORD_NAME = "write-probe.json"
#: a choice older than this is not taken (the disk's neighbours, or its host, change)
MAX_AGE_SECONDS = 7 * 24 * 3600.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def record_choice(
    directory: Path,
    page_cache_first: bool,
    direct_rate: float,
    buffered_rate: float,
    state_dir: Path | None = None,
) -> None:
    """Leave what the probe of ``directory``'s disk chose (records of an earlier boot are
    dropped); raises OSError where the state dir cannot be written (the caller logs it)."""
    path = (state_dir or default_state_dir()) / RECORD_NAME
    boot = _boot_id()
    kept = {k: v for k, v in _read(path).items() if boot and k.startswith(f"{boot}:")}
    kept[_key(boot, directory)] = {
        "page_cache_first": page_cache_first,
        "direct_mbps": round(direct_rate / 1e6),
        "buffered_mbps": round(buffered_rate / 1e6),
        "directory": str(directory),
        "at": time.time(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # a file of its own, renamed over the record: agents of one user may write at once
    fd, tmp = tempfile.mkstemp(prefix=f".{RECORD_NAME}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(kept, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def recorded_choice(directory: Path, state_dir: Path | None = None) -> bool | None:
    """``page_cache_first`` as an agent's probe of ``directory``'s disk chose it this boot,
    at most MAX_AGE_SECONDS ago; None when there is no such record. ``directory`` need not
    exist yet: its nearest existing parent's device is the one a restore writes to."""
    boot = _boot_id()
    if not boot:
        return None
    try:
        key = _key(boot, _existing(directory))
    except OSError:
        return None
    found = _read((state_dir or default_state_dir()) / RECORD_NAME).get(key)
    if not isinstance(found, dict):
        return None
    first, at = found.get("page_cache_first"), found.get("at")
    if not isinstance(first, bool) or not isinstance(at, int | float):
        return None
    return first if 0 <= time.time() - at <= MAX_AGE_SECONDS else None


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _key(boot: str, directory: Path) -> str:
    return f"{boot}:{os.stat(directory).st_dev}"


def _existing(directory: Path) -> Path:
    """``directory``, or its nearest existing parent."""
    here = directory.absolute()
    while not here.exists() and here.parent != here:
        here = here.parent
    return here


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""
