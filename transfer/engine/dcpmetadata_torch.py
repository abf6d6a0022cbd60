"""Read a DCP ``.metadata`` without trusting it: it is a pickle, and a pickle can name any
callable (torch's own readers ``pickle.load`` it). The unpickler here builds DCP's metadata
types and nothing else, so a store or a directory that serves anything else gets a one-line
error, never code run (docs/SECURITY.md). Used by FerryReader and LocalReader.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from transfer.engine.dcp import METADATA
from transfer.errors import FormatError

#: (module, name) of everything a DCP ``.metadata`` pickle may name (torch 2.4-2.13 saves);
#: a name, never a module: with pickle protocol 4 a dotted name would reach any attribute
#: of an allowed module (``filesystem`` imports ``os``: ``os.system`` is one dot away)
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata types and nothing else (a pickle can name any callable). The
    classes and the function it hands out are the process's own, and a pickle's BUILD can
    set attributes on them (a crafted ``.metadata`` made ``MetadataIndex`` unhashable and
    ``PosixPath`` join wrongly for the rest of the process, refused or not): their state is
    taken when first handed out and put back after the load, which is then refused. (Until
    it is put back, another thread of the process could see the change.)"""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._handed: dict[int, tuple[Any, dict[Any, Any]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (module, name) in _DCP_CLASSES:
            found = super().find_class(module, name)
            self._handed.setdefault(id(found), (found, _state_of(found)))
            return found
        if module == "torch" and "." not in name:  # a dtype, layout or memory format
            value = torch.__dict__.get(name)  # (no getattr: torch imports modules lazily)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value  # (C objects: nothing can be set on them)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")

    def put_back(self) -> list[str]:
        """Restore every handed-out object the pickle changed; their names."""
        changed = []
        for found, before in self._handed.values():
            now = _state_of(found)
            if now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()):
                _restore(found, before)
                changed.append(getattr(found, "__qualname__", repr(found)))
        return sorted(changed)


def _state_of(found: Any) -> dict[Any, Any]:
    """What a pickle's BUILD could change on a class or function (C types refuse it), one
    entry per attribute: compared by identity."""
    if isinstance(found, type):
        return dict(vars(found))
    if isinstance(found, types.FunctionType):
        state = {name: getattr(found, name) for name in _FUNCTION_STATE}
        return state | {(_IN_DICT, key): value for key, value in vars(found).items()}
    return {}


def _restore(found: Any, before: dict[Any, Any]) -> None:
    if isinstance(found, types.FunctionType):
        for name in _FUNCTION_STATE:
            setattr(found, name, before[name])
        vars(found).clear()
        vars(found).update({key[1]: v for key, v in before.items() if isinstance(key, tuple)})
        return
    for name in set(vars(found)) - set(before):
        delattr(found, name)
    for name, value in before.items():
        if vars(found).get(name, _MISSING) is not value:
            setattr(found, name, value)


_FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__", "__name__", "__qualname__")
_MISSING = object()
_IN_DICT = "__dict__"  # (a function's own attributes: keys (_IN_DICT, name) in its state)


def metadata_from(raw: bytes, what: str, load_id: str) -> Metadata:
    """The DCP metadata pickled in ``raw`` (``what``: whose, for the error), stamped with the
    reader's ``load_id`` as torch's reader stamps it, or a one-line
    FormatError; nothing but DCP's own metadata types is ever built, and nothing of the
    process's is left changed."""
    unpickler = _MetadataUnpickler(io.BytesIO(raw))
    try:
        metadata = unpickler.load()
    except Exception as exc:  # whatever a crafted pickle makes the allowed ones raise
        raise FormatError(f"{what}: {METADATA} is not DCP metadata ({exc})") from None
    finally:
        changed = unpickler.put_back()
    if changed:
        raise FormatError(f"{what}: {METADATA} sets attributes of {', '.join(changed)}: refused")
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{what}: {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id
    metadata.storage_meta = storage_meta
    return metadata
