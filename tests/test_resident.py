"""Standby replicas held in memory (agent/node/resident.py): real files, real mappings and
locks, the page cache asked with mincore(2). A held replica's pages stay in memory when the
kernel is told to drop them; holes of a partial copy cost nothing; what does not fit is left
on the disk; a node short of memory gets it back; and through a real agent, the standby's
status says what it holds and ``standby_memory = 0`` holds nothing."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from pathlib import Path

import pytest

import agent.node.resident as resident_module
from agent.daemon.config import ConfigError, load_config
from agent.node.protected import StepHolds
from agent.node.resident import ResidentReplicas
from agent.rpc.client import FerryClient
from tests.conftest import adamw_series, resident_fraction
from tests.harness import TOKEN, agent, push_series

FAST = {"FERRY_STANDBY_POLL_SECONDS": "0.1", "FERRY_STANDBY_MAX_RATE": "0"}
MB = 1 << 20


def drop_from_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s cached pages (it keeps those mapped or locked)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def may_lock(nbytes: int) -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes


def step_dir(root: Path, sizes: dict[str, int]) -> Path:
    root.mkdir(parents=True)
    for name, size in sizes.items():
        (root / name).write_bytes(os.urandom(size))
    os.sync()  # (clean pages: dropping them from the cache is then allowed)
    return root


def test_a_held_replica_stays_in_memory_and_goes_back_to_the_cache_when_released(
    tmp_path: Path,
) -> None:
    replica = step_dir(tmp_path / "step_000040", {"__0_0.distcp": 3 * MB, ".metadata": 5000})
    shard = replica / "__0_0.distcp"
    holds = StepHolds()

    async def go() -> None:
        held = ResidentReplicas(None, holds)
        got = await held.keep("llm", 40, replica)
        assert got is not None and got.nbytes >= 3 * MB + 5000
        assert got.locked == may_lock(got.nbytes)
        assert ("llm", 40) in holds.held()  # hot retention keeps it
        drop_from_cache(shard)
        assert resident_fraction(shard) == 1.0  # the kernel kept every page
        assert await held.release("llm", "test")
        assert held.held() == {} and holds.held() == set()
        drop_from_cache(shard)
        assert resident_fraction(shard) < 0.5  # an ordinary cached file again

    asyncio.run(go())


def locked_bytes() -> int:
    """This process's locked memory (VmLck), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


def mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


def test_a_replica_is_locked_where_locking_is_allowed_and_let_go_entirely(
    tmp_path: Path,
) -> None:
    replica = step_dir(tmp_path / "step_000040", {"__0_0.distcp": 2 * MB})
    before = locked_bytes()

    async def go() -> None:
        held = ResidentReplicas(None, StepHolds())
        got = await held.keep("llm", 40, replica)
        assert got is not None
        if may_lock(got.nbytes):
            assert got.locked and locked_bytes() - before >= 2 * MB
        else:
            assert not got.locked and locked_bytes() == before
        assert str(replica / "__0_0.distcp") in mapped_paths()
        await held.release_all("test")
        assert locked_bytes() == before and str(replica) not in mapped_paths()

    asyncio.run(go())


def test_a_replica_replaced_under_its_path_is_let_go(tmp_path: Path) -> None:
    """A share filled in, or the step restored anew, puts new files (or a new directory)
    at the replica's path: the old inodes must not stay locked (found in review)."""
    replica = step_dir(tmp_path / "step_000040", {"__0_0.distcp": MB})
    newer = step_dir(tmp_path / "fill", {"__0_0.distcp": MB})

    async def go() -> None:
        held = ResidentReplicas(None, StepHolds())
        assert await held.keep("llm", 40, replica) is not None
        await held.check()
        assert set(held.held()) == {"llm"}  # (unchanged: kept)
        replica.rename(tmp_path / "old")
        newer.rename(replica)
        await held.check()
        assert held.held() == {} and str(tmp_path / "old") not in mapped_paths()

    asyncio.run(go())


