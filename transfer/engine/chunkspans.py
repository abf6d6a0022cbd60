"""Where a push cuts a file into chunks: at the items of a DCP storage file, else every
``chunk_size`` bytes.

Why: a survivor of a resize loads its ranks' share, and a pull fetches and decodes whole
chunks. DCP's save planner spreads the items every rank reads (the optimizer's step
counters and param_groups, replicated tensors such as a tensor-parallel LayerNorm's:
~1-10 KB each) over every rank's file, between the big ones, so at fixed 4 MiB chunks each
of them cost a survivor a whole chunk: 3.3x its share on the real-training corpus at the
same world size (bench/results/share_amplification.md). Cut so that small items lie in
chunks of small items only, the same shares cost 1.00-1.01x.

How the items are found, with no torch and no ``.metadata`` (only the coordinator's node
has that file; every node pushes its own ``__<rank>_<n>.distcp``): DCP writes each item as
one ``torch.save`` archive, back to back from offset 0, and each archive is a zip that
ends with its end-of-central-directory record. ``item_ends`` walks the file for those
records, taking one only when the archive it ends starts where the last one ended (a local
header there) and its central directory sits right before the zip64 record or the end
record, as a zip's does. Reading every byte for them cost a push of the corpus 1.5 CPU-s
(and the GIL its workers wanted): a tensor item's head says how long its data is (its
``data.pkl``'s storage: element count and type, read by the inert unpickler that reads
``.metadata``), so the walk reads the head, skips the data and looks for the end record
in the few hundred bytes after it; an item whose head it does not understand (a dtype it
does not know, a byte item) is searched through instead, in windows growing from 64 KiB:
20 ms for a 211 MB rank file of the corpus in the page cache, against 190 ms searching
it all. A false match costs nothing but a cut
(chunks are content addressed wherever they are cut); a file that is not such a sequence
has no item ends, and is cut every ``chunk_size`` bytes as before.

The rule (``spans``): items under GROUP_BYTES are grouped, in file order, into chunks of
small items only, up to GROUP_BYTES (the file cannot say which items every rank reads:
a step counter or a replicated LayerNorm looks like a weight's shard, so every small item
is kept away from the big ones); consecutive bigger items are grouped up to
``chunk_size`` bytes, cut at item boundaries, and one bigger than ``chunk_size`` is cut
alone every ``chunk_size`` bytes from its start; what follows the last item is cut every
``chunk_size`` bytes. Every cut is then moved to a page boundary (a chunk of small items
growing, so that none of them lies in a big one's chunk: ``_page_aligned``). On the
corpus (1.69 GB, 8 ranks): 1,721 chunks instead of 408, and
the shares of 8, 4, 2 and 16 new ranks cost 1.00-1.01x of their bytes (``python -m
bench.share_amplification``). Keeping apart only what the heads show to be shared (byte
items and 0-d tensors) made 752 chunks, but left the tests' drill, whose replicated 8 KB
tensors sat in 4 MiB chunks, at 3.3x. Successive saves of one job put their items at the
same offsets, so a chunk's base (the earlier step's chunk at the same offset) covers the
same items.
"""

from __future__ import annotations

import io
import itertools
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transfer.directio import ALIGN
from transfer.engine.dcp import _InertUnpickler
from transfer.engine.scan import open_source, shrank

#: items under this many bytes are small (see the rule), grouped up to this many bytes
GROUP_BYTES = 64 << 10

#: the storage files of a DCP save (``__<rank>_<n>.distcp``): the only files scanned
DCP_SUFFIX = ".distcp"

#: the first and the largest window of an item searched through
FIRST_WINDOW = 64 << 10
SCAN_WINDOW = 16 << 20

#: an item's head: its records before the data (~600 bytes for a tensor)
HEAD_BYTES = 4096
#: bytes after a tensor's data that hold its last records and end record (~1 KB)
TAIL_BYTES = 8192

#: element sizes of the storage classes torch.save names (torch/storage.py); another
#: name (a dtype this does not know) has its item searched through instead
_ITEMSIZE = {
    **dict.fromkeys(("ByteStorage", "CharStorage", "BoolStorage", "QUInt8Storage",
                     "QInt8Storage", "Float8_e4m3fnStorage", "Float8_e5m2Storage",
                     "Float8_e4m3fnuzStorage", "Float8_e5m2fnuzStorage"), 1),
    **dict.fromkeys(("ShortStorage", "HalfStorage", "BFloat16Storage", "UInt16Storage"), 2),
    **dict.fromkeys(("IntStorage", "FloatStorage", "QInt32Storage", "UInt32Storage"), 4),
    **dict.fromkeys(("LongStorage", "DoubleStorage", "ComplexFloatStorage",
                     "UInt64Storage"), 8),
    "ComplexDoubleStorage": 16,
}  # fmt: skip

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_END = b"PK\x05\x06"
_END64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes: ... name and extra lengths
_END_RECORD = struct.Struct("<4sHHHHIIH")  # 22 bytes
_LOCATOR_BYTES = 20
_END64_FIELDS = struct.Struct("<QQ")  # the zip64 record's CD size and offset, at +40

