"""Items of a load filling up as a restore's chunks land, handed on whole, in bounded memory.

A restore into memory (memrestore.py) hands over verified chunks in pack order from several
threads; a loader (dcpreader_torch.py) wants whole items, the byte slices of storage files
that it deserialises one at a time. ``ItemAssembly`` sits between them: ``landed`` (the
restore's threads) copies each chunk's bytes into the buffers of the items it overlaps, and
``whole_items`` (the loader's thread) yields each item the moment its last byte is in.

Memory: an item's buffer is made at its first byte and recycled once the loader is done
with it. While more than ``budget`` bytes of buffers are live and the loader has whole
items still to take, a thread that would start a new item waits (the restore's readers
then stop reading), so a loader slower than the network bounds the restore instead of
holding the whole share twice. The wait never blocks progress: it ends as soon as the
loader has nothing whole left to take, whatever is live.
"""

from __future__ import annotations

import bisect
import itertools
import queue
import threading
from collections import defaultdict
from collections.abc import Iterator

from transfer.codec.transforms import Buffer
from transfer.errors import FerryError, FormatError

#: (storage file, offset, length): one stored item, which one or more reads narrow
Slice = tuple[str, int, int]

DEFAULT_BUDGET = 512 << 20


class Abandoned(FerryError):
    """The loader stopped taking items (it failed): the restore must end."""


class ItemAssembly:
    _END: Slice = ("", -1, -1)

    def __init__(self, slices: list[Slice], budget: int = DEFAULT_BUDGET) -> None:
        by_path: dict[str, list[Slice]] = defaultdict(list)
        self._left = {s: s[2] for s in slices}
        for s in sorted({s for s in slices if s[2] > 0}, key=lambda s: (s[0], s[1], s[2])):
            by_path[s[0]].append(s)
        self._by_path = dict(by_path)
        self._starts = {p: [s[1] for s in items] for p, items in by_path.items()}
        # the furthest end of the items up to each one: where a chunk's first overlap may
        # begin, even if one item overlaps the next (DCP's do not; a crafted plan may)
        self._reach = {
            p: list(itertools.accumulate((s[1] + s[2] for s in items), max))
            for p, items in by_path.items()
        }
        self._buffers: dict[Slice, memoryview] = {}
        self._recycled = _Recycled(keep=budget)
        self._budget = budget
        self._live = 0  # bytes of item buffers made and not yet recycled
        self._whole_waiting = 0  # whole items the loader has not taken yet
        self._cond = threading.Condition()
        self._whole: queue.SimpleQueue[Slice] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._abandoned = False
        for s, n in self._left.items():
            if n == 0:
                self._put_whole(s)

    def landed(self, path: str, offset: int, data: Buffer) -> None:
        """(A restore's thread, never the loader's: it may wait for the loader to take
        items.) Bytes of ``path`` at ``offset``, into the items they overlap."""
        if self._abandoned:
            raise Abandoned("the load stopped taking items")
        items = self._by_path.get(path)
        if not items:
            return
        end = offset + len(data)
        view = memoryview(data).cast("B")
        i = bisect.bisect_right(self._reach[path], offset)  # first item reaching past offset
        stop = bisect.bisect_left(self._starts[path], end)  # first item starting at or past end
        for key in items[i:stop]:
            lo, hi = max(offset, key[1]), min(end, key[1] + key[2])
            if lo >= hi:
                continue
            buf = self._buffer(key)
            buf[lo - key[1] : hi - key[1]] = view[lo - offset : hi - offset]
            with self._cond:
                self._left[key] -= hi - lo
                if self._left[key] == 0:
                    self._put_whole(key)

    def _buffer(self, key: Slice) -> memoryview:
        with self._cond:
            while True:  # (re-checked after each wait: another thread may have made it)
                buf = self._buffers.get(key)
                if buf is not None:
                    return buf
                if self._abandoned:
                    raise Abandoned("the load stopped taking items")
                if self._live <= self._budget or not self._whole_waiting:
                    break
                self._cond.wait()
            buf = self._buffers[key] = self._recycled.take(key[2])
            self._live += key[2]
            return buf

    def _put_whole(self, key: Slice) -> None:
        self._whole_waiting += 1
        self._whole.put(key)

    def ended(self, exc: BaseException | None) -> None:
        """The restore ended: with ``exc``, or None when every chunk landed."""
        self._error = exc
        self._whole.put(self._END)

    def abandon(self) -> None:
        """The loader failed: threads waiting for room, and any that land more, stop."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def whole_items(self) -> Iterator[tuple[Slice, memoryview]]:
        """Each item as it becomes whole, its buffer recycled when the caller asks for the
        next; raises the restore's error, if any."""
        todo = len(self._left)
        while todo:
            key = self._whole.get()
            if key == self._END:
                if self._error is not None:
                    raise self._error
                left = sum(1 for n in self._left.values() if n)
                raise FormatError(f"the step's chunks left {left} item(s) incomplete")
            todo -= 1
            with self._cond:
                self._whole_waiting -= 1
                data = self._buffers.pop(key, None)
                self._cond.notify_all()
            if data is None:  # an empty item: nothing landed
                yield key, memoryview(bytearray(0))
                continue
            yield key, data
            self._recycled.give(data)
            with self._cond:
                self._live -= key[2]
                self._cond.notify_all()

    @property
    def live_bytes(self) -> int:
        return self._live


class _Recycled:
    """Item buffers handed back once loaded and given out again: fresh pages cost a fault
    each (bench/page_cost.py: 0.7-1.0 ms per MiB of new anonymous memory on this VM), and a
    load's items come and go one after another. Keeps at most ``keep`` bytes idle."""

    def __init__(self, keep: int) -> None:
        self._idle: list[bytearray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        with self._lock:
            fits = [b for b in self._idle if n <= len(b) <= 2 * n + (4 << 20)]
            if fits:
                buf = min(fits, key=len)
                self._idle.remove(buf)
                return memoryview(buf)[:n]
        return memoryview(bytearray(n))

    def give(self, view: memoryview) -> None:
        buf = view.obj
        assert isinstance(buf, bytearray)
        view.release()
        with self._lock:
            self._idle.append(buf)
            while sum(len(b) for b in self._idle) > self._keep:
                self._idle.remove(min(self._idle, key=len))
