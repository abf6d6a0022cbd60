"""Read a DCP ``.metadata`` without trusting it: it is a pickle, and a pickle can name any
callable (torch's own readers ``pickle.load`` it). The unpickler here builds DCP's metadata
types and nothing else, so a store or a directory that serves anything else gets a one-line
error, never code run (docs/SECURITY.md). Used by FerryReader and LocalReader.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

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
    """Builds DCP's metadata types and nothing else (a pickle can name any callable)."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:  # a dtype, layout or memory format
            value = torch.__dict__.get(name)  # (no getattr: torch imports modules lazily)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


def metadata_from(raw: bytes, what: str) -> Metadata:
    """The DCP metadata pickled in ``raw`` (``what``: whose, for the error), or a one-line
    FormatError; nothing but DCP's own metadata types is ever built."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # whatever a crafted pickle makes the allowed ones raise
        raise FormatError(f"{what}: {METADATA} is not DCP metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{what}: {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata
