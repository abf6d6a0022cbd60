"""Load a DCP step straight from a ferry store: ``dcp.load(state_dict, storage_reader=
FerryReader(store, job, step))``.

Each rank fetches only the storage items its load plan reads (after a scale-down, the new
rank's share of the resharded step) and deserialises each item the moment its last byte is
in, while the rest are still arriving: the fetch and the load overlap, and the node's disk
is out of the path (nothing is written and read back). The bytes come as a pull's do
(memrestore.py): unchanged chunks and delta bases from the node's earlier checkpoint when
``base_dir`` names it, the rest from the store, every chunk verified against its id.

``.metadata`` is a pickle, as DCP writes it; it is read with an unpickler that builds only
DCP's own metadata types (a store that serves anything else gets a one-line error, never
code run). torch is imported here: the rest of ckpt-ferry never needs it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import uuid
import weakref
from collections import defaultdict
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from transfer.codec.transforms import Buffer
from transfer.engine.catalog import resolve_checkpoint, resolve_manifests
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA
from transfer.engine.dcpitem_torch import check_size, tensor_of_item
from transfer.engine.dcpmetadata_torch import metadata_from
from transfer.engine.dcpshare import merge_ranges
from transfer.engine.itemassembly import DEFAULT_BUDGET, ItemAssembly, Slice
from transfer.engine.loopthread import LoopThread
from transfer.engine.memrestore import (
    MemRestoreResult,
    RangePlan,
    StepChunks,
    plan_ranges,
    restore_plan,
)
from transfer.engine.pull import committed_manifests, held_at
from transfer.engine.scan import check_base_dir
from transfer.errors import FerryError, FormatError
from transfer.format.names import step_from_dirname
from transfer.options import TransferOptions
from transfer.store.base import Store
from transfer.store.url import StoreOptions, open_store

log = logging.getLogger(__name__)


class FerryReader(StorageReader):
    """A DCP StorageReader over step ``step`` (None: the newest) of ``job`` in ``store``
    (a Store or a store URL, as ``ferry`` takes it). ``base_dir``: this node's copy of an
    earlier step of the job; named as ferry names steps (``step_000040``), its manifests
    say which of its chunks to read, else every position is read and hashed.
    ``memory_budget``: the item buffers a load keeps before the fetch waits for it
    (itemassembly.py). ``last_restore`` reports the last read's bytes.

    In a process group (torch.distributed initialised, more than one rank) one rank, the
    coordinator, reads the step's manifests and ``.metadata`` and plans every rank's
    chunks; the others get ``.metadata`` by broadcast and their plan inside DCP's load
    plan, and ask the store for their chunks only. So a load of N nodes' parts costs the
    store O(N) control requests, not O(N) per rank. ``process_group`` must be the one
    given to ``dcp.load`` (None: the default group, as there); the coordinator is its rank
    0, as DCP's. ``process_group=ALONE`` makes this rank read for itself (``dcp.load(
    no_dist=True)``, or a load only some ranks make; every rank of one ``dcp.load`` passes
    the same, and several ALONE ranks name the step: "the newest" is each one's own look).
    In a group ``read_metadata`` is collective: call
    it on every rank or on none (on rank 0 alone it waits for the others until the
    group's timeout).

    Alone (no group), the step is resolved here, so a wrong store, job, step or
    ``base_dir`` fails in one line before ``dcp.load`` (inside it, DCP wraps every error
    in a CheckpointException); in a group, in ``read_metadata``, on every rank alike."""

    def __init__(
        self,
        store: Store | str,
        job: str,
        step: int | None = None,
        *,
        base_dir: str | Path | None = None,
        endpoint_url: str | None = None,
        options: TransferOptions | None = None,
        memory_budget: int = DEFAULT_BUDGET,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise TypeError(f"step must be an int or None, not {type(step).__name__} {step!r}")
        self.options = options or TransferOptions()
        self.job = job
        self.base_dir = Path(base_dir) if base_dir is not None else None
        check_base_dir(self.base_dir)
        owned = isinstance(store, str)
        if isinstance(store, str):
            opened = StoreOptions.for_window(self.options.window, endpoint_url=endpoint_url)
            store = open_store(store, opened)
        self.store = store
        self.memory_budget = memory_budget
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.last_restore: MemRestoreResult | None = None
        self.bytes_fetched = 0  # stored bytes this reader read from the store, all calls
        self.step: int | None = step  # (the newest, once resolved)
        self._group = None if process_group is ALONE else _Group.of(process_group)
        self._metadata: bytes | None = None
        self._step_chunks: StepChunks | None = None  # where the manifests were read
        self._held: dict[int, dict[tuple[str, int], tuple[str, int]] | None] = {}
        self._loop = LoopThread("ferry-reader")
        # a reader dropped without close() still ends its thread (and the store it opened)
        self._close = weakref.finalize(self, _close, self._loop, store if owned else None)
        if self._group is None:
            try:
                self._resolve()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """End the reader's loop and, if the reader opened the store (a URL), its
        connections; also at ``with``'s end. Again: nothing."""
        self._close()

    def __enter__(self) -> FerryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._close.alive:
            raise FerryError("this FerryReader is closed: make a new one for another load")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        return False  # never chosen by a path: the caller names the store and the step

    def reset(self, checkpoint_id: str | Any = None) -> None:
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self) -> Metadata:
        # (no **kwargs: DCP retries a reader that takes them with rank-local metadata, which
        # a step has none of: a second traceback per rank, and in a group a second broadcast)
        self._check_open()
        if self._metadata is None:
            if self._group is None:
                self._metadata = self._read_metadata_file()
            else:
                self._metadata, self.step = self._group.from_coordinator(
                    lambda: (self._read_metadata_file(), self.step)
                )
        metadata = metadata_from(self._metadata, f"{self.job} step {self.step}", self.load_id)
        return metadata

    def _resolve(self) -> StepChunks:
        """The step's manifests, read once (on the coordinator only, in a group)."""
        if self._step_chunks is None:
            # latest: the newest complete step, as everywhere; a step named is its parts (the
            # load itself finds a file missing: no request more on every load's coordinator)
            resolving = (
                resolve_checkpoint(self.store, self.job, None, ())
                if self.step is None
                else resolve_manifests(self.store, self.job, self.step)
            )
            manifests = self._loop.run(resolving)
            self._step_chunks = StepChunks(manifests)
            self.step = self._step_chunks.step
        return self._step_chunks

    def _read_metadata_file(self) -> bytes:
        """The step's ``.metadata`` (a load reads it on every rank, and a caller often once
        more to build its state_dict: it is kept)."""
        step = self._resolve()
        what = f"{self.job} step {step.step}"
        if METADATA not in step.files:
            raise FerryError(f"{what} has no {METADATA}: not a DCP save")
        size = step.files[METADATA].size
        if size > MAX_METADATA_BYTES:
            raise FormatError(f"{what}: {METADATA} is over the limit")
        raw = bytearray(size)

        def landed(path: str, offset: int, data: Buffer) -> None:
            raw[offset : offset + len(data)] = data

        plan = plan_ranges(step, {METADATA: [(0, size)]})
        got = self._loop.run(restore_plan(self.store, plan, landed, None, self.options))
        self.bytes_fetched += got.bytes_fetched
        return bytes(raw)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise FormatError(f"{self.job}: {METADATA} has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The rank tells the coordinator which step its base_dir holds: the coordinator
        then says which chunks are worth looking for there."""
        return dataclasses.replace(plan, storage_data=_RankAsk(self._base_step()))

    def _base_step(self) -> int | None:
        """The step this node's base_dir holds, by its name (None: none, or unnamed)."""
        return None if self.base_dir is None else step_from_dirname(self.base_dir.name)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(The coordinator, or a rank alone.) Every rank's chunks, planned from the
        manifests read once here, go to the rank inside its load plan."""
        step = self._resolve()
        made: dict[Any, RangePlan] = {}  # ranks that read the same (a replicated load)
        out = []
        for plan in plans:
            ask = plan.storage_data
            base = ask.base_step if isinstance(ask, _RankAsk) else None
            wanted = merge_ranges(self._slices(plan))
            key = (tuple(wanted.items()), base)
            if key not in made:
                made[key] = plan_ranges(step, wanted, self._held_at(base))
            out.append(dataclasses.replace(plan, storage_data=made[key]))
        return out

    def _held_at(self, base_step: int | None) -> dict[tuple[str, int], tuple[str, int]] | None:
        """What step ``base_step``'s manifests place where (read once per base step)."""
        if base_step is None:
            return None
        if base_step not in self._held:
            base = self._loop.run(committed_manifests(self.store, self.job, base_step))
            self._held[base_step] = None if base is None else held_at(base)
        return self._held[base_step]

    def _slices(self, plan: LoadPlan) -> dict[Slice, list[ReadItem]]:
        """The plan's reads by the stored item (file, offset, length) each narrows."""
        by_slice: dict[Slice, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise FerryError(
                    f"{info.relative_path}: items written with storage transforms "
                    f"({list(info.transform_descriptors)}) are not supported by FerryReader"
                )
            by_slice[(info.relative_path, int(info.offset), int(info.length))].append(req)
        return by_slice

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Fetch the plan's items and load each into the planner as soon as it is whole
        (in this thread: the planner is not thread-safe); the fetch runs meanwhile."""
        self._check_open()
        by_slice = self._slices(plan)
        wanted = merge_ranges(by_slice)
        ranges = plan.storage_data
        if not isinstance(ranges, RangePlan) or (ranges.step, ranges.wanted) != (self.step, wanted):
            # a planner that rewrote the plan after the coordinator planned it: plan here
            log.info("%s step %s: planning this rank's chunks here", self.job, self.step)
            ranges = plan_ranges(self._resolve(), wanted, self._held_at(self._base_step()))
        assembly = ItemAssembly(list(by_slice), self.memory_budget)
        fetch = self._loop.submit(
            restore_plan(self.store, ranges, assembly.landed, self.base_dir, self.options)
        )
        fetch.add_done_callback(lambda f: assembly.ended(None if f.cancelled() else f.exception()))
        try:
            for key, data in assembly.whole_items():
                for req in by_slice[key]:
                    _load_item(req, data, planner)
        except BaseException:
            assembly.abandon()  # a bad item, or the fetch's own error: end the rest of it,
            fetch.stop()  # and wait until no thread of it lands bytes any more
            raise
        self.last_restore = fetch.result()
        self.bytes_fetched += self.last_restore.bytes_fetched
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


class _Alone:
    def __repr__(self) -> str:
        return "ALONE"

    def __reduce__(self) -> str:
        return "ALONE"  # (unpickled as this module's ALONE: it is told by identity)


#: ``FerryReader(..., process_group=ALONE)``: this rank reads the step for itself
ALONE: Any = _Alone()


@dataclasses.dataclass(frozen=True)
class _RankAsk:
    """What a rank's local plan carries to the coordinator."""

    base_step: int | None  # the step its base_dir holds (by its name), if any


class _Group:
    """The process group a load runs in, for the one exchange DCP has no hook for: every
    rank needs ``.metadata`` before DCP's first collective, and only one should read it.
    The coordinator is the group's rank 0, as DCP's own."""

    COORDINATOR = 0

    def __init__(self, group: Any) -> None:
        self.group = group

    @classmethod
    def of(cls, group: Any) -> _Group | None:
        """None when this process loads alone (no group, or a group of one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size(group) <= 1:
            return None
        return cls(group)

    def from_coordinator(self, read: Any) -> Any:
        """(Collective.) ``read()`` on the coordinator; its value on every rank, or its
        error: the coordinator's own exception there, a FerryError with its reason on the
        others. Whatever ``read`` raises, the broadcast happens, so no rank waits for one
        that never comes."""
        box: list[Any] = [None]
        mine: BaseException | None = None
        if dist.get_rank(self.group) == self.COORDINATOR:
            try:
                box[0] = (True, read())
            except BaseException as exc:  # (a KeyboardInterrupt too: DCP carries on to its
                mine = exc  # gather, where every rank must meet it)
                what = str(exc) if isinstance(exc, FerryError) else f"{type(exc).__name__}: {exc}"
                box[0] = (False, f"the coordinator (rank {self.COORDINATOR}): {what}")
        src = self.COORDINATOR
        if self.group is not None:
            src = dist.get_global_rank(self.group, self.COORDINATOR)
        dist.broadcast_object_list(box, src=src, group=self.group)
        ok, value = box[0]
        if ok:
            return value
        if mine is not None:
            raise mine
        raise FerryError(value)


def _close(loop: LoopThread, store: Store | None) -> None:
    """(A finalizer: no reference to the reader.) The reader's loop, and a store it opened."""
    if store is not None:
        loop.run(store.close())
    loop.close()


def _load_item(req: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))  # (a copy: the planner may keep it)
        return
    tensor = tensor_of_item(data)  # over the item's own bytes: copied once, into the target
    if tensor is None:  # not a plain tensor: as DCP loads it
        item = cast(IO[bytes], _ViewReader(data))
        tensor = torch.load(item, map_location="cpu", weights_only=True)
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    target = planner.resolve_tensor(req).detach()
    check_size(req, tensor.size(), target)
    target.copy_(tensor)
    planner.commit_tensor(req, target)


class _ViewReader(io.RawIOBase):
    """A read-only file over a memoryview: torch.load reads an item where it landed (an
    io.BytesIO would copy the item first)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._at = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), len(self._view) - self._at))
        memoryview(buf).cast("B")[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at
