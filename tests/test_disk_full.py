"""Disk full on the prefetch target: a real 64 MiB filesystem (tmpfs; a loop-mounted ext4
image if tmpfs cannot be mounted) as the agent's hot dir. A prefetch that cannot fit fails
with a clear error, the hot dir keeps exactly what it held, and no staging is left behind."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.rpc.client import FerryClient
from tests.conftest import random_bytes, tree_bytes
from tests.harness import OPTS, TOKEN, agent, save
from transfer.engine import push
from transfer.store import open_store

SIZE_MIB = 64


def _mount(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem of SIZE_MIB MiB, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    tried = []
    if _mount(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs", str(mnt)]):
        tried.append("tmpfs")
    else:
        image = tmp_path / "small.img"
        with open(image, "wb") as fh:
            fh.truncate(SIZE_MIB << 20)
        mkfs = shutil.which("mkfs.ext4")
        if not (mkfs and _mount([mkfs, "-q", "-F", str(image)])) or not _mount(
            ["mount", "-o", "loop", str(image), str(mnt)]
        ):
            pytest.skip("cannot mount a small filesystem here (neither tmpfs nor a loop image)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def publish(store_url: str, src: Path, step: int) -> None:
    async def go() -> None:
        store = open_store(store_url)
        try:
            await push(store, src, job="llm", step=step, node="a", options=OPTS)
        finally:
            await store.close()

    asyncio.run(go())


def test_prefetch_onto_a_full_disk_fails_clearly_and_touches_nothing(
    local_url: str, small_fs: Path, tmp_path: Path
) -> None:
    hot = small_fs / "hot"
    held = save(hot / "llm" / "step_000010", {"__0_0.distcp": random_bytes(4_000_000, 1)})
    jobdir = hot / "llm"
    before = tree_bytes(jobdir)
    publish(local_url, held, 10)
    # step 20 cannot fit at all; steps 30 and 40 fit one at a time but not together
    big = save(tmp_path / "src" / "step_000020", {"a.bin": random_bytes(80 << 20, 2)})
    publish(local_url, big, 20)
    for step in (30, 40):
        src = save(tmp_path / "src" / f"step_{step:06d}", {"a.bin": random_bytes(36 << 20, step)})
        publish(local_url, src, step)

    async def go() -> list[dict]:  # type: ignore[type-arg]
        async with agent(hot, [local_url]) as url, FerryClient(url, TOKEN) as client:
            too_big = await client.wait_prefetch(await client.prefetch("llm", 20), within_s=60)
            assert too_big["state"] == "failed", too_big
            assert "not enough space" in too_big["error"], too_big
            assert tree_bytes(jobdir) == before  # untouched, and no staging directory left
            both = [await client.prefetch("llm", step) for step in (30, 40)]
            return [await client.wait_prefetch(pid, within_s=60) for pid in both]

    results = asyncio.run(go())
    failed = [r for r in results if r["state"] == "failed"]
    assert failed, results  # 72 MiB cannot fit in 64
    for r in failed:
        assert "space" in r["error"], r
    names = sorted(p.name for p in (hot / "llm").iterdir())
    ready = [r for r in results if r["state"] == "ready"]
    assert names == sorted(["step_000010", *(Path(r["dest"]).name for r in ready)])
    assert {k: v for k, v in tree_bytes(jobdir).items() if k.startswith("step_000010/")} == before


def test_small_fs_is_really_small(small_fs: Path) -> None:
    """The fixture must give a filesystem that can fill up, or the test above proves nothing."""
    assert shutil.disk_usage(small_fs).total <= (SIZE_MIB + 1) << 20
