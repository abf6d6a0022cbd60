"""Standby replicas held in memory, so that the load after the decision reads memory.

Why (issue 32): a standby has the step before the decision, but by then the page cache has
moved on (the training process's own reads and allocations, or simply time), and the load
reads the replica from the disk: the 289 MB fine-tune's load took 0.13 s of the standby's
0.15 s wait reading the disk, against 0.07 s from memory, and no faster disk read can meet
"the load alone". So a standby's agent maps each job's newest replica and locks it in
memory: ``mlock(2)`` of a read-only shared mapping of each file's data, the page cache's own
pages (no second copy; holes of a partial copy are never mapped, so they cost nothing).

What it may take: what the node can spare (``writepath.spare_memory``: MemAvailable less a
reserve, halved; a container's memory limit counts), and at most ``standby_memory`` bytes
(0: never). A replica that does not fit is left on the disk, as before. What gives it back:

- the job's next replica (one per job), the job unregistered, the agent stopping;
- the node running short: checked every ``CHECK_SECONDS``, every replica is let go as soon
  as MemAvailable falls under the reserve (the training process comes first);
- the replica leaving the hot dir (a resident replica is a step in use, ``StepHolds``:
  hot retention keeps it, as it keeps any step a prefetch reads).

Where locking is refused (an agent without CAP_IPC_LOCK past its RLIMIT_MEMLOCK) the
populated mapping is kept instead: mapped pages survive a cache drop and are reclaimed
after unmapped ones, but nothing guarantees them; the status says ``"locked": false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.daemon.logs import event
from agent.node.protected import StepHolds
from transfer.directio import ThreadBuffers
from transfer.engine.warmcache import allocated_bytes, data_ranges, tree_files
from transfer.engine.writepath import spare_memory

log = logging.getLogger(__name__)

#: how often a node holding replicas checks that it can still spare the memory
CHECK_SECONDS = 1.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


@dataclass
class Resident:
    """One replica held in memory."""

    job: str
    step: int
    path: Path
    nbytes: int  # mapped: the files' data, holes left out
    locked: bool  # False: mapped and read in, not locked (mlock refused)
    maps: list[tuple[int, int]] = field(default_factory=list)  # (address, length)
    #: (device, inode) of the directory and of each file mapped: a replica replaced under
    #: its path (a share filled in, the step restored anew) is let go, not kept locked
    identity: dict[Path, tuple[int, int]] = field(default_factory=dict)
    release_hold: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "bytes": self.nbytes, "locked": self.locked}


class ResidentReplicas:
    """The replicas this node holds in memory, one per job. Used from the event loop; the
    mapping (which reads the files in) and the unmapping run in threads; ``watch`` checks,
    every ``CHECK_SECONDS`` whatever else runs, that the node can still spare them."""

    def __init__(self, limit: int | None, holds: StepHolds) -> None:
        #: the most bytes held in all; None: only what the node can spare; 0: none
        self.limit = limit
        self.holds = holds
        self._held: dict[str, Resident] = {}

    async def keep(self, job: str, step: int, path: Path) -> Resident | None:
        """Hold ``path`` (``job``'s replica of ``step``) in memory instead of the job's
        previous one, if it fits; the replica held, or None."""
        await self.release(job, "replaced")
        if self.limit == 0:
            return None
        files = await asyncio.to_thread(tree_files, path)
        nbytes = await asyncio.to_thread(allocated_bytes, files)
        room = spare_memory()
        if self.limit is not None and room is not None:
            room = min(room, self.limit - sum(r.nbytes for r in self._held.values()))
        if room is None or nbytes > room:
            event(log, "resident", job=job, step=step, action="left on disk", bytes=nbytes,
                  room=room)  # fmt: skip
            return None
        # a step in use from here on: hot retention keeps it (StepHolds, on the loop)
        hold = contextlib.ExitStack()
        hold.enter_context(self.holds.hold((job, step)))
        stop = threading.Event()
        mapping = asyncio.ensure_future(asyncio.to_thread(_mapped, job, step, path, files, stop))
        try:
            resident = await asyncio.shield(mapping)
        except asyncio.CancelledError:  # the thread maps on until it sees ``stop``: then
            stop.set()  # what it mapped is let go as soon as it returns
            mapping.add_done_callback(_unmap_when_done)
            hold.close()
            raise
        except OSError as exc:
            hold.close()
            log.warning("could not hold %s in memory: %s", path, exc)
            return None
        if resident is None:
            hold.close()
            event(log, "resident", job=job, step=step, action="left on disk", bytes=nbytes,
                  why="the node ran short of memory while it was read in")  # fmt: skip
            return None
        resident.release_hold = hold
        if job in self._held:  # (kept again meanwhile: the newer call's replica stays)
            await self._let_go(resident, "replaced")
            return None
        self._held[job] = resident
        event(log, "resident", job=job, step=step, action="held", bytes=resident.nbytes,
              locked=resident.locked)  # fmt: skip
        return resident

    async def release(self, job: str, why: str) -> bool:
        """Let ``job``'s replica go (its pages stay in the cache, reclaimable)."""
        resident = self._held.pop(job, None)
        if resident is None:
            return False
        await self._let_go(resident, why)
        return True

    async def release_all(self, why: str) -> None:
        for job in list(self._held):
            await self.release(job, why)

    async def watch(self, stop: asyncio.Event) -> None:
        """``check`` every ``CHECK_SECONDS`` until ``stop`` (its own task: a slow store or a
        replica being read in never holds the memory back from the training process)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHECK_SECONDS):
                    await stop.wait()
            try:
                await self.check()
            except OSError as exc:  # (a stat refused: tried again in a second)
                log.warning("could not check the replicas held in memory: %s", exc)

    async def check(self) -> None:
        """Let every replica go if the node cannot spare the memory any more, and any that
        is gone from its path or was replaced there."""
        if not self._held:
            return
        if spare_memory() == 0:  # (MemAvailable under the reserve: the training comes first)
            await self.release_all("the node is short of memory")
            return
        for job, resident in list(self._held.items()):
            if not await asyncio.to_thread(_unchanged, resident):
                await self.release(job, "gone from the hot dir, or replaced there")

    def held(self) -> dict[str, Resident]:
        return dict(self._held)

    async def _let_go(self, resident: Resident, why: str) -> None:
        await asyncio.to_thread(_unmap, resident)
        resident.release_hold.close()
        event(log, "resident", job=resident.job, step=resident.step, action="released",
              why=why)  # fmt: skip


#: the most one mapping reads in at once: the mapping stops between pieces when asked to,
#: or when the node runs short meanwhile
PIECE_BYTES = 256 << 20


def _mapped(
    job: str, step: int, path: Path, files: list[Path], stop: threading.Event
) -> Resident | None:
    """``files`` of ``path`` mapped (read in as they are) and locked while locking works;
    None when ``stop`` was set or the node ran short of memory before the end."""
    resident = Resident(job, step, path, 0, True)
    try:
        resident.identity[path] = _identity(path)
        for file in files:
            if not _map(resident, file, stop):
                _unmap(resident)
                return None
    except BaseException:
        _unmap(resident)
        raise
    return resident


def _map(resident: Resident, file: Path, stop: threading.Event) -> bool:
    """Map each run of ``file``'s data into ``resident``, a piece at a time; lock it while
    locking works. False: stopped (``stop``, or the node short of memory)."""
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        resident.identity[file] = (info.st_dev, info.st_ino)
        for offset, length in data_ranges(fd):
            start = offset - offset % mmap.PAGESIZE
            end = offset + length
            for at in range(start, end, PIECE_BYTES):
                if stop.is_set() or spare_memory() == 0:
                    return False
                size = min(PIECE_BYTES, end - at)
                flags = mmap.MAP_SHARED | _MAP_POPULATE
                address = _libc.mmap(None, size, mmap.PROT_READ, flags, fd, at)
                if address in (None, _MAP_FAILED):
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"{file}: mmap: {os.strerror(errno)}")
                resident.maps.append((address, size))
                resident.nbytes += size
                _touch(fd, at, size)
                if resident.locked and _libc.mlock(address, size) != 0:
                    errno = ctypes.get_errno()
                    log.warning("could not lock %s in memory (%s): kept mapped, not locked",
                                resident.path, os.strerror(errno))  # fmt: skip
                    _unlock(resident)
    finally:
        os.close(fd)
    return True


#: what ``_touch`` reads at a time, into each thread's reused buffer
_TOUCH_BYTES = 1 << 20
_touch_buffers = ThreadBuffers()


def _touch(fd: int, offset: int, size: int) -> None:
    """Read the range once, from this CPU, through the file (not the mapping: a file cut
    short meanwhile is a short read here, where the mapping would raise SIGBUS; and the
    GIL is let go): pages the disk's DMA filled were first read by a load slowly on this
    VM (1.69 GB: 2.1-2.5 s the first time after the replica was held, 0.6-0.8 s the next;
    once read, the first is as fast)."""
    view, end = _touch_buffers.view("touch", _TOUCH_BYTES), offset + size
    while offset < end:
        n = os.preadv(fd, [view[: min(_TOUCH_BYTES, end - offset)]], offset)
        if n <= 0:
            return
        offset += n


def _identity(path: Path) -> tuple[int, int]:
    info = os.stat(path, follow_symlinks=False)
    return info.st_dev, info.st_ino


def _unchanged(resident: Resident) -> bool:
    """Whether the directory and every file mapped are still the ones at their paths."""
    try:
        return all(_identity(p) == known for p, known in resident.identity.items())
    except OSError:
        return False


def _unmap_when_done(mapping: asyncio.Future[Resident | None]) -> None:
    """A cancelled ``keep``'s mapping, once its thread has returned: let it go."""
    if mapping.cancelled() or mapping.exception() is not None:
        return
    resident = mapping.result()
    if resident is not None:
        _unmap(resident)


def _unlock(resident: Resident) -> None:
    """Keep ``resident`` mapped, unlocked (the lock of a part only would mislead)."""
    resident.locked = False
    for address, size in resident.maps:
        _libc.munlock(address, size)


def _unmap(resident: Resident) -> None:
    for address, size in resident.maps:
        _libc.munmap(address, size)  # (unlocks too)
    resident.maps.clear()
