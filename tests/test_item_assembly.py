"""ItemAssembly (transfer/engine/itemassembly.py): a restore's chunks, landing in any order
from several threads, become whole items exactly once, with their bytes; a loader slower
than the restore bounds its memory; a loader that fails stops the restore."""

from __future__ import annotations

import random
import threading
import time

import pytest

from transfer.engine.itemassembly import Abandoned, ItemAssembly, Slice

CHUNK = 1000


def file_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def land_all(assembly: ItemAssembly, files: dict[str, bytes], threads: int = 4) -> None:
    """Hand each file over in CHUNK pieces, shuffled, from ``threads`` threads, then end.
    (Never from the loader's thread: a chunk waiting for room would wait for itself.)"""
    pieces = [(path, off) for path, data in files.items() for off in range(0, len(data), CHUNK)]
    random.Random(1).shuffle(pieces)
    errors: list[BaseException] = []

    def run(mine: list[tuple[str, int]]) -> None:
        try:
            for path, off in mine:
                assembly.landed(path, off, memoryview(files[path])[off : off + CHUNK])
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(pieces[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assembly.ended(errors[0] if errors else None)


def test_items_come_whole_once_with_their_bytes_whatever_the_order() -> None:
    data = file_bytes(50_000)
    # items of every shape: inside a chunk, across chunks, a repeated slice, an empty one,
    # one overlapping the next (DCP's do not; a crafted plan may), the file's last byte
    slices: list[Slice] = [
        ("f", 10, 100), ("f", 900, 2300), ("f", 900, 2300), ("f", 3200, 0), ("f", 3000, 5000),
        ("f", 7000, 1), ("f", 8000, 30_000), ("f", 49_999, 1), ("g", 0, 10),
    ]  # fmt: skip
    assembly = ItemAssembly(slices, budget=4096)
    seen: dict[Slice, bytes] = {}
    other = file_bytes(10, seed=2)
    landing = threading.Thread(target=land_all, args=(assembly, {"f": data, "g": other}))
    landing.start()
    for key, view in assembly.whole_items():
        assert key not in seen, key
        seen[key] = bytes(view)
    landing.join(timeout=10)
    assert not landing.is_alive()
    assert set(seen) == set(slices)
    for path, off, n in slices:
        want = (data if path == "f" else other)[off : off + n]
        assert seen[(path, off, n)] == want, (path, off, n)


def test_a_slow_loader_bounds_the_bytes_held() -> None:
    """One landing thread, 40 items of 10 KB, a 25 KB budget, a loader that sleeps: the
    buffers live at once never pass the budget by more than the item being started."""
    item = 10_000
    data = file_bytes(40 * item)
    slices: list[Slice] = [("f", i * item, item) for i in range(40)]
    assembly = ItemAssembly(slices, budget=25_000)
    peak = [0]

    def land() -> None:
        for off in range(0, len(data), CHUNK):
            assembly.landed("f", off, data[off : off + CHUNK])
            peak[0] = max(peak[0], assembly.live_bytes)
        assembly.ended(None)

    landing = threading.Thread(target=land)
    landing.start()
    count = 0
    for _, view in assembly.whole_items():
        time.sleep(0.002)
        peak[0] = max(peak[0], assembly.live_bytes)
        assert len(view) == item
        count += 1
    landing.join()
    assert count == 40
    assert peak[0] <= 25_000 + 2 * item, peak[0]  # without the wait: all 400 KB


def test_a_failed_loader_stops_the_restore_and_releases_a_waiting_thread() -> None:
    item = 10_000
    slices: list[Slice] = [("f", i * item, item) for i in range(10)]
    assembly = ItemAssembly(slices, budget=5_000)
    data = file_bytes(10 * item)
    raised: list[BaseException] = []

    def land() -> None:
        try:
            for off in range(0, len(data), CHUNK):
                assembly.landed("f", off, data[off : off + CHUNK])
        except Abandoned as exc:
            raised.append(exc)

    landing = threading.Thread(target=land)
    landing.start()
    items = assembly.whole_items()
    next(items)  # one whole item taken; the thread now waits for room for a third
    time.sleep(0.1)
    assert landing.is_alive()
    assembly.abandon()
    landing.join(timeout=5)
    assert not landing.is_alive() and raised, "the waiting thread was not released"
    with pytest.raises(Abandoned):
        assembly.landed("f", 0, data[:CHUNK])


def test_the_restores_error_reaches_the_loader() -> None:
    assembly = ItemAssembly([("f", 0, 10)])
    assembly.ended(OSError("the store went away"))
    with pytest.raises(OSError, match="went away"):
        list(assembly.whole_items())
