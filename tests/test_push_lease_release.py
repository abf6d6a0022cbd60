"""A push lease is gone once its push ends, however it ends.

CI saw a SIGTERM'd ``ferry push`` leave its lease behind: the signal landed while the
lease's create-only write was in a store thread, the cancelled acquisition never reached the
release, and the thread then published the lease. A renewal cancelled by the release had the
same shape. Both writes are now let finish, then taken back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from transfer.engine import pushlease
from transfer.format.layout import push_lock_key
from transfer.store.local import LocalStore


class _SlowWrites(LocalStore):
    """A real local store whose writes take a while, as a busy disk's fsync does, and go on
    when their caller is cancelled, as a thread's write or a PUT already sent does."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writing = asyncio.Event()
        self.slow_create = False

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        if create_only and not self.slow_create:
            return await super().put(key, data, create_only=True)
        self.writing.set()
        await asyncio.shield(self._slowly(key, data, create_only))

    async def _slowly(self, key: str, data: bytes, create_only: bool) -> None:
        await asyncio.sleep(0.3)
        await super().put(key, data, create_only=create_only)


def _lease(root: Path) -> Path:
    return root / push_lock_key("j", 2, "n0")


def test_a_renewal_in_flight_at_release_does_not_leave_the_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pushlease, "RENEW_SECONDS", 0.01)
    store = _SlowWrites(tmp_path)

    async def main() -> None:
        async with pushlease.push_lease(store, "j", 2, "n0"):
            assert _lease(tmp_path).exists()
            await store.writing.wait()
        await asyncio.sleep(0.6)  # any write the release left running has landed by now

    asyncio.run(main())
    assert not _lease(tmp_path).exists()


def test_a_push_cancelled_while_taking_its_lease_does_not_leave_it(tmp_path: Path) -> None:
    store = _SlowWrites(tmp_path)
    store.slow_create = True

    async def hold() -> None:
        async with pushlease.push_lease(store, "j", 2, "n0"):
            raise AssertionError("the body never runs: the push is cancelled before")

    async def main() -> None:
        task = asyncio.create_task(hold())
        await store.writing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.6)

    asyncio.run(main())
    assert not _lease(tmp_path).exists()
