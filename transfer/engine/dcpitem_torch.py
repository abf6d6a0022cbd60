"""Where a DCP tensor item's values lie, read from the item's first bytes, so a load copies
them once, straight into the state_dict's tensor.

DCP's FileSystemWriter stores each tensor item as its own ``torch.save`` archive: a zip of
uncompressed records, ``data.pkl`` first (how to rebuild the tensor: dtype, storage key,
offset, size, stride), then the storage's raw bytes, 64-byte aligned. ``torch.load`` of an
item allocates a new tensor and reads the bytes into it, and DCP then copies that into the
target: two copies, an allocation that faults in fresh pages, and a zip and pickle pass per
item. ``stored_tensor`` reads the same facts from the item's head with an unpickler that
knows only a plain tensor's rebuild; anything else it does not recognise (a Parameter, a
tensor subclass, a compressed or big-endian record, another torch's layout it cannot vouch
for) is None, and the caller loads that item with ``torch.load`` as DCP would.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from transfer.codec.transforms import Buffer
from transfer.errors import FormatError

#: the bytes of an item's head that hold its records up to the start of its data: a
#: tensor's data.pkl is ~160 bytes, and the records before the data ~600 in all
HEAD_BYTES = 4096
#: the bytes after an item's data that hold its size, when that follows the data
TRAILER_BYTES = 24

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50
_ZIP64_EXTRA = 0x0001
_DATA_DESCRIPTOR_FLAG = 0x08  # the record's sizes follow its bytes (torch's writer)
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_DESCRIPTOR = struct.Struct("<4sIII")  # signature, CRC-32, sizes
_DESCRIPTOR64 = struct.Struct("<4sIQQ")  # the same, sizes of a zip64 record
_MAX_RECORDS = 16  # before the data: data.pkl, versions, alignment, byteorder


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor item's storage as it lies in the item, and the tensor over it."""

    dtype: torch.dtype
    data_start: int  # the storage's first byte, from the item's first
    numel: int  # of the storage
    storage_offset: int  # the tensor's, in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    described: bool = False  # the data record's size follows its bytes: trailer_ok

    @property
    def data_end(self) -> int:
        return self.data_start + self.numel * self.dtype.itemsize

    def trailer_ok(self, after: Buffer) -> bool:
        """Whether the bytes after the data (``TRAILER_BYTES`` of them from ``data_end``,
        or fewer where the item ends) confirm the data's size, where it was not known
        before it. (Not its CRC: that would read every byte once more.)"""
        if not self.described:
            return True
        nbytes = self.data_end - self.data_start
        after = bytes(memoryview(after).cast("B")[:TRAILER_BYTES])
        for fields in (_DESCRIPTOR, _DESCRIPTOR64):
            if len(after) >= fields.size:
                sig, _crc, csize, usize = fields.unpack_from(after)
                if sig == _DESCRIPTOR_SIGNATURE and csize == usize == nbytes:
                    return True
        return False

    def view_of(self, item: Buffer) -> torch.Tensor:
        """The tensor, over the item's own bytes (no copy is made; give a writable buffer,
        a bytearray: torch warns once over a read-only one)."""
        if not self.numel:
            return torch.empty(0, dtype=self.dtype).as_strided(self.size, self.stride)
        data = memoryview(item).cast("B")[self.data_start : self.data_end]
        storage = torch.frombuffer(data, dtype=self.dtype)
        return storage.as_strided(self.size, self.stride, self.storage_offset)

    def span(self, offsets: tuple[int, ...], lengths: tuple[int, ...], what: str) -> Span:
        """The bytes of the item a narrowing of the tensor (``offsets``, ``lengths`` per
        dim, as a DCP read item gives them) reads, and the view over them: from its first
        element to its last (all of it between, for a narrowing of a later dim). A
        narrowing the tensor does not hold (a ``.metadata`` that does not describe this
        item) is a FormatError naming ``what``, never bytes from beyond it."""
        dims = len(self.size)
        if (
            len(offsets) != dims
            or len(lengths) != dims
            or any(
                o < 0 or n < 0 or o + n > have
                for o, n, have in zip(offsets, lengths, self.size, strict=True)
            )
        ):
            raise FormatError(
                f"{what}: the load plan reads offsets {tuple(offsets)} lengths "
                f"{tuple(lengths)} of a stored tensor of size {self.size}: the checkpoint's "
                f".metadata does not describe this item"
            )
        itemsize = self.dtype.itemsize
        first = self.storage_offset + _reach(offsets, self.stride)
        start = self.data_start + first * itemsize
        if 0 in lengths:
            return Span(start, 0, tuple(lengths), self.stride)
        extent = 1 + _reach([n - 1 for n in lengths], self.stride)
        return Span(start, extent * itemsize, tuple(lengths), self.stride)


