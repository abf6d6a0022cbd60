"""A store on an fsspec filesystem (gcs://, az://... and memory://) retries what a remote
filesystem answers while its service blips (connection and timeout errors), by the same
RetryPolicy as S3 and the local store; a create-only write whose reply was lost and that
finds its own bytes on the next try has succeeded.

The faults are injected into the filesystem object's calls: no remote fsspec service is
reachable from this machine; the filesystem under them is fsspec's real in-memory one."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any

import pytest

from transfer.errors import AlreadyExistsError, StoreError
from transfer.store import open_store
from transfer.store.fsspecstore import FsspecStore
from transfer.store.retry import RetryPolicy

FAST = RetryPolicy(attempts=4, first_backoff=0.001, max_backoff=0.002)


def memory_store() -> FsspecStore:
    store = open_store(f"memory://retry-{secrets.token_hex(6)}")
    assert isinstance(store, FsspecStore)
    store.retry = FAST
    return store


def flaky(real: Callable[..., Any], times: int, *, after: bool = False) -> Callable[..., Any]:
    """``real``, except that its first ``times`` calls raise ConnectionError (``after``:
    once the real call has run, as a reply lost on the way back); counts calls."""

    def call(*args: Any, **kwargs: Any) -> Any:
        call.calls += 1  # type: ignore[attr-defined]
        if call.calls <= times:  # type: ignore[attr-defined]
            if after:
                real(*args, **kwargs)
            raise ConnectionError("connection reset by peer")
        return real(*args, **kwargs)

    call.calls = 0  # type: ignore[attr-defined]
    return call


def test_reads_lists_and_writes_survive_a_blip(monkeypatch: pytest.MonkeyPatch) -> None:
    store = memory_store()
    asyncio.run(store.put("packs/p", b"0123456789"))
    cat = flaky(store.fs.cat_file, times=2)
    monkeypatch.setattr(store.fs, "cat_file", cat)
    assert asyncio.run(store.get("packs/p", 2, 5)) == b"234"
    assert cat.calls == 3
    buf = memoryview(bytearray(4))
    assert store.range_reader().read_into("packs/p", 3, buf) == 4
    assert bytes(buf) == b"3456"
    find = flaky(store.fs.find, times=1)
    monkeypatch.setattr(store.fs, "find", find)
    assert [o.key for o in asyncio.run(store.list("packs/"))] == ["packs/p"]
    pipe = flaky(store.fs.pipe_file, times=1)
    monkeypatch.setattr(store.fs, "pipe_file", pipe)
    asyncio.run(store.put("packs/q", b"abc"))
    assert pipe.calls == 2
    monkeypatch.undo()
    assert asyncio.run(store.get("packs/q")) == b"abc"


def test_a_create_only_write_whose_reply_was_lost_has_succeeded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = memory_store()
    monkeypatch.setattr(store.fs, "pipe_file", flaky(store.fs.pipe_file, times=1, after=True))
    asyncio.run(store.put("manifests/m.json", b"ours", create_only=True))
    assert asyncio.run(store.get("manifests/m.json")) == b"ours"
    with pytest.raises(AlreadyExistsError):  # someone else's object is still refused
        asyncio.run(store.put("manifests/m.json", b"theirs", create_only=True))


def test_a_service_that_stays_down_fails_after_the_policys_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = memory_store()
    cat = flaky(store.fs.cat_file, times=100)
    monkeypatch.setattr(store.fs, "cat_file", cat)
    with pytest.raises(StoreError, match="get packs/p: failed 4 times"):
        asyncio.run(store.get("packs/p"))
    assert cat.calls == FAST.attempts
