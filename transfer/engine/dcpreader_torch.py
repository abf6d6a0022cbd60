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

import asyncio
import bisect
import concurrent.futures
import contextlib
import io
import pickle
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from transfer.codec.transforms import Buffer
from transfer.engine.catalog import resolve_manifests
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA
from transfer.engine.dcpshare import merge_ranges
from transfer.engine.memrestore import MemRestoreResult, Wanted, restore_ranges, whole_files
from transfer.errors import FerryError, FormatError
from transfer.format.manifest import Manifest
from transfer.options import TransferOptions
from transfer.store.base import Store
from transfer.store.url import StoreOptions, open_store

#: (storage file, offset, length): one stored item, which one or more ReadItems narrow
Slice = tuple[str, int, int]
T = TypeVar("T")


class FerryReader(StorageReader):
    """A DCP StorageReader over step ``step`` (None: the newest) of ``job`` in ``store``
    (a Store or a store URL, as ``ferry`` takes it). ``base_dir``: this node's copy of an
    earlier step of the job, named as ferry names steps (``step_000040``).
    ``last_restore`` reports the last read's bytes after each ``read_data``."""

    def __init__(
        self,
        store: Store | str,
        job: str,
        step: int | None = None,
        *,
        base_dir: str | Path | None = None,
        endpoint_url: str | None = None,
        options: TransferOptions | None = None,
    ) -> None:
        super().__init__()
        self.options = options or TransferOptions()
        if isinstance(store, str):
            opened = StoreOptions.for_window(self.options.window, endpoint_url=endpoint_url)
            store = open_store(store, opened)
        self.store = store
        self.job, self.step = job, step
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.last_restore: MemRestoreResult | None = None
        self.bytes_fetched = 0  # stored bytes this reader read from the store, all calls
        self._manifests: list[Manifest] | None = None
        self._metadata: bytes | None = None
        self._loop = _LoopThread()

    def close(self) -> None:
        """Close the store's connections and the reader's loop (also at ``with``'s end)."""
        self._loop.run(self.store.close())
        self._loop.close()

    def __enter__(self) -> FerryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        return False  # never chosen by a path: the caller names the store and the step

    def reset(self, checkpoint_id: str | Any = None) -> None:
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        what = f"{self.job} step {self.manifests()[0].step}"
        metadata = _metadata_from(self._metadata_bytes(), what)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _metadata_bytes(self) -> bytes:
        """The step's ``.metadata``, fetched once (a load reads it on every rank, and a
        caller often once more to build its state_dict)."""
        if self._metadata is not None:
            return self._metadata
        manifests = self.manifests()
        sizes = {f.path: f.size for m in manifests for f in m.files}
        what = f"{self.job} step {manifests[0].step}"
        if METADATA not in sizes:
            raise FerryError(f"{what} has no {METADATA}: not a DCP save")
        if sizes[METADATA] > MAX_METADATA_BYTES:
            raise FormatError(f"{what}: {METADATA} is over the limit")
        raw = bytearray(sizes[METADATA])

        def landed(path: str, offset: int, data: Buffer) -> None:
            raw[offset : offset + len(data)] = data

        wanted = whole_files(manifests, [METADATA])
        got = self._loop.run(
            restore_ranges(self.store, manifests, wanted, landed, self.base_dir, self.options)
        )
        self.bytes_fetched += got.bytes_fetched
        self._metadata = bytes(raw)
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise FormatError(f"{self.job}: {METADATA} has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Fetch the plan's items and load each into the planner as soon as it is whole
        (in this thread: the planner is not thread-safe); the fetch runs meanwhile."""
        by_slice: dict[Slice, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise FerryError(
                    f"{info.relative_path}: items written with storage transforms "
                    f"({list(info.transform_descriptors)}) are not supported by FerryReader"
                )
            by_slice[(info.relative_path, int(info.offset), int(info.length))].append(req)
        assembly = _Assembly(list(by_slice))
        wanted: Wanted = merge_ranges(by_slice)
        fetch = self._loop.submit(
            restore_ranges(self.store, self.manifests(), wanted, assembly.landed,
                           self.base_dir, self.options)
        )  # fmt: skip
        fetch.add_done_callback(lambda f: assembly.fail(None if f.cancelled() else f.exception()))
        try:
            for key, data in assembly.whole_items():
                for req in by_slice[key]:
                    _load_item(req, data, planner)
        except BaseException:
            fetch.cancel()  # a bad item, or the fetch's own error: end the rest of it
            with contextlib.suppress(BaseException):
                fetch.exception()  # (waits for the cancellation to finish)
            raise
        self.last_restore = fetch.result()
        self.bytes_fetched += self.last_restore.bytes_fetched
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def manifests(self) -> list[Manifest]:
        """The step's parts, resolved once (every later call reads the same step)."""
        if self._manifests is None:
            self._manifests = self._loop.run(resolve_manifests(self.store, self.job, self.step))
            self.step = self._manifests[0].step
        return self._manifests


def _load_item(req: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))  # (a copy: the planner may keep it)
        return
    item = cast(IO[bytes], _ViewReader(data))
    tensor = torch.load(item, map_location="cpu", weights_only=True)
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise FormatError(
            f"{req.storage_index.fqn}: the checkpoint holds {tuple(tensor.size())}, "
            f"the state_dict wants {tuple(target.size())}"
        )
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
        n = min(len(buf), len(self._view) - self._at)
        memoryview(buf).cast("B")[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


class _Recycled:
    """Item buffers handed back once loaded and given out again: fresh pages cost a fault
    each (bench/page_cost.py: 0.7-1.0 ms per MiB on this VM's anonymous memory), and a
    load's items come and go one after another. Keeps at most ``keep`` bytes idle."""

    def __init__(self, keep: int = 512 << 20) -> None:
        self._idle: list[bytearray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        with self._lock:
            fits = [b for b in self._idle if n <= len(b) <= 2 * n + (4 << 20)]
            if fits:
                buf = min(fits, key=len)
                self._idle.remove(buf)
                return memoryview(buf)[:n]
        return memoryview(bytearray(n))

    def give(self, view: memoryview) -> None:
        buf = view.obj
        assert isinstance(buf, bytearray)
        view.release()
        with self._lock:
            self._idle.append(buf)
            while sum(len(b) for b in self._idle) > self._keep:
                self._idle.remove(min(self._idle, key=len))


class _Assembly:
    """The plan's items filling up as chunks land (in the fetch's threads): each item's
    buffer is made when its first byte lands and handed on, whole, to the loading thread,
    which drops it once loaded, so memory holds the items in flight, not the step."""

    _END = ("", -1, -1)

    def __init__(self, slices: list[Slice]) -> None:
        by_path: dict[str, list[Slice]] = defaultdict(list)
        for s in sorted(set(slices), key=lambda s: (s[0], s[1])):
            by_path[s[0]].append(s)
        self._by_path = dict(by_path)
        self._starts = {p: [s[1] for s in items] for p, items in by_path.items()}
        self._left = {s: s[2] for s in slices}
        self._buffers: dict[Slice, memoryview] = {}
        self._recycled = _Recycled()
        self._lock = threading.Lock()
        self._whole: queue.SimpleQueue[Slice] = queue.SimpleQueue()
        self._error: BaseException | None = None
        for s, n in self._left.items():
            if n == 0:
                self._whole.put(s)

    def landed(self, path: str, offset: int, data: Buffer) -> None:
        items, starts = self._by_path.get(path, []), self._starts.get(path, [])
        end = offset + len(data)
        view = memoryview(data).cast("B")
        i = max(bisect.bisect_right(starts, offset) - 1, 0)
        while i < len(items) and items[i][1] < end:
            key = items[i]
            lo, hi = max(offset, key[1]), min(end, key[1] + key[2])
            i += 1
            if lo >= hi:
                continue
            with self._lock:
                buf = self._buffers.get(key)
                if buf is None:
                    buf = self._buffers[key] = self._recycled.take(key[2])
            buf[lo - key[1] : hi - key[1]] = view[lo - offset : hi - offset]
            with self._lock:
                self._left[key] -= hi - lo
                if self._left[key] == 0:
                    self._whole.put(key)

    def fail(self, exc: BaseException | None) -> None:
        """The fetch ended: with ``exc``, or None when every chunk landed."""
        self._error = exc
        self._whole.put(self._END)

    def whole_items(self) -> Iterator[tuple[Slice, memoryview]]:
        """Each item as it becomes whole, its buffer recycled once the caller is done with
        it (when the caller asks for the next); raises the fetch's error, if any."""
        todo = len(self._left)
        while todo:
            key = self._whole.get()
            if key == self._END:
                if self._error is not None:
                    raise self._error
                left = sum(1 for n in self._left.values() if n)
                raise FormatError(f"the step's chunks left {left} item(s) incomplete")
            todo -= 1
            with self._lock:
                data = self._buffers.pop(key, None)
            if data is None:  # an empty item: nothing landed
                yield key, memoryview(bytearray(key[2]))
                continue
            yield key, data
            self._recycled.give(data)


class _LoopThread:
    """An event loop in a daemon thread of its own, for the reader's store calls: one loop
    for the reader's life (a store's sessions belong to the loop that opened them), and
    synchronous callers anywhere, even in a thread whose own loop is running."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="ferry-reader", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata types and nothing else (a pickle can name any callable)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module
            in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
            or (module == "torch" and name == "Size")
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"))
            or (module == "collections" and name == "OrderedDict")
        )
        if module == "torch" and not allowed:
            value = getattr(torch, name, None)
            allowed = isinstance(value, torch.dtype | torch.layout | torch.memory_format)
        if not allowed or name.startswith("__"):
            raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


def _metadata_from(raw: bytes, what: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as exc:
        raise FormatError(f"{what}: {METADATA} is not DCP metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{what}: {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata
