"""A DCP ``.metadata`` for steps that have no tensors to save: fleets of hundreds of tiny
parts (bench/fleet.py) and tests that count what a share's reader asks of the store.

It pickles what ferry reads of DCP's ``Metadata`` (``storage_data``: which bytes of which
storage file hold each item; transfer/engine/dcp.py reads it with an inert unpickler) under
DCP's own class names, written opcode by opcode: no torch in the process. A real DCP load
of it would fail; nothing here loads it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

_DCP = "torch.distributed.checkpoint.metadata"


def dcp_metadata(
    lengths: Mapping[str, int], *, sharded: bool = False, replicated: int = 0
) -> bytes:
    """A ``.metadata`` whose storage files are ``lengths``' keys, each one item
    ``w.<n>`` covering the whole file. ``sharded``: instead, the files hold the rows of one
    tensor ``w`` saved ``Shard(0)``, a row each (the n-th file in path order, row n), so
    that a layout of a new world size reads the files of the old ranks whose rows its
    ranks hold (dcpshare.share_ranges), as a resharded load does. ``replicated``: the last
    that many bytes of each file are instead a bytes item ``state.<n>`` every rank reads,
    as DCP spreads a save's replicated items (step counters, param_groups) over its files."""
    info = "torch.distributed.checkpoint.filesystem", "_StorageInfo"
    files = sorted(lengths.items())
    rows = b"".join(
        _new(
            _DCP,
            "MetadataIndex",
            {"fqn": "w" if sharded else f"w.{n}", "offset": (n if sharded else 0,), "index": None},
        )
        + _new(*info, {"relative_path": path, "offset": 0, "length": length - replicated})
        for n, (path, length) in enumerate(files)
    )
    if replicated:
        rows += b"".join(
            _new(_DCP, "MetadataIndex", {"fqn": f"state.{n}", "offset": None, "index": None})
            + _new(
                *info, {"relative_path": path, "offset": length - replicated, "length": replicated}
            )
            for n, (path, length) in enumerate(files)
        )
    storage = b"}(" + rows + b"u"
    tensors = b"}"
    if sharded:  # (bytes: pickled already, written as they are)
        chunks = [
            _new(_DCP, "ChunkStorageMetadata", {"offsets": (n,), "sizes": (1,)})
            for n in range(len(files))
        ]
        listed = b"](" + b"".join(chunks) + b"e"
        w: dict[str, object] = {"properties": None, "size": (len(files),), "chunks": listed}
        tensors = b"}(" + _str("w") + _new(_DCP, "TensorStorageMetadata", w)
        for n in range(len(files) if replicated else 0):
            tensors += _str(f"state.{n}") + _new(_DCP, "BytesStorageMetadata", {})
        tensors += b"u"
    root = _new(_DCP, "Metadata", {"state_dict_metadata": tensors, "planner_data": None})
    # (the root's state dict gets storage_data added before BUILD closes it)
    root = root[: -len(b"ub")] + _str("storage_data") + storage + b"ub"
    return b"\x80\x02" + root + b"."


def _new(module: str, name: str, state: dict[str, object]) -> bytes:
    """``cls.__new__(cls)`` then ``__setstate__(state)``: GLOBAL, EMPTY_TUPLE, NEWOBJ,
    a dict, BUILD."""
    items = b"".join(_str(k) + _value(v) for k, v in state.items())
    return b"c" + f"{module}\n{name}\n".encode() + b")\x81}(" + items + b"ub"


def _value(v: object) -> bytes:
    if isinstance(v, bytes):
        return v
    if v is None:
        return b"N"
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, int):
        raw = v.to_bytes((v.bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    if isinstance(v, tuple):
        return b"(" + b"".join(_value(x) for x in v) + b"t"
    if isinstance(v, dict) and not v:
        return b"}"
    raise TypeError(f"fake_dcp cannot write {v!r}")


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw
