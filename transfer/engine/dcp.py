"""What a PyTorch DCP checkpoint promises about its own files.

A DCP save writes ``.metadata`` (a pickle of ``torch.distributed.checkpoint.Metadata``)
whose ``storage_data`` maps every saved item to a ``_StorageInfo(relative_path, offset,
length)``: the storage file and the byte range it occupies. A directory whose ``.metadata``
names files that are missing or shorter than a range ending in them is not a finished save,
whatever order its files appeared in (``cp -r`` and ``rsync`` copy ``.metadata`` first).

The pickle is read without torch and without running anything it names: every class it
refers to becomes an inert stub that only keeps its arguments and state, so a hostile
``.metadata`` can at worst fail to parse. Anything that does not look like DCP metadata
yields None (the caller then relies on the stability check alone).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transfer.errors import SourceChangedError

METADATA = ".metadata"
_SHARD = re.compile(r"__\d+_\d+\.distcp\Z")  # a DCP storage file, as its writer names it
MAX_METADATA_BYTES = 512 << 20  # far above any real save's (~1 MB per 1B parameters)


class _Stub:
    """Stands in for any class the pickle names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return type(name, (_Stub,), {"module": module})

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


def _fields(obj: Any) -> dict[str, Any]:
    """A stub's dataclass fields: ``__dict__`` state, or slots state ``(None, {...})``."""
    state = getattr(obj, "state", None)
    if isinstance(state, tuple) and len(state) == 2:
        merged: dict[str, Any] = {}
        for part in state:
            if isinstance(part, dict):
                merged.update(part)
        return merged
    if isinstance(state, dict):
        return state
    return dict(getattr(obj, "__dict__", {}))


def required_lengths(metadata: bytes) -> dict[str, int] | None:
    """{storage file: the length its ranges need}, or None when ``metadata`` is not DCP
    metadata this reader understands."""
    try:
        root = _InertUnpickler(io.BytesIO(metadata)).load()
    except Exception:  # any malformed or foreign pickle: not ours to judge
        return None
    storage = _fields(root).get("storage_data")
    if not isinstance(storage, dict):
        return None
    need: dict[str, int] = {}
    for info in storage.values():
        f = _fields(info)
        path, offset, length = f.get("relative_path"), f.get("offset"), f.get("length")
        if not isinstance(path, str) or not isinstance(offset, int):
            return None
        if not isinstance(length, int):
            return None
        need[path] = max(need.get(path, 0), offset + length)
    return need


def metadata_trouble(root: Path) -> str | None:
    """What is wrong with the ``.metadata`` of a directory holding DCP storage files, read
    once: "missing" (DCP writes it last: an unfinished save, or one node's part of a
    multi-node save), "unreadable" (torn, empty, foreign: no share of it can be planned,
    and a DCP load of it will likely fail), or None (fine, or not a DCP save)."""
    try:
        names = [p.name for p in root.iterdir()]
        if lacks_metadata(names):
            return "missing"
        if METADATA not in names or not any(_SHARD.match(n) for n in names):
            return None
        meta = root / METADATA
        if meta.stat().st_size > MAX_METADATA_BYTES:
            return None
        return "unreadable" if required_lengths(meta.read_bytes()) is None else None
    except OSError:
        return None


def lacks_metadata(paths: Iterable[str]) -> bool:
    """Files of a save (relative paths) that hold DCP storage files but no ``.metadata``:
    never a whole step (rank 0's node's part, which holds it, is not there)."""
    names = set(paths)
    return METADATA not in names and any(_SHARD.match(n) for n in names)


def check_complete(root: Path, sizes: dict[str, int], *, part: bool = False) -> None:
    """Raise SourceChangedError when ``root``'s ``.metadata`` names storage files that
    ``sizes`` (relative path -> bytes) lacks or holds too short. Non-DCP directories pass.
    ``part``: ``root`` is one node's part of a multi-node save (rank 0's node holds
    ``.metadata`` and its own ranks' files): a named file may be absent, but one that is
    there must be whole; the step is whole when its parts together hold every file."""
    meta = root / METADATA
    if METADATA not in sizes or sizes[METADATA] > MAX_METADATA_BYTES:
        return
    need = required_lengths(meta.read_bytes())
    if need is None:
        return
    for path, length in sorted(need.items()):
        have = sizes.get(path)
        if have is None and part:
            continue  # another node's part holds it
        if have is None:
            raise SourceChangedError(
                f"{root}: {METADATA} names {path}, which is not there (save unfinished? if "
                "this directory is one node's part of a multi-node save, push it with --part)"
            )
        if have < length:
            raise SourceChangedError(
                f"{root / path} is {have} bytes, {METADATA} needs {length} (save unfinished?)"
            )
