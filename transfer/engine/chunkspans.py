"""Where a push cuts a file into chunks: at the items of a DCP storage file, else every
``chunk_size`` bytes.

Why: a survivor of a resize loads its ranks' share, and a pull fetches and decodes whole
chunks. DCP's save planner spreads the items every rank reads (optimizer step counters,
param_groups, replicated tensors: ~2 KB each) over every rank's file, between the big
ones, so at fixed 4 MiB chunks each of them cost a survivor a whole chunk: 3.3x its share
on the real-training corpus at the same world size (bench/results/share_amplification.md).
Cut at item boundaries, the same shares cost 1.00-1.02x.

How the items are found, with no torch and no ``.metadata`` (only the coordinator's node
has that file; every node pushes its own ``__<rank>_<n>.distcp``): DCP writes each item as
one ``torch.save`` archive, back to back from offset 0, and each archive is a zip that
ends with its end-of-central-directory record. ``item_ends`` walks the file for those
records, taking one only when the archive it ends starts where the last one ended (a local
header there) and its central directory sits right before the zip64 record or the end
record, as a zip's does. A false match costs nothing but a cut (chunks are content
addressed wherever they are cut); a file that is not such a sequence has no item ends,
and is cut every ``chunk_size`` bytes as before.

The rule (``spans``): an item of GROUP_BYTES or more (or ``chunk_size``, if smaller)
starts a chunk and is cut every ``chunk_size`` bytes from its start, its last piece ending
with it; smaller items are grouped, in file order, into chunks of at most that many bytes;
what follows the last item is cut every ``chunk_size`` bytes. On the corpus (1.69 GB, 8
ranks): 2,000 chunks instead of 408, and the shares of 8, 4, 2 and 16 new ranks cost
1.01x, 1.00x, 1.00x and 1.01x of their bytes (``python -m bench.share_amplification``).
Successive saves of one job put their items at the same offsets, so a chunk's base (the
earlier step's chunk at the same offset) is still the same item.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from transfer.engine.scan import open_source, shrank

#: items smaller than this are grouped with their small neighbours, up to this many bytes
#: per chunk: the corpus's ~2 KB items alone made 3,337 chunks where grouped they make
#: 2,000, for shares of 1.00-1.01x against 1.00x
GROUP_BYTES = 64 << 10

#: the storage files of a DCP save (``__<rank>_<n>.distcp``): the only files scanned
DCP_SUFFIX = ".distcp"

#: bytes read per scan window (one per file at a time, in the push's thread)
SCAN_WINDOW = 16 << 20

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_END = b"PK\x05\x06"
_END64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
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
    out: list[Span] = []
    group = min(GROUP_BYTES, chunk_size)  # a group is one chunk
    group_start = None  # of the small items gathered so far
    start = 0
    for end in item_ends:
        if end - start >= group:
            if group_start is not None:
                out.append((group_start, start - group_start))
                group_start = None
            out.extend((start + o, n) for o, n in fixed_spans(end - start, chunk_size))
        else:
            if group_start is not None and end - group_start > group:
                out.append((group_start, start - group_start))
                group_start = None
            if group_start is None:
                group_start = start
        start = end
    if group_start is not None:
        out.append((group_start, start - group_start))
    out.extend((start + o, n) for o, n in fixed_spans(size - start, chunk_size))
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
    """``item_ends`` over ``read_at(offset, n)`` (exactly n bytes) of ``size`` bytes."""
    if size < len(_LOCAL) or read_at(0, len(_LOCAL)) != _LOCAL:
        return []
    ends: list[int] = []
    start = 0  # of the archive being walked
    window_at = 0
    while window_at < size:
        # an end record that starts in this window is read whole with it
        n = min(SCAN_WINDOW + _END_RECORD.size, size - window_at)
        window = read_at(window_at, n)
        found = window.find(_END, max(0, start - window_at))
        while 0 <= found < SCAN_WINDOW and found + _END_RECORD.size <= n:
            end = _archive_end(read_at, window, window_at, start, window_at + found)
            if end is None:
                found = window.find(_END, found + 1)
                continue
            ends.append(end)
            start = end
            if end >= size:
                return ends
            if read_at(end, min(len(_LOCAL), size - end)) != _LOCAL:
                return ends  # not another item: the rest is cut at fixed offsets
            found = window.find(_END, end - window_at)
        window_at += SCAN_WINDOW
    return ends


def _archive_end(read_at: ReadAt, window: bytes, window_at: int, start: int, at: int) -> int | None:
    """The end of the zip archive that starts at ``start``, if the end record at ``at``
    (``window``'s bytes from ``window_at`` hold it) is that archive's; else None."""
    _sig, disk, cd_disk, entries_here, entries, cd_size, cd_offset, comment = (
        _END_RECORD.unpack_from(window, at - window_at)
    )
    if disk or cd_disk or entries_here != entries or comment:
        return None
    end64 = None
    locator_at = at - _LOCATOR_BYTES
    if locator_at >= start and read_at(locator_at, 4) == _LOCATOR64:
        end64 = start + struct.unpack("<Q", read_at(locator_at + 8, 8))[0]
        if not start <= end64 <= locator_at - 56 or read_at(end64, 4) != _END64:
            return None
        cd_size, cd_offset = _END64_FIELDS.unpack(read_at(end64 + 40, 16))
    cd_at = start + cd_offset
    if cd_at + cd_size != (end64 if end64 is not None else at) or cd_size < 46:
        return None
    if read_at(cd_at, 4) != _CENTRAL:
        return None
    return at + _END_RECORD.size


def _read_at(fd: int, path: Path, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise shrank(path)
    return data
