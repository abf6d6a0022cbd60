"""Writes that bypass the page cache (``O_DIRECT``), for files written once and not read
back soon: a local or NFS store's packs, and a restore's staging files
(engine/staging.py, which also says when a restore falls back to buffered writes).

Why: a buffered write copies every byte into freshly allocated page-cache pages, which the
kernel then writes back and the commit's fsync waits for anyway. On the 2-core benchmark
VM that copy was 25% of a local delta push's CPU samples (``copy_folio_from_iter_atomic``,
~2.5 CPU s for 1.27 GB of packs), more than zstd. A direct write moves the bytes from one
reused, page-aligned buffer straight to the device (one user-space copy into it, at
memcpy speed; none when the caller's memory is page-aligned already: ``aligned``, as a
restore's reader buffers are); the fsync then has only metadata left. Measured (a local
delta push of a 1.69 GB save, warm page cache, 4 alternated rounds each): the push's system
time 3.3-3.9 -> 1.3-1.5 CPU s, wall 5.9-6.3 -> 5.0-5.2 s.

O_DIRECT needs the file offset, the length and the memory address aligned (to the
device's logical block; a page, ALIGN, satisfies every Linux file system). Only the aligned
interior of a write goes direct; its unaligned head and tail (a pack's last few bytes) go
through the buffered descriptor (and, with ``yield_to_reads``, every write while the
process reads from its disks: DeviceReads). A block is therefore only ever written one
way, and the kernel keeps the two views coherent. Where the file system refuses O_DIRECT
(tmpfs) every write is buffered.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import sys
import threading
import time
from pathlib import Path

ALIGN = 4096
#: one aligned buffer per writer thread (its pages are touched only as far as parts reach);
#: a part goes through it in slices this big. A local delta push of a 1.69 GB save, warm,
#: alternated: 4 MiB slices 5.32-6.09 s, 16 MiB 4.99-5.16 s (fewer, larger device writes)
SLICE = 16 << 20
_buffers = threading.local()


class DeviceReads:
    """Whether this process is reading from its disks right now: then direct writes would
    compete with those reads (a cold push reading its source), where buffered ones wait
    for the commit's fsync and let the reads go first. Measured: a cold local delta push
    took 6.6 s buffered and 7.5 s direct (median of 6, alternated), a warm one 6.0 s and
    5.0 s. ``/proc/self/io``'s ``read_bytes`` counts what the process made the block
    layer read (page-cache hits excluded); where it cannot be read, never busy."""

    #: more read from disk than this since the previous look: busy
    BUSY_BYTES = 1 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = self._read_bytes()

    def busy(self) -> bool:
        now = self._read_bytes()
        with self._lock:
            grew, self._last = now - self._last, max(now, self._last)
        return grew > self.BUSY_BYTES

    @staticmethod
    def _read_bytes() -> int:
        try:
            with open("/proc/self/io", "rb") as fh:
                for line in fh:
                    if line.startswith(b"read_bytes:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0


device_reads = DeviceReads()


def open_direct(path: Path, access: int = os.O_WRONLY) -> int | None:
    """A second, O_DIRECT descriptor for writing ``path`` (which exists; ``access``
    ``os.O_RDONLY``: for reading it), or None where the file system or platform does not
    do direct I/O."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, access | os.O_NOFOLLOW | flag)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def write_at(
    buffered_fd: int,
    direct_fd: int | None,
    offset: int,
    data: bytes | bytearray | memoryview,
    yield_to_reads: bool = True,
) -> None:
    """All of ``data`` at ``offset``: the aligned interior through ``direct_fd`` (when
    given and, with ``yield_to_reads``, while this process is not reading from disk:
    DeviceReads), the rest through ``buffered_fd``."""
    view = memoryview(data).cast("B")
    end = offset + len(view)
    lo = min(end, -(-offset // ALIGN) * ALIGN)
    hi = max(lo, end // ALIGN * ALIGN)
    if direct_fd is None or hi == lo or (yield_to_reads and device_reads.busy()):
        _pwrite_all(buffered_fd, view, offset)
        return
    _pwrite_all(buffered_fd, view[: lo - offset], offset)
    interior = view[lo - offset : hi - offset]
    pos = lo
    try:
        if is_aligned(interior):  # the caller's memory is aligned too: no copy
            _pwrite_all(direct_fd, interior, lo)
            pos = hi
        buf = _aligned_buffer() if pos < hi else interior
        while pos < hi:
            n = min(SLICE, hi - pos)
            buf[:n] = view[pos - offset : pos - offset + n]
            _pwrite_all(direct_fd, buf[:n], pos)
            pos += n
    except OSError as exc:
        # a device whose blocks are larger than ALIGN refuses the write before doing any
        # of it: the rest goes buffered
        if exc.errno != errno.EINVAL:
            raise
        _pwrite_all(buffered_fd, view[pos - offset : hi - offset], pos)
    _pwrite_all(buffered_fd, view[hi - offset :], hi)


def aligned(size: int) -> memoryview:
    """``size`` bytes of page-aligned, writable memory (an anonymous map), for buffers a
    direct write may take as they are."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


class BufferPool:
    """Page-aligned buffers that threads and restores done with them hand back, given out
    again to the next: on a VM whose free memory goes back to its host, each fresh page
    costs a fault into the host (1-2.3 ms of system time per MiB, warmcache.py), and a
    restore's threads took 183 MB of fresh buffers per pull (289 MB fine-tune holding k:
    38 buffers of the reader threads, 21 of the decoders; 17% of the pull's CPU samples
    were page faults). Buffers are made in whole MiB, so one fits the next few sizes;
    idle ones are kept up to ``max_idle`` bytes, and all let go once none was taken or
    given for ``idle_seconds`` (an agent between prefetches keeps nothing for long).
    Thread-safe."""

    ROUND = 1 << 20

    def __init__(self, max_idle: int, idle_seconds: float) -> None:
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        #: handed back by a thread's buffers as they are freed (``_Held.__del__``): a
        #: garbage collection may free them in any thread at any moment, one inside
        #: ``take`` holding the lock among them, so they are only appended here (a
        #: deque's append takes no lock of ours) and taken in by the next take or give
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._used_at = 0.0
        self._timer: threading.Timer | None = None

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes (its contents undefined). When none idle
        fits, as many idle bytes as the new one takes are let go first (the smallest
        first), so that the pool never adds to what a process's restores hold at once
        (tests/test_load.py holds an agent's peak RSS to its transfers' budget)."""
        rounded = max(self.ROUND, -(-size // self.ROUND) * self.ROUND)
        with self._lock:
            self._take_in_returned()
            self._used_at = time.monotonic()
            fits = [m for m in self._free if len(m) >= size]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
            self._free.sort(key=len)
            freed = 0
            while self._free and freed < rounded:
                freed += len(self._free.pop(0))  # (unmapped as its last reference goes)
        return self._new(rounded)

    def _new(self, size: int) -> mmap.mmap:
        """Fresh memory: the one place the pool makes any (what its tests count)."""
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        """Hand ``buf`` back: nothing may write into it or read from it any more."""
        with self._lock:
            self._take_in_returned()
            self._used_at = time.monotonic()
            self._keep(buf)
            if self._free and self._timer is None:
                self._timer = threading.Timer(self.idle_seconds, self._expire)
                self._timer.daemon = True
                self._timer.start()

    def returned(self, buf: mmap.mmap) -> None:
        """``give`` for a finalizer: never blocks, never starts a thread."""
        if not sys.is_finalizing():
            self._returned.append(buf)

    def idle_bytes(self) -> int:
        with self._lock:
            self._take_in_returned()
            return sum(len(m) for m in self._free)

    def _take_in_returned(self) -> None:
        while self._returned:
            self._keep(self._returned.popleft())

    def _keep(self, buf: mmap.mmap) -> None:
        if sum(len(m) for m in self._free) + len(buf) <= self.max_idle:
            self._free.append(buf)  # (else let go: unmapped once its last view is gone)

    def _expire(self) -> None:
        with self._lock:
            self._timer = None
            left = self._used_at + self.idle_seconds - time.monotonic()
            if left <= 0:
                self._free.clear()
                return
            self._timer = threading.Timer(left, self._expire)
            self._timer.daemon = True
            self._timer.start()


#: the process's: a restore's buffers, given out again to the next restore's threads. It
#: keeps nothing idle unless told to (``max_idle``): a one-shot command or a training
#: process's load has no next restore; the agent keeps one transfer's memory budget
#: (agent/rpc/app.py), which the next prefetch takes instead of faulting in fresh pages:
#: 22-28% less CPU per prefetch of the 289 MB fine-tune on this VM (0.82 -> 0.62-0.64
#: CPU-s holding k, 0.91 -> 0.64-0.67 onto an empty node, ``bench.decision_to_loaded``'s
#: first round against the next two)
POOL = BufferPool(max_idle=0, idle_seconds=120.0)
#: the most an agent keeps idle in POOL
KEPT_BUFFERS_MAX = 128 << 20


class _Held:
    """A thread's buffer, handed back to POOL when the thread (or its ThreadBuffers) is
    gone, or when the thread needs a bigger one."""

    __slots__ = ("buf",)

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf

    def __del__(self) -> None:
        POOL.returned(self.buf)


class ThreadBuffers(threading.local):
    """Buffers a worker thread reuses from chunk to chunk, by name, page-aligned (so a
    direct write takes what was decoded into one as it is), grown when a chunk needs more
    (from POOL, which takes the smaller one back): no allocation, and no fresh pages to
    fault in, per chunk, nor per restore once POOL holds enough."""

    def view(self, name: str, size: int) -> memoryview:
        held: _Held | None = self.__dict__.get(name)
        if held is None or len(held.buf) < size:
            held = self.__dict__[name] = _Held(POOL.take(size))
        return memoryview(held.buf)[:size]


def is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on an ALIGN boundary (False for read-only memory, whose
    address ctypes will not give)."""
    if view.readonly or not view.c_contiguous:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def _aligned_buffer() -> memoryview:
    buf: memoryview | None = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < SLICE:
        buf = _buffers.buf = memoryview(mmap.mmap(-1, SLICE))  # anonymous maps are page-aligned
    return buf


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
