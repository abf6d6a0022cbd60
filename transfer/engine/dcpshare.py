"""Which bytes of a DCP checkpoint a set of new ranks reads: the share a node must fetch.

After an elastic resize (8 ranks saved, 4 resume) each node needs only what its own ranks'
``torch.distributed.checkpoint.load`` reads, not the whole save. That is decided by DCP's
default load planner; this module reproduces its choice from ``.metadata`` alone, parsed with
the inert unpickler of ``transfer.engine.dcp`` (no torch, nothing the pickle names is run).

The rule (checked against torch 2.13.0's ``DefaultLoadPlanner`` in tests/test_dcp_share.py):

- The new ranks hold every tensor that was saved in several chunks as a DTensor (or
  ShardedTensor) ``Shard(0)`` over a 1-D mesh of ``world_size``: new rank r owns dim-0 rows
  ``[min(n, r*c), min(n, r*c + c))`` with ``c = ceil(n / world_size)`` (DTensor's
  torch.chunk-like split: trailing ranks may own nothing) and all of the other dims.
- A tensor saved as one chunk covering all of it (replicated, a plain tensor, 0-d) is held
  whole by every rank.
- A saved chunk is read, whole, when it passes DCP's overlap test against the rank's box: in
  every dim, neither box starts at or after the other's end (for non-empty boxes: they
  intersect). Its bytes are ``storage_data[(fqn, chunk offsets)]``.
- A non-tensor item (``BytesStorageMetadata``: lr, betas, param names) is read by every rank.

``.metadata`` itself is not part of a share: every loading rank reads it whole, so the caller
always fetches it. Layouts this rule does not describe (2-D meshes, tensor parallel, a tensor
saved sharded but loaded replicated) need ``dcpplan_torch.planned_ranges``, which runs DCP's
planner where the model lives and hands back an explicit item list (``ranges_from_items``).
"""

from __future__ import annotations

import io
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from transfer.engine.dcp import _fields, _InertUnpickler
from transfer.errors import FerryError, FormatError
from transfer.format.paths import check_relative_path

Ranges = dict[str, tuple[tuple[int, int], ...]]
"""{storage file relative path: sorted, merged, non-overlapping [start, end) byte ranges}"""

MAX_WORLD_SIZE = 1 << 20
MAX_ITEMS = 1_000_000
MAX_DIMS = 64
_MAX_INT = (1 << 63) - 1
_NOT_OURS = "not DCP metadata this ferry understands"
_RANK_PART = re.compile(r"\s*([0-9]{1,7})\s*(?:-\s*([0-9]{1,7})\s*)?")

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's (offsets, sizes)
_Key = tuple[str, tuple[int, ...] | None]  # a storage item: (fqn, chunk offsets or None)


@dataclass(frozen=True)
class Layout:
    """The new job's shape: ``world_size`` ranks load, and the share is for ``ranks``.

    Bad values are a user's mistake (a flag), so they raise the plain one-line FerryError;
    FormatError is kept for malformed documents (``.metadata``, item lists)."""

    world_size: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        w = self.world_size
        if type(w) is not int or not 1 <= w <= MAX_WORLD_SIZE:
            raise FerryError(f"world size: expected an integer in 1..{MAX_WORLD_SIZE}, got {w!r}")
        if not isinstance(self.ranks, tuple) or not self.ranks:
            got = type(self.ranks).__name__ if self.ranks else "none"
            raise FerryError(f"ranks: expected a non-empty tuple of ranks, got {got}")
        seen: set[int] = set()
        for r in self.ranks:
            if type(r) is not int or not 0 <= r < w:
                raise FerryError(f"ranks: {r!r} is not a rank of a world of {w} (0..{w - 1})")
            if r in seen:
                raise FerryError(f"ranks: rank {r} is named twice")
            seen.add(r)


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)``: how a user names the ranks a node runs (sorted, unique)."""
    out: set[int] = set()
    for part in text.split(","):
        match = _RANK_PART.fullmatch(part)
        if match is None:
            raise FerryError(f"ranks: expected A,B or A-B, got {text!r}")
        first = int(match[1])
        last = first if match[2] is None else int(match[2])
        if last < first or last >= MAX_WORLD_SIZE:
            raise FerryError(f"ranks: {part.strip()!r} is not a range A-B with A <= B < 2**20")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def merge_ranges(items: Iterable[tuple[str, int, int]]) -> Ranges:
    """(path, offset, length) items -> per path, sorted ranges with overlapping and touching
    ones merged (fewer, larger reads; empty items dropped)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in items:
        if length > 0:
            spans.setdefault(path, []).append((offset, offset + length))
    out: Ranges = {}
    for path in sorted(spans):
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans[path]):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        out[path] = tuple(merged)
    return out


