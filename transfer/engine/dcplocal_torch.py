"""Load a DCP step from the node's own disk, each tensor's bytes read once, straight into
the state_dict: ``dcp.load(state_dict, storage_reader=LocalReader(step_dir))``.

torch's ``FileSystemReader`` reads each tensor item whole and ``torch.load``s it into a new
tensor, which DCP then copies into the target (dcpitem_torch.py). This reader finds where
the item's values lie from its first bytes and reads the bytes the load plan asks for with
one ``pread`` into the target tensor's memory (or into a scratch buffer, when the target is
not a plain contiguous CPU tensor of the item's dtype, and copies from there). A rank that
loads a narrowing of an item (a resharded load) reads the item's bytes from the
narrowing's first element to its last: its rows alone, for a shard of rows. Each kind of
item head is parsed once per load (``StoredTensors``), and once a file's heads are parsed
its bytes are copied on a few threads, one ``preadv`` per run of items, while the next
file's heads are parsed (``_Copies``; a real fine-tune's 288 MB from the page cache: the
load 0.100 s -> 0.070 s; the 1.69 GB 8-rank corpus, a fresh process's first load,
0.37-0.43 -> 0.31-0.32 s).
Anything this does not recognise, and every byte item, is read by ``FileSystemReader``
itself, so every save torch can load, this loads. ``.metadata`` is unpickled as
FerryReader unpickles it (dcpmetadata_torch.py): DCP's own types, nothing else built.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import gc
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from transfer.engine.dcp import MAX_METADATA_BYTES
from transfer.engine.dcpitem_torch import HEAD_BYTES, TRAILER_BYTES, StoredTensors, check_size
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
        # (the collector paused, as for the read: the unpickle makes ~30 objects an item,
        # and a full collection it set off took 0.10-0.15 s in a process holding torch)
        with _collector_paused():
            return metadata_from(raw, str(self.path), self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        # the cyclic collector paused while the items are read: a load allocates a few
        # objects per item and frees them as it goes, and a full collection of a process
        # that imported torch took 0.05-0.15 s of a 0.1-0.6 s load (the 289 MB fine-tune's
        # warm load 0.09-0.13 -> 0.07-0.08 s, the 1.69 GB corpus's 0.54-0.59 -> 0.40-0.50)
        with _collector_paused():
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        # (each item's storage info looked up once: its key's hash is a dataclass's, ~3 us)
        by_file: dict[str, list[tuple[Any, ReadItem]]] = {}
        rest: list[ReadItem] = []  # what FileSystemReader reads, as it always has
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                rest.append(req)
            else:
                by_file.setdefault(info.relative_path, []).append((info, req))
        self._heads = StoredTensors()  # (one save's: its items' heads are of a few kinds)
        # torch's planner does nothing when a tensor is in: its targets are all filled
        # first, on threads; a planner that does something (copies from a staging tensor
        # it allocated in resolve_tensor) has each filled and committed in turn, so that
        # its staging tensors are not all alive at once
        defer = type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor
        filled: list[tuple[ReadItem, torch.Tensor]] = []
        with _Copies(READ_THREADS) as copies:
            for relative_path, reqs in by_file.items():
                path = os.path.join(self.path, relative_path)
                for req, target in self._read_file(path, reqs, planner, copies, rest):
                    if defer:
                        filled.append((req, target))
                    else:
                        copies.run()
                        planner.commit_tensor(req, target)
        for req, target in filled:  # (every byte of every target is in: copies ran)
            planner.commit_tensor(req, target)
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_file(
        self,
        path: str,
        reqs: list[tuple[Any, ReadItem]],
        planner: LoadPlanner,
        copies: _Copies,
        left: list[ReadItem],
    ) -> Iterator[tuple[ReadItem, torch.Tensor]]:
        """Each of ``reqs`` (items of the file at ``path``, with their storage info) this
        reads, with its target, its bytes on their way (``copies``, through this file's
        descriptor: the file read is the file parsed); those it does not read go to
        ``left`` (torch.load them)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(
                f"{path}: not there, and .metadata names it (another node's part of "
                "the step, not pulled here?)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            for info, req in sorted(reqs, key=lambda r: r[0].offset):
                if info.offset + info.length > size:
                    raise FormatError(
                        f"{path}: ends at byte {size}, inside {req.storage_index.fqn} "
                        f"(bytes {info.offset}..{info.offset + info.length}): cut short"
                    )
                target = self._read_tensor(fd, path, info, req, planner, copies)
                if target is None:
                    left.append(req)
                else:
                    yield req, target
        except BaseException:
            copies.discard(fd)
            os.close(fd)
            raise
        copies.adopt(fd)  # (closed once its copies are made)

    def _read_tensor(
        self, fd: int, path: str, info: Any, req: ReadItem, planner: LoadPlanner, copies: _Copies
    ) -> torch.Tensor | None:
        """Read ``req`` (its item's storage ``info``) into its target (straight into it: by
        ``copies``, perhaps not yet done), and return the target; None when its item is
        not one this reads."""
        stored = self._heads(os.pread(fd, min(HEAD_BYTES, info.length), info.offset))
        if stored is None or stored.data_end > info.length:
            return None  # (a torn item: torch.load says what is wrong with it)
        if not stored.trailer_ok(os.pread(fd, TRAILER_BYTES, info.offset + stored.data_end)):
            return None
        span = stored.span(tuple(req.storage_offsets), tuple(req.lengths), req.storage_index.fqn)
        target = planner.resolve_tensor(req).detach()
        check_size(req, span.size, target)
        where = info.offset + span.start
        if span.contiguous and _plain_into(target, stored.dtype):
            copies.add(fd, path, bytes_of(target), where)
        elif span.length:  # (rare: read here, then copied by torch, which knows the layout)
            scratch = torch.empty(span.length, dtype=torch.uint8)
            pread_full(fd, path, bytes_of(scratch), where)
            target.copy_(scratch.view(stored.dtype).as_strided(span.size, span.stride))
        return target


#: threads copying items' bytes into the targets: 288 MB of a real fine-tune's save from
#: the page cache into its 532 tensors in 0.036 s on one thread, 0.026 s on two (2-core VM)
READ_THREADS = min(4, os.cpu_count() or 1)
#: below this, one thread copies everything (a thread's start costs more than it saves)
THREADED_BYTES = 64 << 20
#: a tensor's bytes are read in pieces of at most this (batches end between pieces, so a
#: large tensor is split over threads)
PIECE_BYTES = 8 << 20
#: a gap this small between two reads of a file is read too (into a scratch buffer) so both
#: are one ``preadv``: a file's items lie data, trailer, next head (~700 bytes), data...
MAX_GAP = 64 << 10
#: a ``preadv`` ends at the first piece that takes it to this many bytes (so a file's
#: reads are split over the threads)
BATCH_BYTES = 32 << 20
#: the buffers of one ``preadv`` at most (Linux's IOV_MAX)
MAX_BUFFERS = 1024


@dataclasses.dataclass
class _Batch:
    """Reads of one file that lie close together, made by one ``preadv`` from ``offset``:
    each part is a buffer to fill or, an int, a gap of that many bytes (read into a
    scratch buffer: the items' heads and trailers between their data)."""

    fd: int
    path: str
    offset: int
    parts: list[memoryview | int]


class _Copies:
    """Reads of byte ranges of files into memory, gathered while the caller parses: once a
    file's are all gathered (``adopt``), each run of them that lies close together is one
    ``preadv`` (``_Batch``: one system call, and one release of the GIL, for hundreds of
    items), started on ``threads`` threads as soon as there is enough to copy, while the
    caller parses the next file (a read per item waited for the GIL behind the parsing at
    every item: slower than copying after, which is why copies are gathered at all).
    ``run`` waits for every read and raises the first error; the files' descriptors handed
    over are closed once their reads are made."""

    #: descriptors kept open at most: more files than this, and the reads are made first
    MAX_OPEN = 64

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._reads: dict[int, list[tuple[memoryview, int]]] = {}  # per fd, not yet batched
        self._paths: dict[int, str] = {}
        self._bytes = 0  # gathered since the last run
        self._batches: list[_Batch] = []  # made, not yet started
        self._started: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._fds: list[int] = []

    def add(self, fd: int, path: str, into: memoryview, offset: int) -> None:
        reads = self._reads.setdefault(fd, [])
        self._paths[fd] = path
        for at in range(0, len(into), PIECE_BYTES):
            reads.append((into[at : at + PIECE_BYTES], offset + at))
        self._bytes += len(into)

    def adopt(self, fd: int) -> None:
        """``fd``'s reads are all added: they start, and it is closed once they are made
        (by ``run``, whatever happens from here)."""
        self._fds.append(fd)
        if len(self._fds) > self.MAX_OPEN:
            self.run()
            return
        self._batch(fd)
        self._start()

    def discard(self, fd: int) -> None:
        """Forget the reads through ``fd`` (its file failed before it was adopted: none of
        its reads started; the caller closes it)."""
        self._reads.pop(fd, None)
        self._batches = [b for b in self._batches if b.fd != fd]

    def run(self) -> None:
        """Make every read gathered, then close the descriptors adopted."""
        try:
            for fd in list(self._reads):
                self._batch(fd)
            self._start()
            for batch in self._batches:  # (too few bytes for threads: on this one)
                _read_batch(batch)
        finally:
            self._batches = []
            # every started read ended before a descriptor closes (a closed number can be
            # reused by the next open: a read still going would read another file); a
            # wait interrupted (Ctrl-C) leaves both for the ``with``'s end to finish
            concurrent.futures.wait(self._started)
            started, self._started = self._started, []
            fds, self._fds = self._fds, []
            for fd in fds:
                os.close(fd)
            self._bytes = 0
        for done in started:
            if not done.cancelled():  # (cancelled: the load failed, its error is raised)
                done.result()

    def _batch(self, fd: int) -> None:
        reads = self._reads.pop(fd, None)
        if reads:
            self._batches += _batches(fd, self._paths[fd], reads)

    def _start(self) -> None:
        """Hand the batches made to the threads, once there is enough to copy for them."""
        if self._pool is None and self._threads > 1 and self._bytes >= THREADED_BYTES:
            self._pool = ThreadPoolExecutor(self._threads, "ferry-load")
        if self._pool is not None:
            while self._batches:  # (one at a time: each started one is waited for)
                self._started.append(self._pool.submit(_read_batch, self._batches[0]))
                del self._batches[0]

    def __enter__(self) -> _Copies:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.run()
                return
            self._reads, self._batches = {}, []  # (the load failed: nothing more is copied)
            for done in self._started:
                done.cancel()
            with contextlib.suppress(Exception):  # (the load's own error is the one raised)
                self.run()
        finally:
            if self._pool is not None:
                self._pool.shutdown()


def _batches(fd: int, path: str, reads: list[tuple[memoryview, int]]) -> list[_Batch]:
    """``reads`` of one file as the fewest ``preadv``s: in file order, a batch goes on
    over gaps of up to MAX_GAP bytes, to BATCH_BYTES and MAX_BUFFERS (two reads of the
    same bytes, or far apart, start another)."""
    out: list[_Batch] = []
    batch: _Batch | None = None
    end = nbytes = 0
    for into, offset in sorted(reads, key=lambda r: r[1]):
        gap = offset - end
        if (
            batch is None
            or not 0 <= gap <= MAX_GAP
            or nbytes >= BATCH_BYTES
            or len(batch.parts) + 2 > MAX_BUFFERS
        ):
            batch = _Batch(fd, path, offset, [])
            out.append(batch)
            nbytes = gap = 0
        if gap:
            batch.parts.append(gap)
        batch.parts.append(into)
        end, nbytes = offset + len(into), nbytes + len(into)
    return out


def _read_batch(batch: _Batch) -> None:
    """Fill a batch's buffers from its file: one ``preadv``, more only after a short read."""
    gaps = [p for p in batch.parts if isinstance(p, int)]
    scratch = memoryview(bytearray(max(gaps, default=0)))
    buffers = [scratch[:p] if isinstance(p, int) else p for p in batch.parts]
    offset, first = batch.offset, 0
    while first < len(buffers):
        n = os.preadv(batch.fd, buffers[first:] if first else buffers, offset)
        if n == 0:
            raise FormatError(f"{batch.path}: ends at byte {offset}, inside an item")
        offset += n
        while first < len(buffers) and n >= len(buffers[first]):
            n -= len(buffers[first])
            first += 1
        if n:  # (a short read, inside a buffer: the rest of it next)
            buffers[first] = buffers[first][n:]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (process-wide: the load's
    other threads too), on again after it if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


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


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The contiguous CPU ``tensor``'s memory, as writable bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def pread_full(fd: int, path: str, into: memoryview, offset: int) -> None:
    """Fill ``into`` from ``fd`` at ``offset`` (a batch of one read)."""
    _read_batch(_Batch(fd, path, offset, [into]))