def test_a_keep_cancelled_while_reading_in_leaves_nothing_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stopping while a replica is read in: the thread stops at its next piece and
    what it mapped is let go; the hold is given back (found in review)."""
    replica = step_dir(tmp_path / "step_000040", {"__0_0.distcp": 8 * MB})
    monkeypatch.setattr(resident_module, "PIECE_BYTES", MB)
    spare = resident_module.spare_memory

    def slow_spare() -> int | None:
        time.sleep(0.05)  # (each piece: the cancel lands in the middle)
        return spare()

    monkeypatch.setattr(resident_module, "spare_memory", slow_spare)
    holds = StepHolds()
    before = locked_bytes()

    async def go() -> None:
        held = ResidentReplicas(None, holds)
        keeping = asyncio.create_task(held.keep("llm", 40, replica))
        await asyncio.sleep(0.15)
        keeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeping
        assert held.held() == {} and holds.held() == set()
        for _ in range(100):  # the thread returns within a piece, then is let go
            if str(replica) not in mapped_paths():
                break
            await asyncio.sleep(0.05)
        assert str(replica) not in mapped_paths() and locked_bytes() == before

    asyncio.run(go())


def test_holes_of_a_partial_copy_are_never_mapped(tmp_path: Path) -> None:
    replica = tmp_path / "step_000040"
    replica.mkdir()
    shard = replica / "__0_0.distcp"
    with shard.open("wb") as f:  # 1 MiB of data, 63 MiB of hole, 1 MiB of data
        f.write(os.urandom(MB))
        f.seek(64 * MB)
        f.write(os.urandom(MB))
    os.sync()
    if shard.stat().st_blocks * 512 > 8 * MB:
        pytest.skip("this file system does not keep holes")

    async def go() -> None:
        got = await ResidentReplicas(None, StepHolds()).keep("llm", 40, replica)
        assert got is not None and 2 * MB <= got.nbytes < 3 * MB

    asyncio.run(go())


def test_what_does_not_fit_is_left_on_the_disk(tmp_path: Path) -> None:
    replica = step_dir(tmp_path / "step_000040", {"__0_0.distcp": 2 * MB})
    holds = StepHolds()

    async def go() -> None:
        assert await ResidentReplicas(MB, holds).keep("llm", 40, replica) is None
        assert await ResidentReplicas(0, holds).keep("llm", 40, replica) is None
        assert holds.held() == set()
        both = ResidentReplicas(3 * MB, holds)  # room for one of two jobs' replicas
        assert await both.keep("a", 40, replica) is not None
        assert await both.keep("b", 40, replica) is None
        assert await both.keep("a", 40, replica) is not None  # (its own replaced: room)
        await both.release_all("test")

    asyncio.run(go())


def test_a_node_short_of_memory_gets_it_back_and_a_gone_replica_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The shortage is the kernel's meminfo read as short: memory cannot be made short
    here without risking the machine.)"""
    first = step_dir(tmp_path / "a" / "step_000040", {"__0_0.distcp": MB})
    second = step_dir(tmp_path / "b" / "step_000040", {"__0_0.distcp": MB})
    holds = StepHolds()

    async def go() -> None:
        held = ResidentReplicas(None, holds)
        assert await held.keep("a", 40, first) and await held.keep("b", 40, second)
        await held.check()
        assert set(held.held()) == {"a", "b"}  # (room enough: nothing let go)
        (second / "__0_0.distcp").unlink()
        second.rmdir()
        await held.check()
        assert set(held.held()) == {"a"}
        monkeypatch.setattr(resident_module, "spare_memory", lambda: 0)
        await held.check()
        assert held.held() == {} and holds.held() == set()

    asyncio.run(go())


def test_standby_memory_is_auto_a_size_or_zero(tmp_path: Path) -> None:
    def memory(value: str) -> int | None:
        text = f'hot_dir = "{tmp_path}"\ntiers = ["{tmp_path}"]\nstandby_memory = {value}\n'
        (tmp_path / "ferry.toml").write_text(text)
        return load_config(tmp_path / "ferry.toml", env={}).standby_memory

    assert memory('"auto"') is None and memory('"AUTO"') is None and memory("0") == 0
    assert memory('"8GB"') == 8_000_000_000
    for wrong in ('"lots"', "0.5", '"512KB"', "-1"):  # (0.5 was read as 0: never)
        with pytest.raises(ConfigError, match="standby_memory"):
            memory(wrong)
    # (from the environment, the message names the variable: what the operator set)
    with pytest.raises(ConfigError, match="FERRY_STANDBY_MEMORY: invalid size 'lots'"):
        load_config(None, env={"FERRY_STANDBY_MEMORY": "lots", "FERRY_HOT_DIR": str(tmp_path)})


def test_a_standby_holds_its_newest_replica_in_memory(local_url: str, tmp_path: Path) -> None:
    """Through a real agent: the status says what is held; the next replica takes the
    place of the one before; ``standby_memory = 0`` holds nothing."""
    k20, k40 = adamw_series(tmp_path / "src", 2, seed=24)

    async def in_memory(client: FerryClient, step: int) -> dict[str, object] | None:
        for _ in range(600):
            doc = await client._call("GET", "/v1/standby")
            (entry,) = doc["jobs"]
            if entry["replicated_step"] == step:
                return entry["in_memory"]  # type: ignore[no-any-return]
            await asyncio.sleep(0.05)
        raise AssertionError(f"step {step} never replicated")

    async def go() -> None:
        await push_series(local_url, [k20])
        env = {**FAST, "FERRY_STANDBY_JOBS": "llm"}
        async with (
            agent(tmp_path / "b", [local_url], "b", extra_env=env) as url_b,
            FerryClient(url_b, TOKEN) as b,
        ):
            held = await in_memory(b, 20)
            assert held is not None and held["step"] == 20 and int(held["bytes"]) > 0  # type: ignore[call-overload]
            shard = tmp_path / "b" / "llm" / "step_000020" / "__0_0.distcp"
            drop_from_cache(shard)
            assert resident_fraction(shard) == 1.0
            await push_series(local_url, [k40])
            held = await in_memory(b, 40)
            assert held is not None and held["step"] == 40
            drop_from_cache(shard)  # step 20's: let go
            assert resident_fraction(shard) < 0.5
        async with (
            agent(tmp_path / "c", [local_url], "c", extra_env={**env, "FERRY_STANDBY_MEMORY": "0"})
            as url_c,
            FerryClient(url_c, TOKEN) as c,
        ):  # fmt: skip
            assert await in_memory(c, 40) is None

    asyncio.run(go())