def _reach(index: Any, stride: tuple[int, ...]) -> int:
    """The element an index (per dim) lies at, from the tensor's first."""
    return sum(i * s for i, s in zip(index, stride, strict=True))


@dataclasses.dataclass(frozen=True)
class Span:
    """A narrowed tensor's bytes within its item: ``length`` bytes from ``start``, and its
    size and stride over them (elements, from the span's first)."""

    start: int
    length: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.size), reversed(self.stride), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


def stored_tensor(head: Buffer) -> StoredTensor | None:
    """The tensor item whose first bytes are ``head`` (``HEAD_BYTES`` of them, or the whole
    item if shorter), or None when it is not a plain tensor laid out as this reads it.
    Where the data's size follows it (torch's writer), the caller checks that too:
    ``StoredTensor.trailer_ok``."""
    view = memoryview(head).cast("B")
    records = _records(view)
    if records is None:
        return None
    small, (data_name, data_start, data_size) = records
    prefix = data_name[: data_name.index("/data/") + 1]
    pickled = small.get(prefix + "data.pkl")
    if pickled is None:
        return None
    rebuilt = _unpickle(view[pickled[0] : pickled[0] + pickled[1]])
    if rebuilt is None or data_name != f"{prefix}data/{rebuilt.key}":
        return None
    order = small.get(prefix + "byteorder")
    if order is not None and bytes(view[order[0] : order[0] + order[1]]) != sys.byteorder.encode():
        return None
    if data_size not in (None, rebuilt.numel * rebuilt.dtype.itemsize):
        return None
    stored = StoredTensor(
        rebuilt.dtype, data_start, rebuilt.numel, rebuilt.storage_offset,
        rebuilt.size, rebuilt.stride, described=data_size is None,
    )  # fmt: skip
    return stored if _within(stored) else None


class StoredTensors:
    """``stored_tensor`` of many items of one save, each kind of head parsed once.

    What ``stored_tensor`` finds is made of the head's bytes before the data and nothing
    else, and a save's items have few kinds of head (one per shape and dtype: 8 of the 544
    items of a real fine-tune's save), so a head whose bytes up to a data start seen before
    are those of a head parsed before is that head's tensor: a dict lookup instead of
    ~37 us of parsing (532 items: 20 ms -> 1 ms)."""

    #: the most heads, and data starts, remembered (a save of more kinds parses the rest)
    MAX_HEADS = 1024
    MAX_STARTS = 8

    def __init__(self) -> None:
        self._heads: dict[bytes, StoredTensor] = {}
        self._starts: list[int] = []

    def __call__(self, head: Buffer) -> StoredTensor | None:
        view = memoryview(head).cast("B")
        for start in self._starts:
            known = self._heads.get(bytes(view[:start]))
            if known is not None:
                return known
        stored = stored_tensor(view)
        if stored is not None and len(self._heads) < self.MAX_HEADS:
            self._heads[bytes(view[: stored.data_start])] = stored
            if stored.data_start not in self._starts and len(self._starts) < self.MAX_STARTS:
                self._starts.append(stored.data_start)
        return stored


def tensor_of_item(item: Buffer) -> torch.Tensor | None:
    """The tensor a whole item in memory holds, over its bytes, or None (torch.load it)."""
    view = memoryview(item).cast("B")
    stored = stored_tensor(view[:HEAD_BYTES])
    if stored is None or stored.data_end > len(view):
        return None
    if not stored.trailer_ok(view[stored.data_end :]):
        return None
    return stored.view_of(view)


def check_size(req: ReadItem, have: Any, target: torch.Tensor) -> None:
    """The item's narrowing and the state_dict's tensor have one shape, or a one-line error."""
    if tuple(target.size()) != tuple(have):
        raise FormatError(
            f"{req.storage_index.fqn}: the checkpoint holds {tuple(have)}, "
            f"the state_dict wants {tuple(target.size())}"
        )


#: the item's small records (name -> where its bytes start, how many), and its first data
#: record's name, start and size (None when the size follows the data)
_Records = tuple[dict[str, tuple[int, int]], tuple[str, int, "int | None"]]


def _records(view: memoryview) -> _Records | None:
    """The item's records up to its first data record, read from their local headers in
    order; None when one is compressed or the head ends first."""
    small: dict[str, tuple[int, int]] = {}
    at = 0
    for _ in range(_MAX_RECORDS):
        if at + _LOCAL_HEADER.size > len(view):
            return None
        fields = _LOCAL_HEADER.unpack_from(view, at)
        sig, flags, method, csize, usize, nlen, xlen = (fields[i] for i in (0, 2, 3, 7, 8, 9, 10))
        name_at = at + _LOCAL_HEADER.size
        start = name_at + nlen + xlen
        if sig != _LOCAL_SIGNATURE or method != 0 or start > len(view):
            return None
        try:
            name = bytes(view[name_at : name_at + nlen]).decode()
        except UnicodeDecodeError:
            return None
        extra = view[name_at + nlen : start]
        described = bool(flags & _DATA_DESCRIPTOR_FLAG)
        if "/data/" in name:  # the storage: nothing past its first bytes is needed here
            size = None if described else _header_size(csize, usize, extra)
            if size is None and not described:
                return None
            return small, (name, start, size)
        if described:
            found = _described(view, start)
            if found is None:
                return None
            size, trailer = found
        else:
            header_size = _header_size(csize, usize, extra)
            if header_size is None:
                return None
            size, trailer = header_size, 0
        small[name] = (start, size)
        at = start + size + trailer
    return None


