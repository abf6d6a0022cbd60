"""What an agent's write probe chose for its disk, left for the one-shot CLI on that node.

An agent probes its hot dir's disk at start both ways (agent/node/prefetch.py
``measure_disk``) and, under ``write_path = "auto"``, buffers its restores where the page
cache took the bytes at least as fast as warm's write and read-back. A one-shot ``ferry
pull`` cannot afford that probe (64 MiB written a few times each way, per command), so it
went warm everywhere, and on a node where buffered is the faster way it paid for it (issue
32: a cold pull of a 289 MB save 0.76 s warm, 0.61 s buffered). So the agent leaves what it
chose, per device, in the state dir (statedir.py), and a CLI pull under ``auto`` into a
directory on that device takes it; with no record (no agent here, another state dir or
mount namespace, another device, a record older than ``MAX_AGE_SECONDS``, or one whose
probed directory is gone: a demo's agent) it goes warm, as before.

One file per boot, ``write-probe/<boot id>.json`` ({"<st_dev>": {...}}): device numbers are
given out anew at boot, and nodes that share a home directory (NFS) each keep their own.
The record chooses between two correct ways to write, never more: a state dir that cannot
be read or written, or a file that holds anything unexpected, is no record, and costs the
CLI only the choice. (A tmpfs or overlay device number may be reused within a boot by
another file system: the choice may then be the other one's, at a cost in speed only.)"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from agent.node.statedir import default_state_dir

#: the records' directory, in the state dir
RECORDS = "write-probe"
#: a choice older than this is not taken (the disk's neighbours, or its host, change), and
#: another boot's file older than this is removed
MAX_AGE_SECONDS = 7 * 24 * 3600.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: what an unusable state dir or record raises: none of it fails a pull or a probe
_UNUSABLE = (OSError, ValueError, RuntimeError)  # (RuntimeError: no home; RecursionError)


def record_choice(
    directory: Path,
    page_cache_first: bool,
    direct_rate: float,
    buffered_rate: float,
    state_dir: Path | None = None,
    *,
    read_rate: float | None = None,
) -> None:
    """Leave what the probe of ``directory``'s disk chose; raises OSError, ValueError or
    RuntimeError where it cannot (the caller logs it)."""
    import tempfile  # (only an agent writes: not on the CLI's start)

    boot = _boot_id()
    if not boot:
        return
    records = (state_dir or default_state_dir()) / RECORDS
    records.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = records / f"{boot}.json"
    try:
        kept = _read(path)
    except _UNUSABLE:  # (not a record: replaced by one)
        kept = {}
    kept[str(os.stat(directory).st_dev)] = {
        "page_cache_first": page_cache_first,
        "direct_mbps": round(direct_rate / 1e6),
        "buffered_mbps": round(buffered_rate / 1e6),
        "read_mbps": None if read_rate is None else round(read_rate / 1e6),
        "directory": str(directory),
        "at": time.time(),
    }
    # a file of its own, renamed over the record: agents of one user may write at once
    fd, tmp = tempfile.mkstemp(prefix=f".{boot}.", suffix=".tmp", dir=records)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(kept, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _forget_old(records, keep=path)


def recorded_choice(device: int, state_dir: Path | None = None) -> bool | None:
    """``page_cache_first`` as an agent's probe of a directory on ``device`` (st_dev)
    chose it this boot, at most MAX_AGE_SECONDS ago; None when there is no such record."""
    try:
        boot = _boot_id()
        if not boot:
            return None
        found = _read((state_dir or default_state_dir()) / RECORDS / f"{boot}.json")
    except _UNUSABLE:
        return None
    entry = found.get(str(device))
    if not isinstance(entry, dict):
        return None
    first, at, probed = entry.get("page_cache_first"), entry.get("at"), entry.get("directory")
    if (
        not isinstance(first, bool)
        or not isinstance(at, int | float)
        or not isinstance(probed, str)
    ):
        return None
    if not 0 <= time.time() - at <= MAX_AGE_SECONDS or not _still_there(probed, device):
        return None
    return first


def _still_there(directory: str, device: int) -> bool:
    """Whether the directory the agent probed is still there, on ``device``: a demo's or a
    benchmark's agent, whose hot dir went with it, vouches for nothing after."""
    try:
        return os.stat(directory).st_dev == device
    except OSError:
        return False


def _read(path: Path) -> dict[str, Any]:
    """The record at ``path``, {} when there is none or it is not one. Opened without
    blocking, and only a regular file read (a FIFO there must not hang a pull)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        doc = json.loads(f.read(1 << 20))
    return doc if isinstance(doc, dict) else {}


def _forget_old(records: Path, keep: Path) -> None:
    """Other boots' records (and writers' leftovers) not written for MAX_AGE_SECONDS."""
    now = time.time()
    for path in records.iterdir():
        with contextlib.suppress(OSError):
            if path != keep and now - path.lstat().st_mtime > MAX_AGE_SECONDS:
                path.unlink()


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""
