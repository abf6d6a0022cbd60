"""Pack writes that bypass the page cache (transfer/directio.py): whatever the
offsets, lengths and order of the parts, the file holds exactly the bytes written, on a
real file system that does O_DIRECT (the test directory's) and where it does not."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from transfer import directio
from transfer.store.local import LocalStore


def direct_fd_or_skip(path: Path) -> int:
    fd = directio.open_direct(path)
    if fd is None:
        pytest.skip(f"{path.parent} does not do O_DIRECT")
    return fd


@pytest.mark.parametrize("seed", range(4))
def test_parts_at_any_offset_and_in_any_order_land_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setattr(directio, "SLICE", 3 * directio.ALIGN)  # several slices per part
    rng = random.Random(seed)
    data = rng.randbytes(200_000 + rng.randrange(directio.ALIGN))
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(6))})
    cuts += [c for c in range(0, len(data), 5 * directio.ALIGN) if c not in cuts]  # aligned
    cuts = sorted(set(cuts))
    parts = [(a, data[a:b]) for a, b in itertools.pairwise(cuts)]
    rng.shuffle(parts)
    path = tmp_path / "pack"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    direct = direct_fd_or_skip(path)
    try:
        for offset, piece in parts:
            directio.write_at(fd, direct, offset, piece)
        os.fsync(fd)
    finally:
        os.close(direct)
        os.close(fd)
    assert path.read_bytes() == data


def test_without_direct_io_every_write_is_buffered(tmp_path: Path) -> None:
    path = tmp_path / "pack"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        directio.write_at(fd, None, 5, b"abc")
        directio.write_at(fd, None, 0, b"01234")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"01234abc"


def test_a_local_upload_goes_direct_and_reads_back_byte_exact(tmp_path: Path) -> None:
    """A store upload: aligned parts out of order and a short, unaligned last one."""
    part = 64 * 1024
    data = random.Random(7).randbytes(5 * part + 1234)
    store = LocalStore(tmp_path)

    async def upload() -> None:
        up = await store.begin_upload("packs/p")
        assert up._direct_fd is not None or directio.open_direct(tmp_path / "probe") is None
        order = [3, 0, 5, 1, 4, 2]
        await asyncio.gather(
            *(up.write_part(i + 1, i * part, data[i * part : (i + 1) * part]) for i in order)
        )
        await up.complete(create_only=True)

    (tmp_path / "probe").touch()
    asyncio.run(upload())
    assert (tmp_path / "packs/p").read_bytes() == data
    assert (
        asyncio.run(store.get("packs/p", 4 * part - 10, 4 * part + 10))
        == data[4 * part - 10 : 4 * part + 10]
    )


def test_reads_from_the_disk_make_writes_buffered_until_they_stop(tmp_path: Path) -> None:
    """A cold source being read: direct writes would compete with those reads."""
    path = tmp_path / "source"
    path.write_bytes(random.Random(1).randbytes(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
        reads = directio.DeviceReads()
        assert not reads.busy()
        before = reads._read_bytes()
        os.pread(fd, 8 << 20, 0)
        if reads._read_bytes() == before:
            pytest.skip("this file system reads no block device (tmpfs?)")
        assert reads.busy()
        os.pread(fd, 8 << 20, 0)  # now from the page cache
        assert not reads.busy()
    finally:
        os.close(fd)


def test_a_device_that_refuses_the_alignment_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with blocks larger than a page refuses page-aligned direct writes (EINVAL):
    the bytes still land, through the page cache. (Injected: no such device here.)"""
    path = tmp_path / "pack"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    direct = direct_fd_or_skip(path)
    real = os.pwrite

    def pwrite(target: int, data: Any, offset: int) -> int:
        if target == direct:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(target, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(directio.device_reads, "busy", lambda: False)
    data = random.Random(3).randbytes(5 * directio.ALIGN + 17)
    try:
        directio.write_at(fd, direct, 100, data)
    finally:
        os.close(direct)
        os.close(fd)
    assert path.read_bytes() == bytes(100) + data


def _staged_file(tmp_path: Path, chunk: int, count: int, tail: int) -> tuple[Path, Any]:
    from transfer.format.manifest import ChunkRef, FileEntry

    size = chunk * count + tail
    sizes = [chunk] * count + ([tail] if tail else [])
    refs = tuple(ChunkRef(f"{i:064x}", n, "raw", 0, 0, n) for i, n in enumerate(sizes))
    path = tmp_path / "f.bin"
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path, FileEntry("f.bin", size, 0o644, refs)


@pytest.mark.parametrize("slow_device", [False, True])
def test_a_restore_writes_its_chunks_direct_while_the_device_keeps_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_device: bool
) -> None:
    """A pull's staging files: every byte lands, whether the chunks go direct or (after
    SLOW_DIRECT_WRITES writes slower than MIN_DIRECT_RATE) buffered for a spell, after
    which direct writes are tried again."""
    from transfer.engine.staging import StagingFiles

    chunk, count, tail = 1 << 20, 12, 1234  # an unaligned last chunk, as a file's end has
    path, entry = _staged_file(tmp_path, chunk, count, tail)
    os.close(direct_fd_or_skip(path))
    monkeypatch.setattr(StagingFiles, "BUFFERED_SPELL", 3)
    # every write counts as slower than the floor, or none does (a loaded machine's disk
    # may well fall under 64 MB/s for two writes: the rule, not the disk, is under test)
    monkeypatch.setattr(StagingFiles, "MIN_DIRECT_RATE", 1e18 if slow_device else 0.0)
    rng = random.Random(5)
    pieces = [rng.randbytes(c.size) for c in entry.chunks]
    with StagingFiles(tmp_path, [entry], writeback=False) as out:
        order = list(range(len(pieces)))
        rng.shuffle(order)
        for i in order:
            out.pwrite(0, i * chunk, pieces[i])
        assert out._direct_fds[0] is not None  # the file was opened for direct writes
        # 12 whole chunks: slow, slow -> 3 buffered, slow, slow -> 3 buffered, slow, slow
        assert out.spells == (3 if slow_device else 0)
    assert path.read_bytes() == b"".join(pieces)