def _header_size(csize: int, usize: int, extra: memoryview) -> int | None:
    """A stored record's size from its header (its zip64 extra field when it is large)."""
    if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
        at = 0
        while at + 4 <= len(extra):
            tag, n = struct.unpack_from("<HH", extra, at)
            if tag == _ZIP64_EXTRA and n >= 16:
                usize, csize = struct.unpack_from("<QQ", extra, at + 4)
                break
            at += 4 + n
        else:
            return None
    return usize if usize == csize else None


def _described(view: memoryview, start: int) -> tuple[int, int] | None:
    """A small record whose size follows it (zip's data descriptor): (its size, the
    descriptor's), found as the first descriptor whose sizes and CRC match the bytes
    before it, or None."""
    tail = bytes(view[start:])
    at = tail.find(_DESCRIPTOR_SIGNATURE)
    while at >= 0:
        crc = zlib.crc32(tail[:at])
        for fields in (_DESCRIPTOR, _DESCRIPTOR64):
            if at + fields.size <= len(tail):
                _sig, got_crc, csize, usize = fields.unpack_from(tail, at)
                # (a CRC of 0: a save made with torch's compute_crc32 off)
                if got_crc in (crc, 0) and csize == usize == at:
                    return at, fields.size
        at = tail.find(_DESCRIPTOR_SIGNATURE, at + 1)
    return None


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    key: str
    dtype: torch.dtype
    numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


class _NotPlain(Exception):
    """The item is something else than a plain tensor: torch.load it."""


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, hooks: Any, meta: Any = None
) -> _Rebuilt:
    """torch._utils._rebuild_tensor_v2's arguments, of a plain tensor, and where they point."""
    if not isinstance(storage, _Storage) or hooks or meta:
        raise _NotPlain
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)):
        raise _NotPlain
    if not all(type(n) is int and n >= 0 for n in (offset, *size, *stride)):
        raise _NotPlain
    return _Rebuilt(storage.key, storage.dtype, storage.numel, offset, size, stride)


class _PlainTensorUnpickler(pickle.Unpickler):
    """data.pkl of a plain tensor, and nothing else: no class is built but these."""

    def find_class(self, module: str, name: str) -> Any:
        # each a new object: a pickle's BUILD could set attributes on what it is given,
        # and must not change a shared one for the rest of the process
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: _rebuild_tensor_v2(*args)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage") and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise _NotPlain

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain
        _, kind, key, _location, numel = pid
        plain = isinstance(kind, _StorageType) and isinstance(kind.dtype, torch.dtype)
        if not plain or not isinstance(key, str) or type(numel) is not int:
            raise _NotPlain
        if numel < 0:
            raise _NotPlain
        return _Storage(key, kind.dtype, numel)


def _unpickle(pickled: memoryview) -> _Rebuilt | None:
    try:
        rebuilt = _PlainTensorUnpickler(io.BytesIO(pickled)).load()
    except _NotPlain:
        return None
    except Exception:  # a torn or foreign pickle: torch.load says what is wrong with it
        return None
    return rebuilt if isinstance(rebuilt, _Rebuilt) else None


def _within(stored: StoredTensor) -> bool:
    """Every element the tensor's size and stride reach lies inside its storage."""
    if 0 in stored.size:
        return stored.storage_offset <= stored.numel
    return (
        stored.storage_offset + _reach([n - 1 for n in stored.size], stored.stride) < stored.numel
    )


#: the legacy typed storages a torch.save names: the dtype of their elements
_STORAGE_DTYPES = {
    name: dtype
    for name, dtype in (
        ("DoubleStorage", torch.float64), ("FloatStorage", torch.float32),
        ("HalfStorage", torch.float16), ("BFloat16Storage", torch.bfloat16),
        ("LongStorage", torch.int64), ("IntStorage", torch.int32),
        ("ShortStorage", torch.int16), ("CharStorage", torch.int8),
        ("ByteStorage", torch.uint8), ("BoolStorage", torch.bool),
        ("ComplexFloatStorage", torch.complex64), ("ComplexDoubleStorage", torch.complex128),
    )
}  # fmt: skip
