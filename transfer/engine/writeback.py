"""Start writing a file range back to disk now, without waiting for it (Linux only).

Why: a pull fsyncs every file before it renames the checkpoint into place, and on a fresh
pull nearly all of it is still dirty page cache at that point: the final fsync then waits for
the whole checkpoint to reach the disk (~0.3 s per GB here) after the network is done.
Kicking off writeback as each chunk lands overlaps the disk with the download, so the fsync
finds little left to do. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` only queues the I/O; it
makes no durability promise (the fsync still does that), so failing to call it is harmless.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

_SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int], None]:
    if not sys.platform.startswith("linux"):
        return lambda fd, offset, length: None
    try:
        # the symbols already loaded (libc's among them): find_library("c") would run
        # `ldconfig -p` in a subprocess on every start (~25-50 ms, more when cold)
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, length: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, length: int) -> None:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # ctypes releases the GIL meanwhile

    return start


start_writeback = _load()
