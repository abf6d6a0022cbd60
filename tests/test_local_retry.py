"""A local or NFS store retries what a failing-over NFS mount answers (ESTALE, ETIMEDOUT,
EIO), by the same RetryPolicy as S3, and never retries a failed fsync on the same file.

The faults are injected into ``os`` calls: an NFS server failing over cannot be caused for
real on this machine (no NFS server, no kernel client we may mount); everything else is a
real directory."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from transfer.errors import AlreadyExistsError, NotFoundError, StoreError
from transfer.store.local import LocalStore
from transfer.store.retry import RetryPolicy

FAST = RetryPolicy(attempts=4, first_backoff=0.001, max_backoff=0.002)


def failing(real: Callable[..., Any], code: int, times: int) -> Callable[..., Any]:
    """``real``, except that its first ``times`` calls fail with ``code``; counts calls."""

    def call(*args: Any, **kwargs: Any) -> Any:
        call.calls += 1  # type: ignore[attr-defined]
        if call.calls <= times:  # type: ignore[attr-defined]
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    call.calls = 0  # type: ignore[attr-defined]
    return call


def test_reads_survive_a_stale_handle_and_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path, FAST)
    asyncio.run(store.put("packs/p", b"0123456789"))
    for code in (errno.ESTALE, errno.ETIMEDOUT):
        preadv = failing(os.preadv, code, times=2)
        monkeypatch.setattr(os, "preadv", preadv)
        buf = memoryview(bytearray(4))
        assert store.range_reader().read_into("packs/p", 3, buf) == 4
        assert bytes(buf) == b"3456"
        assert preadv.calls == 3
        pread = failing(os.pread, code, times=1)
        monkeypatch.setattr(os, "pread", pread)
        assert asyncio.run(store.get("packs/p", 2, 5)) == b"234"
        assert pread.calls == 2


def test_a_mount_that_stays_down_fails_after_the_policys_tries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path, FAST)
    asyncio.run(store.put("packs/p", b"abc"))
    stat = failing(os.stat, errno.EIO, times=100)
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(StoreError, match=r"stat packs/p: failed 4 times, the mount may be down"):
        asyncio.run(store.head("packs/p"))
    assert stat.calls == FAST.attempts


def test_a_missing_object_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = failing(os.open, errno.ESTALE, times=0)
    monkeypatch.setattr(os, "open", opened)
    store = LocalStore(tmp_path, FAST)
    with pytest.raises(NotFoundError):
        store.range_reader().read_into("packs/none", 0, memoryview(bytearray(1)))
    assert opened.calls == 1


def test_a_create_only_put_whose_first_try_landed_is_not_reported_as_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link landed, then the directory's fsync failed: the retry finds its own object."""
    import transfer.store.local as local

    fsync_dir = failing(local.fsync_dir, errno.ESTALE, times=1)
    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    store = LocalStore(tmp_path, FAST)
    asyncio.run(store.put("manifests/m", b"mine", create_only=True))
    assert (tmp_path / "manifests/m").read_bytes() == b"mine"
    assert fsync_dir.calls == 2
    assert not [p for p in (tmp_path / "manifests").iterdir() if p.name.startswith(".")]
    # someone else's object under the name is still a conflict, retried or not
    with pytest.raises(AlreadyExistsError):
        asyncio.run(store.put("manifests/m", b"theirs", create_only=True))
    assert (tmp_path / "manifests/m").read_bytes() == b"mine"


def test_a_failed_fsync_of_an_upload_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync the kernel may have dropped the pages it could not write; a
    second fsync would say all is well. The commit fails and publishes nothing."""

    async def upload() -> None:
        up = await store.begin_upload("packs/big")
        await up.write_part(1, 0, b"x" * 100)
        monkeypatch.setattr(os, "fsync", fsync)
        try:
            await up.complete(create_only=True)
        finally:
            monkeypatch.undo()

    fsync = failing(os.fsync, errno.EIO, times=1)
    store = LocalStore(tmp_path, FAST)
    with pytest.raises(StoreError, match="commit packs/big"):
        asyncio.run(upload())
    assert fsync.calls == 1
    assert not (tmp_path / "packs/big").exists()


def test_a_part_write_survives_a_transient_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def upload() -> None:
        up = await store.begin_upload("packs/big")
        monkeypatch.setattr(os, "pwrite", pwrite)
        await up.write_part(1, 0, b"a" * 10)
        monkeypatch.undo()
        await up.write_part(2, 10, b"b" * 5)
        await up.complete()

    pwrite = failing(os.pwrite, errno.ESTALE, times=2)
    store = LocalStore(tmp_path, FAST)
    asyncio.run(upload())
    assert (tmp_path / "packs/big").read_bytes() == b"a" * 10 + b"b" * 5
    assert pwrite.calls == 3
