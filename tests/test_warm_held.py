"""Issue 32: what comes after a prefetch is the load. A step the node holds already (a
standby's replica, an earlier restore) is most likely not in the page cache by the time the
scheduler decides; the prefetch that finds it here answers at once and has the kernel read
it in (transfer/engine/warmcache.py), so the ranks' load reads memory, unless the write
path is ``direct`` (nothing is left in memory) or it does not fit in spare memory. A real
agent, a real store, real AdamW-shaped saves; residency read with mincore(2)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from agent.rpc.client import FerryClient
from tests.conftest import adamw_series, prefetched, resident_fraction
from tests.harness import TOKEN, agent, push_series


def _evict(root: Path) -> list[Path]:
    """Drop ``root``'s files from the page cache (clean pages: their writes were direct or
    flushed); the files."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return files


def _resident(files: list[Path], within: float) -> float:
    """The smallest resident part among ``files``, waiting up to ``within`` seconds for it
    to reach 1 (the kernel's reads were only started)."""
    deadline = time.monotonic() + within
    while True:
        least = min(resident_fraction(p) for p in files)
        if least == 1.0 or time.monotonic() > deadline:
            return least
        time.sleep(0.02)


@pytest.mark.parametrize("write_path", ["warm", "direct"])
def test_a_held_step_is_read_into_memory_at_the_decision(
    local_url: str, tmp_path: Path, write_path: str
) -> None:
    (k20,) = adamw_series(tmp_path / "src", 1, seed=32, mib=4)
    env = {"FERRY_TRANSFER_WRITE_PATH": write_path}

    async def go() -> tuple[str, float, float]:
        await push_series(local_url, [k20])
        async with (
            agent(tmp_path / "hot", [local_url], "n", extra_env=env) as url,
            FerryClient(url, TOKEN) as client,
        ):
            restored = await prefetched(client, 20)
            assert restored["satisfied_by"] == "restored", restored
            files = _evict(Path(restored["dest"]))
            evicted = min(resident_fraction(p) for p in files)
            held = await prefetched(client, 20)  # the decision: it is here already
            return (
                held["satisfied_by"],
                evicted,
                _resident(files, 10 if write_path == "warm" else 1),
            )

    satisfied_by, evicted, resident = asyncio.run(go())
    assert satisfied_by == "held"
    assert evicted == 0.0  # (the test's own eviction worked)
    if write_path == "warm":  # (readahead is a hint: a busy machine may drop a page of it)
        assert resident >= 0.95
    else:
        assert resident == 0.0
