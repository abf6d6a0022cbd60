"""How fast a restore can write to a directory's disk: measured, not assumed.

A restore's time is set by the slower of its source and the disk it writes to. The
source is probed or measured by every transfer; the destination disk was not, and on a
node whose volume is slower than its network (a shared or network-attached volume) an
estimate made from the source alone was 2-4x short (issue 32). This writes what a restore
writes (chunk-sized blocks, from ``workers`` threads at once, through the same writer:
O_DIRECT for the aligned interior, or buffered, as engine/writepath.py chooses) into one
scratch file beside the restores and times it.

``write_rate`` turns a finished restore's own write stage (thread-seconds summed over its
writers) into the same figure, so every restore re-measures the disk it wrote to.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transfer.directio import aligned, open_direct, write_at

#: big enough that the device, not the first request, sets the pace (at 280 MB/s: 0.24 s;
#: at 2 GB/s: 35 ms), small enough to run at every agent start
PROBE_BYTES = 64 << 20
#: the scratch file, hidden (a dot name: never a checkpoint); a killed probe's is replaced
PROBE_NAME = ".ferry-write-probe"


def probe_write(
    directory: Path,
    *,
    direct: bool,
    workers: int,
    block: int = 4 << 20,
    nbytes: int = PROBE_BYTES,
) -> tuple[int, float]:
    """Write ``nbytes`` in ``block``-sized writes from ``workers`` threads into a scratch
    file in ``directory`` (removed after), as a restore writes its chunks: (bytes, seconds).
    Nothing is flushed after the writes, as a restore does not wait for its buffered
    bytes (they are settled later); an O_DIRECT write is on the device when it returns."""
    path = directory / PROBE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        direct_fd = open_direct(path) if direct else None
        buffers = threading.local()
        # buffered writers to one file take turns, as a restore's do (staging.py)
        turn = threading.Lock() if direct_fd is None else contextlib.nullcontext()

        def write(offset: int) -> None:
            view = getattr(buffers, "view", None)
            if view is None:  # one aligned, touched buffer per writer, as a restore has
                view = buffers.view = aligned(block)
                view[:] = os.urandom(block)
            n = min(block, nbytes - offset)
            with turn:
                write_at(fd, direct_fd, offset, view[:n], yield_to_reads=False)

        try:
            began = time.perf_counter()
            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="ferry-probe") as pool:
                list(pool.map(write, range(0, nbytes, block)))
            took = time.perf_counter() - began
        finally:
            if direct_fd is not None:
                os.close(direct_fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return nbytes, took


def write_rate(nbytes: int, write_thread_seconds: float, writers: int) -> float | None:
    """The disk's write rate a restore saw: ``nbytes`` written in ``write_thread_seconds``
    summed over ``writers`` threads that wrote at once (a disk that keeps up leaves them
    little time in their writes; one that does not keeps them all there). None when the
    restore wrote too little, or too fast, to say."""
    if nbytes < (1 << 20) or write_thread_seconds <= 1e-4:
        return None
    return nbytes * max(1, writers) / write_thread_seconds