def test_aligned_memory_is_written_direct_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk decoded into page-aligned memory (directio.aligned) goes to the device as it
    is; unaligned memory through the aligned buffer; both land exactly."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    direct = direct_fd_or_skip(path)
    fd = os.open(path, os.O_WRONLY)
    copies: list[int] = []
    real = directio._aligned_buffer
    monkeypatch.setattr(directio, "_aligned_buffer", lambda: copies.append(1) or real())
    rng = random.Random(9)
    size = 3 * directio.ALIGN + 100  # an aligned interior and an unaligned tail
    fast = directio.aligned(size)
    fast[:] = rng.randbytes(size)
    slow = rng.randbytes(size)
    assert directio.is_aligned(fast) and not directio.is_aligned(memoryview(bytearray(8))[1:])
    try:
        directio.write_at(fd, direct, 0, fast, yield_to_reads=False)
        assert copies == []  # straight from the caller's memory
        directio.write_at(fd, direct, size + 4096 - size % 4096, slow, yield_to_reads=False)
        assert copies == [1]  # read-only bytes: through the aligned buffer
    finally:
        os.close(fd)
        os.close(direct)
    got = path.read_bytes()
    assert got[:size] == bytes(fast) and got[-size:] == slow


@pytest.mark.parametrize(
    ("write_path", "available_kib", "went"),
    [
        ("warm", 16 << 20, "warm"),  # fits: direct, read back into the page cache
        ("warm", 1 << 20, "direct"),  # 1 GiB available, all of it reserve: no room to spare
        ("auto", 1 << 20, "direct"),
        ("auto", 16 << 20, "warm"),  # no probe said the page cache is the faster way
        ("auto-probed", 16 << 20, "buffered"),  # an agent's probe did: page_cache_first
        ("auto-probed", 1 << 20, "direct"),
        ("buffered", 1 << 20, "buffered"),  # chosen: always that way
        ("direct", 16 << 20, "direct"),
    ],
)
def test_a_restore_is_left_in_the_page_cache_when_it_fits_in_spare_memory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write_path: str,
    available_kib: int,
    went: str,
) -> None:
    """Issue 32: a restore written with O_DIRECT is not in the page cache when the training
    process loads it next, so the load pays the disk again. When it fits in what the node
    can spare (engine/writepath.py, read from the kernel's meminfo), ``warm`` writes it with
    O_DIRECT and has the kernel read each chunk back into the page cache, as ``auto`` (the
    default) does unless an agent's probe found the page cache the faster way
    (``page_cache_first``: then buffered); too big, both go O_DIRECT only; ``write_path``
    (``--write-path``, ``FERRY_TRANSFER_WRITE_PATH``) direct or buffered forces one; the
    result says which. A warm restore is in memory once the kernel's reads are done."""
    from tests.conftest import (
        open_test_store,
        random_bytes,
        resident_fraction,
        run,
        tree_bytes,
        write_file,
    )  # fmt: skip
    from transfer.engine import PullPlan, pull, push, staging, writepath
    from transfer.options import TransferOptions

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal: {32 << 20} kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n"
    )
    monkeypatch.setattr(writepath, "MEMINFO", meminfo)
    src = tmp_path / "src"
    write_file(src / "a.bin", random_bytes(3 << 20, 3))
    os.close(direct_fd_or_skip(src / "a.bin"))
    opened: list[Path] = []
    real = staging.open_direct
    monkeypatch.setattr(staging, "open_direct", lambda p: opened.append(p) or real(p))
    (tmp_path / "store").mkdir()
    store = open_test_store(str(tmp_path / "store"))
    probed = write_path == "auto-probed"
    options = TransferOptions(
        chunk_size=1 << 20, write_path=write_path.removesuffix("-probed"), page_cache_first=probed
    )
    run(push(store, src, job="j", step=1, node="n", options=options))
    dest = tmp_path / "dest"
    result = run(pull(store, dest, PullPlan("j", 1), options=options))
    assert bool(opened) is (went != "buffered"), opened
    assert result.write_path == went
    if went == "direct":  # (its bytes went past the cache: none of them read back)
        assert resident_fraction(dest / "a.bin") == 0.0
    if went == "warm":  # the kernel's reads were only started: give them a moment
        deadline = time.monotonic() + 10
        while resident_fraction(dest / "a.bin") < 1.0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert resident_fraction(dest / "a.bin") >= 0.95  # (a hint: a busy machine may drop a page)
    assert tree_bytes(dest) == tree_bytes(src)  # (read last: this fills the cache)
