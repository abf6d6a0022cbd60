"""How fast a restore can write to a directory's disk: measured, not assumed.

A restore's time is set by the slower of its source and the disk it writes to. The
source is probed or measured by every transfer; the destination disk was not, and on a
node whose volume is slower than its network (a shared or network-attached volume) an
estimate made from the source alone was 2-4x short (issue 32). ``probe_write`` writes what
a restore writes, through the restore's own writer (engine/staging.py ``StagingFiles``:
O_DIRECT or buffered as engine/writepath.py chooses, buffered spells while the device
falls behind), chunk-sized blocks from several threads at once, into one scratch file.

The figure is the same one every restore reports (``PullResult.bytes_written`` over
``write_busy_seconds``: the wall time some write was in progress), so the probe's first
rate and each restore's re-measurement of it mean one thing.

A direct probe can also read its file back past the page cache (``read_back``): a warm
restore (engine/writepath.py) has the kernel read every chunk back after its O_DIRECT
write, so its disk does the bytes' work twice, and whether the page cache is the cheaper
way depends on that read too (writepath.page_cache_first).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from transfer.directio import aligned, open_direct
from transfer.engine.staging import StagingFiles
from transfer.format.manifest import ChunkRef, FileEntry

#: big enough that the device, not the first request, sets the pace (at 280 MB/s: 0.24 s;
#: at 2 GB/s: 35 ms), small enough to run at every agent start
PROBE_BYTES = 64 << 20
#: the scratch file, hidden (a dot name: never a checkpoint); a killed probe's is replaced
PROBE_NAME = ".ferry-write-probe"
#: the most of the hot dir's free space a probe may take for a moment (training may be
#: saving beside it: a probe that filled a small disk failed a save with ENOSPC), and the
#: least worth writing (less says nothing of the device: the default rate stands)
PROBE_FREE_SHARE = 1 / 16
PROBE_MIN_BYTES = 8 << 20


def probe_size(directory: Path, block: int = 4 << 20) -> int:
    """Bytes a probe of ``directory``'s disk may write now: PROBE_BYTES, or less where the
    disk has little free (whole blocks); 0 where too little is free to probe at all."""
    free = shutil.disk_usage(directory).free
    nbytes = min(PROBE_BYTES, int(free * PROBE_FREE_SHARE)) // block * block
    return nbytes if nbytes >= PROBE_MIN_BYTES else 0


class DiskProbe(NamedTuple):
    """One probe round: bytes written, the wall seconds some write was in progress, and
    the seconds reading them back past the page cache took (None: not read back, or the
    file system or device refused to read them so)."""

    written: int
    busy_seconds: float
    read_seconds: float | None = None


def probe_write(
    directory: Path,
    *,
    direct: bool,
    workers: int,
    block: int = 4 << 20,
    nbytes: int = PROBE_BYTES,
    read_back: bool = False,
) -> DiskProbe:
    """Write ``nbytes`` in ``block``-sized chunks from ``workers`` threads into a scratch
    file in ``directory`` (removed after), as a restore writes. Nothing is flushed after,
    as a restore does not wait for its buffered bytes (they are settled later); an
    O_DIRECT write is on the device when it returns. ``read_back``: then read the file
    back with O_DIRECT, as many blocks at once as there are writers."""
    path = directory / PROBE_NAME
    offsets = range(0, nbytes, block)
    chunks = tuple(
        ChunkRef(f"probe-{i}", min(block, nbytes - at), "raw", 0, 0, 0)
        for i, at in enumerate(offsets)
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    data = aligned(block)  # page-aligned, as a restore's reader buffers are
    data[:] = os.urandom(block)
    read_seconds = None
    try:
        out = StagingFiles(directory, [FileEntry(PROBE_NAME, nbytes, 0o600, chunks)], False, direct)
        with out, ThreadPoolExecutor(max(1, workers), thread_name_prefix="ferry-probe") as pool:
            list(pool.map(lambda at: out.pwrite(0, at, data[: min(block, nbytes - at)]), offsets))
        if read_back:
            read_seconds = _read_direct(path, block, nbytes, workers)
    finally:
        path.unlink(missing_ok=True)
    return DiskProbe(out.bytes_written, out.busy_seconds, read_seconds)


def _read_direct(path: Path, block: int, nbytes: int, workers: int) -> float | None:
    """Seconds to read ``path``'s ``nbytes`` with O_DIRECT from ``workers`` threads, one
    aligned buffer each, touched before the clock starts (a fresh page's first fault is no
    disk time); None where the file system or the device will not read it so: the rule
    then weighs the write alone (writepath.page_cache_first)."""
    offsets = list(range(0, nbytes, block))
    count = max(1, min(workers, len(offsets)))
    try:
        fd = open_direct(path, os.O_RDONLY)
    except OSError:
        return None
    if fd is None:  # (a file system without direct I/O)
        return None
    try:
        buffers = [aligned(block) for _ in range(count)]
        for buffer in buffers:
            buffer[:] = bytes(block)
        began = time.monotonic()
        with ThreadPoolExecutor(count, thread_name_prefix="ferry-probe") as pool:
            lanes = [
                pool.submit(_read_lane, fd, buffers[i], offsets[i::count]) for i in range(count)
            ]
            for lane in lanes:
                lane.result()
        return time.monotonic() - began
    except OSError:  # (a read the device refuses, memory it cannot map: no figure)
        return None
    finally:
        os.close(fd)


def _read_lane(fd: int, buffer: memoryview, offsets: list[int]) -> None:
    for at in offsets:
        os.preadv(fd, [buffer], at)


def write_rate(nbytes: int, busy_seconds: float) -> float | None:
    """The rate a disk took ``nbytes`` at, written over ``busy_seconds`` of wall time with
    some write in progress; None when that is too little, or too quick, to say."""
    if nbytes < (1 << 20) or busy_seconds <= 1e-4:
        return None
    return nbytes / busy_seconds