Span = tuple[int, int]  # (offset, length)
ReadAt = Callable[[int, int], bytes]


def chunk_spans(path: Path, size: int, chunk_size: int) -> list[Span]:
    """The chunks a push makes of the file at ``path`` (``size`` bytes, as scanned)."""
    ends = scan_item_ends(path, size) if path.name.endswith(DCP_SUFFIX) else []
    return spans(size, ends, chunk_size)


def fixed_spans(size: int, chunk_size: int) -> list[Span]:
    """Every ``chunk_size`` bytes from 0: format version 2's only layout."""
    return [(o, min(chunk_size, size - o)) for o in range(0, size, chunk_size)]


def spans(size: int, item_ends: Sequence[int], chunk_size: int) -> list[Span]:
    """The chunks of a file of ``size`` bytes whose items end at ``item_ends`` (ascending,
    the first item starting at 0), by the rule in the module's docstring."""
    if not item_ends:
        return fixed_spans(size, chunk_size)
    return _page_aligned(_grouped(size, item_ends, chunk_size), size, chunk_size)


def _grouped(size: int, item_ends: Sequence[int], chunk_size: int) -> list[tuple[int, bool]]:
    """The rule's cuts: (where each chunk ends, whether it holds small items)."""
    out: list[tuple[int, bool]] = []
    small_below = min(GROUP_BYTES, chunk_size)
    group_start, group_small = 0, False  # the items gathered so far: [group_start, start)
    start = 0
    for end in item_ends:
        small = end - start < small_below
        limit = small_below if small else chunk_size
        if start > group_start and (small != group_small or end - group_start > limit):
            out.append((start, group_small))
            group_start = start
        group_small = small
        if end - start >= chunk_size:  # alone
            out.extend((start + o + n, False) for o, n in fixed_spans(end - start, chunk_size))
            group_start = end
        start = end
    if start > group_start:
        out.append((start, group_small))
    out.extend((start + o + n, False) for o, n in fixed_spans(size - start, chunk_size))
    return out


