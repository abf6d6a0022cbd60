"""Load a DCP step from the node's own disk, each tensor's bytes read once, straight into
the state_dict: ``dcp.load(state_dict, storage_reader=LocalReader(step_dir))``.

torch's ``FileSystemReader`` reads each tensor item whole and ``torch.load``s it into a new
tensor, which DCP then copies into the target (dcpitem_torch.py). This reader finds where
the item's values lie from its first bytes and reads the bytes the load plan asks for with
one ``pread`` into the target tensor's memory (or into a scratch buffer, when the target is
not a plain contiguous CPU tensor of the item's dtype, and copies from there). A rank that
loads a narrowing of an item (a resharded load) reads the item's bytes from the
narrowing's first element to its last: its rows alone, for a shard of rows.
Anything this does not recognise, and every byte item, is read by ``FileSystemReader``
itself, so every save torch can load, this loads. ``.metadata`` is unpickled as
FerryReader unpickles it (dcpmetadata_torch.py): DCP's own types, nothing else built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from transfer.engine.dcp import MAX_METADATA_BYTES
from transfer.engine.dcpitem_torch import HEAD_BYTES, TRAILER_BYTES, check_size, stored_tensor
from transfer.engine.dcpmetadata_torch import metadata_from
from transfer.errors import FormatError


class LocalReader(FileSystemReader):
    """torch's FileSystemReader over a local step directory, tensors copied once, and its
    ``.metadata`` read by an unpickler that builds DCP's metadata types only (torch's
    ``pickle.load``s it: a step pulled from a store another node wrote could run code)."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        _check_step_dir(str(self.path))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        _check_step_dir(str(self.path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as file:
            raw = file.read(MAX_METADATA_BYTES + 1)
        if len(raw) > MAX_METADATA_BYTES:
            raise FormatError(f"{path}: over the limit of {MAX_METADATA_BYTES:,} bytes")
        metadata = metadata_from(raw, str(self.path), self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        rest: list[ReadItem] = []  # what FileSystemReader reads, as it always has
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                rest.append(req)
            else:
                by_file.setdefault(info.relative_path, []).append(req)
        for relative_path, reqs in by_file.items():
            path = os.path.join(self.path, relative_path)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise FormatError(
                    f"{path}: not there, and .metadata names it (another node's part of "
                    "the step, not pulled here?)"
                ) from None
            try:
                size = os.fstat(fd).st_size
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if info.offset + info.length > size:
                        raise FormatError(
                            f"{path}: ends at byte {size}, inside {req.storage_index.fqn} "
                            f"(bytes {info.offset}..{info.offset + info.length}): cut short"
                        )
                    if not self._read_tensor(fd, path, req, planner):
                        rest.append(req)
            finally:
                os.close(fd)
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_tensor(self, fd: int, path: str, req: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``req`` into its target; False when its item is not one this reads."""
        info = self.storage_data[req.storage_index]
        stored = stored_tensor(os.pread(fd, min(HEAD_BYTES, info.length), info.offset))
        if stored is None or stored.data_end > info.length:
            return False  # (a torn item: torch.load says what is wrong with it)
        if not stored.trailer_ok(os.pread(fd, TRAILER_BYTES, info.offset + stored.data_end)):
            return False
        span = stored.span(tuple(req.storage_offsets), tuple(req.lengths), req.storage_index.fqn)
        target = planner.resolve_tensor(req).detach()
        check_size(req, span.size, target)
        where = info.offset + span.start
        if span.contiguous and _plain_into(target, stored.dtype):
            pread_into(fd, path, target, where)
        elif span.length:
            scratch = torch.empty(span.length, dtype=torch.uint8)
            pread_into(fd, path, scratch, where)
            target.copy_(scratch.view(stored.dtype).as_strided(span.size, span.stride))
        planner.commit_tensor(req, target)
        return True


def _check_step_dir(path: str) -> None:
    """A DCP save's directory, or a one-line error when the reader is made (inside
    ``dcp.load`` a missing file is two tracebacks and an AssertionError)."""
    if not os.path.isdir(path):
        raise FormatError(f"{path}: no such directory")
    names = os.listdir(path)
    if ".metadata" not in names and not any(n.endswith(".metadata") for n in names):
        raise FormatError(f"{path}: has no .metadata: not a DCP save (or not a whole one)")


def _plain_into(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the item's bytes may be read straight into ``target``'s memory: a plain
    contiguous CPU tensor of the item's dtype. Anything else (a conjugate or negative view,
    whose bits mean other values; a tensor subclass, which may hold no storage of its own)
    takes the bytes through ``copy_``, which knows what they mean."""
    return (
        type(target) is torch.Tensor
        and target.layout == torch.strided
        and target.device.type == "cpu"
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def pread_into(fd: int, path: str, tensor: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU ``tensor``'s bytes from ``fd`` at ``offset``."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return
    into = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise FormatError(f"{path}: ends at byte {offset + done}, inside an item")
        done += n