def overlaps(spans: tuple[tuple[int, int], ...], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of sorted, merged ``spans`` inside ``[start, end)``, in order."""
    first = bisect_right(spans, (start, _MAX_INT)) - 1
    out = []
    for lo, hi in spans[max(first, 0) :]:
        if lo >= end:
            break
        if hi > start:
            out.append((max(lo, start), min(hi, end)))
    return out


def share_bytes(ranges: Ranges) -> int:
    """How many bytes a share is (what the node will fetch, ``.metadata`` aside)."""
    return sum(end - start for spans in ranges.values() for start, end in spans)


# ---------------------------------------------------------------- the inert parse


@dataclass(frozen=True)
class _Tensor:
    fqn: str
    size: tuple[int, ...]
    chunks: tuple[_Box, ...]


@dataclass(frozen=True)
class Parsed:
    tensors: tuple[_Tensor, ...]
    byte_items: tuple[str, ...]
    storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]
    #: per world size: each saved chunk and the ranks that read it (None: every rank)
    _readers: dict[int, list[tuple[_Key, range | None]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def readers(self, world: int) -> list[tuple[_Key, range | None]]:
        """Each item and the ranks of a ``world``-rank job that read it (None: every rank;
        byte items first): computed once per world size, so the shares of a group's G
        layouts each cost a lookup per chunk, not DCP's rule again."""
        if world not in self._readers:
            found: list[tuple[_Key, range | None]] = [
                ((fqn, None), None) for fqn in self.byte_items
            ]
            for t in self.tensors:
                found += [((t.fqn, box[0]), _readers(t, box, world)) for box in t.chunks]
            self._readers[world] = found
        return self._readers[world]


def _bad(why: str) -> FormatError:
    return FormatError(f".metadata: {_NOT_OURS} ({why})")


def _q(value: object) -> str:
    """A value from the pickle as message text: quoted (no raw newlines) and bounded."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(obj: object) -> str:
    """The class name a stub stands for, if it is one of DCP's metadata classes."""
    module = getattr(type(obj), "module", "")
    if not isinstance(module, str) or not module.startswith("torch.distributed.checkpoint"):
        return ""
    return type(obj).__name__


def _nat(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise _bad(f"{what} is {_q(value)}, not a non-negative integer")
    return value


def _shape(obj: object, what: str) -> tuple[int, ...]:
    """A ``torch.Size`` (pickled as ``Size((ints...))``) or a plain tuple/list of ints."""
    stub = getattr(type(obj), "module", None) == "torch" and type(obj).__name__ == "Size"
    if stub and len(getattr(obj, "args", ())) == 1:
        obj = obj.args[0]  # type: ignore[attr-defined]
    if not isinstance(obj, tuple | list) or len(obj) > MAX_DIMS:
        raise _bad(f"{what} is not a shape")
    return tuple(_nat(v, what) for v in obj)


def _tensor(fqn: str, md: object, budget: list[int]) -> _Tensor:
    f = _fields(md)
    size = _shape(f.get("size"), f"{_q(fqn)} size")
    chunks = f.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise _bad(f"{_q(fqn)} has no chunk list")
    budget[0] -= len(chunks)
    if budget[0] < 0:
        raise _bad("more chunks than its bytes can hold")
    boxes = []
    for chunk in chunks:
        c = _fields(chunk) if _kind(chunk) == "ChunkStorageMetadata" else {}
        offsets = _shape(c.get("offsets"), f"{_q(fqn)} chunk offsets")
        sizes = _shape(c.get("sizes"), f"{_q(fqn)} chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _bad(f"{_q(fqn)} has a chunk of another rank than the tensor")
        boxes.append((offsets, sizes))
    return _Tensor(fqn, size, tuple(boxes))


def _storage(
    data: dict[Any, Any],
) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """{(fqn, chunk offsets or None): (path, offset, length)}: keyed like MetadataIndex's own
    equality (fqn and offset; its ``index`` is only a lookup hint)."""
    out: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in data.items():
        k, i = _fields(key), _fields(info)
        if _kind(key) != "MetadataIndex" or not isinstance(k.get("fqn"), str):
            raise _bad("a storage_data key is not a MetadataIndex")
        fqn, offset = k["fqn"], k.get("offset")
        where = (fqn, None if offset is None else _shape(offset, f"{_q(fqn)} offset"))
        if where in out:
            raise _bad(f"{_q(fqn)} has two storage entries for one chunk")
        try:
            path = check_relative_path(i.get("relative_path"))
        except FormatError as exc:
            raise _bad(str(exc)) from None
        start = _nat(i.get("offset"), f"{_q(path)} offset")
        out[where] = (path, start, _nat(i.get("length"), f"{_q(path)} length"))
    return out


def parse_metadata(metadata: bytes) -> Parsed:
    """``.metadata`` parsed once, for the shares of several layouts (layout_ranges: a
    fan-out group's member plans every member's); FormatError as share_ranges."""
    try:
        root = _InertUnpickler(io.BytesIO(metadata)).load()
    except Exception:  # any malformed or foreign pickle
        raise _bad("not a readable pickle") from None
    f = _fields(root) if _kind(root) == "Metadata" else {}
    sdm, data = f.get("state_dict_metadata"), f.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(data, dict):
        raise _bad("no state_dict_metadata / storage_data")
    budget = [len(metadata)]
    tensors, byte_items = [], []
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(f"state_dict key {_q(fqn)} is not a string")
        if _kind(md) == "BytesStorageMetadata":
            byte_items.append(fqn)
        elif _kind(md) == "TensorStorageMetadata":
            tensors.append(_tensor(fqn, md, budget))
        else:
            raise _bad(f"{_q(fqn)} is a {_q(type(md).__name__)}")
    return Parsed(tuple(tensors), tuple(byte_items), _storage(data))


# ---------------------------------------------------------------- the rule


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's dim-0 [start, end) under ``Shard(0)``: ``ceil(n / world)`` rows per rank, as
    DTensor splits (torch.chunk-like); an empty share starts (and ends) at ``n``."""
    per = -(-n // world)
    return min(n, rank * per), min(n, rank * per + per)


def _passes(offset: int, size: int, lo: int, hi: int) -> bool:
    """DCP's overlap test in one dim between a saved [offset, offset+size) and a wanted
    [lo, hi): neither starts at or after the other's end."""
    return lo < offset + size and offset < hi


def _sharded(t: _Tensor) -> bool:
    """Saved in several chunks (or one not covering it): the new ranks hold it Shard(0).
    One chunk covering it all is a replicated or plain tensor: every rank holds it whole."""
    whole = ((0,) * len(t.size), t.size)
    return len(t.size) > 0 and not (len(t.chunks) == 1 and t.chunks[0] == whole)


def _readers(t: _Tensor, box: _Box, world: int) -> range | None:
    """The ranks of a ``world``-rank job that read saved chunk ``box`` of tensor ``t``;
    None: every rank (a replicated or plain tensor)."""
    offsets, sizes = box
    sharded = _sharded(t)
    for d in range(1 if sharded else 0, len(t.size)):
        if not _passes(offsets[d], sizes[d], 0, t.size[d]):
            return range(0)
    if not sharded:
        return None
    n, a, b = t.size[0], offsets[0], sizes[0]
    # both row bounds grow with the rank, so the ranks passing the dim-0 test are [lo, hi)
    lo = bisect_left(range(world), True, key=lambda r: _rows(n, world, r)[1] > a)
    hi = bisect_left(range(world), True, key=lambda r: _rows(n, world, r)[0] >= a + b)
    return range(lo, hi)


def share_ranges(metadata: bytes, layout: Layout) -> Ranges:
    """{storage file: byte ranges} that ``layout.ranks`` read when a job of
    ``layout.world_size`` ranks loads this checkpoint with DCP's default planner (see the
    module docstring for the rule). Raises FormatError on metadata this parse cannot vouch
    for: a share computed from a misread would silently miss bytes."""
    return layout_ranges(parse_metadata(metadata), layout)


def layout_ranges(parsed: Parsed, layout: Layout) -> Ranges:
    """share_ranges of a ``.metadata`` parsed already."""
    ranks = sorted(layout.ranks)
    items: list[tuple[str, int, int]] = []
    for key, readers in parsed.readers(layout.world_size):
        if readers is not None:  # read by ranks [start, stop): is one of ours among them?
            i = bisect_left(ranks, readers.start)
            if i == len(ranks) or ranks[i] >= readers.stop:
                continue
        info = parsed.storage.get(key)
        if info is None:
            raise _bad(f"{_q(key[0])} at {key[1]} has no storage_data entry")
        items.append(info)
    return merge_ranges(items)


def every_rank_ranges(parsed: Parsed) -> Ranges:
    """The byte ranges every rank of any world reads: byte items and tensors saved whole
    (step counters, param_groups, replicated and plain tensors). DCP spreads these over
    every rank's file, so each survivor's share touches every file for them (what a
    step's common index, format/stepcommon.py, spares a reader)."""
    items = []
    for key, readers in parsed.readers(1):
        if readers is None and (info := parsed.storage.get(key)) is not None:
            items.append(info)
    return merge_ranges(items)


def ranges_from_items(doc: object) -> Ranges:
    """An explicit item list ``[{"path", "offset", "length"}, ...]`` (JSON, from
    ``dcpplan_torch.write_items`` or a user) validated and merged: it names files to write
    into, so it is checked like a manifest from an untrusted store."""
    if not isinstance(doc, list):
        raise FormatError("item list: expected a JSON list of {path, offset, length}")
    if len(doc) > MAX_ITEMS:
        raise FormatError(f"item list: {len(doc)} items, at most {MAX_ITEMS} allowed")
    items = []
    for n, item in enumerate(doc):
        if not isinstance(item, dict) or set(item) != {"path", "offset", "length"}:
            raise FormatError(f"item list: item {n} is not exactly {{path, offset, length}}")
        path = check_relative_path(item["path"])
        for key in ("offset", "length"):
            value = item[key]
            if type(value) is not int or not 0 <= value <= _MAX_INT:
                raise FormatError(f"item list: item {n} {key} is {value!r}, not an int >= 0")
        if item["offset"] + item["length"] > _MAX_INT:
            raise FormatError(f"item list: item {n} ends past 2**63")
        items.append((path, item["offset"], item["length"]))
    return merge_ranges(items)