def _page_aligned(cuts: list[tuple[int, bool]], size: int, chunk_size: int) -> list[Span]:
    """The cuts moved to page boundaries, a chunk of small items growing over its
    neighbours' edges rather than leaving its own in them: a restore writes each chunk's
    page-aligned interior with O_DIRECT and its edges through the page cache, and a cold
    pull of the corpus cut at the items' own offsets spent 5x as long in its writes (edge
    pages written buffered beside direct writes to the same file wait on them)."""
    bounds = [0]
    for i, (end, small) in enumerate(cuts[:-1]):
        grows_right = small and not cuts[i + 1][1]
        edge = -(-end // ALIGN) * ALIGN if grows_right else end // ALIGN * ALIGN
        if edge > bounds[-1]:
            bounds.append(min(edge, size))
    if size > bounds[-1]:
        bounds.append(size)
    step = max(ALIGN, chunk_size // ALIGN * ALIGN)
    out: list[Span] = []
    for lo, hi in itertools.pairwise(bounds):
        out.extend((o, min(step, hi - o)) for o in range(lo, hi, step))
    return out


def scan_item_ends(path: Path, size: int) -> list[int]:
    """Where each of the back-to-back zip archives from the start of the file ends (see the
    module's docstring); [] when the file does not start with one."""
    fd = open_source(path)
    try:
        return item_ends(lambda offset, n: _read_at(fd, path, offset, n), size)
    finally:
        os.close(fd)


def item_ends(read_at: ReadAt, size: int) -> list[int]:
    """``scan_item_ends`` over ``read_at(offset, n)`` (exactly n bytes) of ``size`` bytes."""
    ends: list[int] = []
    kinds: dict[tuple[str, str], type] = {}
    start = 0  # of the archive being walked
    while start + len(_LOCAL) <= size and read_at(start, len(_LOCAL)) == _LOCAL:
        end = _end_past_data(read_at, size, start, kinds) or _end_searched(read_at, size, start)
        if end is None:
            break  # a torn last item: the rest is cut at fixed offsets
        ends.append(end)
        start = end
    return ends


def _end_past_data(
    read_at: ReadAt, size: int, start: int, kinds: dict[tuple[str, str], type]
) -> int | None:
    """The end of the tensor item at ``start``, found after its data, which its head
    places; None when the head is not one this understands or no end lies where it says."""
    head = read_at(start, min(HEAD_BYTES, size - start))
    data = _tensor_data(head, kinds)
    if data is None:
        return None
    after = start + data[0] + data[1]
    if after > size:
        return None
    tail = read_at(after, min(TAIL_BYTES, size - after))
    found = tail.find(_END)
    while found != -1 and found + _END_RECORD.size <= len(tail):
        end = _archive_end(read_at, tail, after, start, after + found)
        if end is not None:
            return end
        found = tail.find(_END, found + 1)
    return None


def _end_searched(read_at: ReadAt, size: int, start: int) -> int | None:
    """The end of the item at ``start``, searched for through the bytes after it, in
    windows that start small (a byte item is ~1 KB: a 16 MiB first window made a scan of
    a save with 2,200 of them read 37 GB) and double up to SCAN_WINDOW."""
    window_at, span = start, FIRST_WINDOW
    while window_at < size:
        # an end record that starts in this window is read whole with it
        n = min(span + _END_RECORD.size, size - window_at)
        window = read_at(window_at, n)
        found = window.find(_END)
        while 0 <= found < span and found + _END_RECORD.size <= n:
            end = _archive_end(read_at, window, window_at, start, window_at + found)
            if end is not None:
                return end
            found = window.find(_END, found + 1)
        window_at += span
        span = min(2 * span, SCAN_WINDOW)
    return None


class _StorageIds(_InertUnpickler):
    """Unpickles a tensor's ``data.pkl`` inertly, keeping the storages it names. ``kinds``:
    the stand-in classes made so far, kept for one file's walk (a new class per name and
    item cost the walk of a 211 MB rank file 20 ms of its 40)."""

    def __init__(self, data: bytes, kinds: dict[tuple[str, str], type]) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: list[Any] = []
        self.kinds = kinds

    def find_class(self, module: str, name: str) -> type:
        kind = self.kinds.get((module, name))
        if kind is None:
            kind = self.kinds[module, name] = super().find_class(module, name)
        return kind

    def persistent_load(self, pid: Any) -> Any:
        self.storages.append(pid)
        return None


def _tensor_data(head: bytes, kinds: dict[tuple[str, str], type]) -> tuple[int, int] | None:
    """(where the data starts from the item's first byte, its length) of a tensor item
    whose head (its first HEAD_BYTES) holds ``data.pkl`` and the data record's header."""
    pickled = _record(head, 0)
    if pickled is None or not pickled[0].endswith(b"data.pkl"):
        return None
    reader = _StorageIds(head[pickled[1] :], kinds)
    try:
        reader.load()
    except Exception:  # anything a pickle can raise: this item is searched through instead
        return None
    if len(reader.storages) != 1:
        return None
    pid = reader.storages[0]
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        return None
    _, kind, key, _location, numel = pid
    itemsize = _ITEMSIZE.get(getattr(kind, "__name__", ""))
    if not isinstance(key, str) or type(numel) is not int or numel < 0 or itemsize is None:
        return None
    name = f"/data/{key}".encode()
    at = head.find(_LOCAL, pickled[1])
    while at != -1:
        record = _record(head, at)
        if record is not None and record[0].endswith(name):
            return record[1], numel * itemsize
        at = head.find(_LOCAL, at + 1)
    return None


def _record(head: bytes, at: int) -> tuple[bytes, int] | None:
    """(name, where its bytes start) of the zip local header at ``at`` in ``head``."""
    if head[at : at + 4] != _LOCAL or at + _LOCAL_HEADER.size > len(head):
        return None
    fields = _LOCAL_HEADER.unpack_from(head, at)
    name_len, extra_len = fields[-2], fields[-1]
    start = at + _LOCAL_HEADER.size
    if start + name_len + extra_len > len(head):
        return None
    return head[start : start + name_len], start + name_len + extra_len


def _archive_end(read_at: ReadAt, window: bytes, window_at: int, start: int, at: int) -> int | None:
    """The end of the zip archive that starts at ``start``, if the end record at ``at``
    (``window``'s bytes from ``window_at`` hold it) is that archive's; else None."""

    def read(offset: int, n: int) -> bytes:  # from the window, where it holds them
        if window_at <= offset and offset + n <= window_at + len(window):
            return window[offset - window_at : offset - window_at + n]
        return read_at(offset, n)

    _sig, disk, cd_disk, entries_here, entries, cd_size, cd_offset, comment = (
        _END_RECORD.unpack_from(window, at - window_at)
    )
    if disk or cd_disk or entries_here != entries or comment:
        return None
    end64 = None
    locator_at = at - _LOCATOR_BYTES
    if locator_at >= start and read(locator_at, 4) == _LOCATOR64:
        end64 = start + struct.unpack("<Q", read(locator_at + 8, 8))[0]
        if not start <= end64 <= locator_at - 56 or read(end64, 4) != _END64:
            return None
        cd_size, cd_offset = _END64_FIELDS.unpack(read(end64 + 40, 16))
    cd_at = start + cd_offset
    if cd_at + cd_size != (end64 if end64 is not None else at) or cd_size < 46:
        return None
    if read(cd_at, 4) != _CENTRAL:
        return None
    return at + _END_RECORD.size


def _read_at(fd: int, path: Path, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise shrank(path)
    return data
