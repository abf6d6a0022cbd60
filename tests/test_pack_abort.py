"""What a push's pack writer keeps when the push stops while a pack's final write is in
flight (transfer/engine/packer.py, ``PackWriter.abort``): that write runs shielded and may
land after the failure; a pack that lands is durable, so it is kept and its journal told
of it (a resumed push reuses it), never deleted or its upload aborted under it. Real
local-directory stores; the final write is only made slower."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from tests.conftest import open_test_store
from transfer.engine.packer import PackWriter
from transfer.format.layout import PACKS_PREFIX, pack_key
from transfer.store.base import Store

SLOW = 0.3  # seconds the final write takes; the push stops as soon as it begins


async def _stopped_during_final_write(
    store: Store, how: str, payloads: int, part_size: int
) -> tuple[PackWriter, list[str]]:
    """Fill one pack and finish it; stop the push (``how``: "cancel" as Ctrl-C does, or
    "fail" as another task's error does) while the pack's final write is in flight."""
    told: list[str] = []  # the journal: pack ids, as on_pack_durable is told of them
    writer: PackWriter | None = None

    started = _slow(store)

    async def boom() -> None:
        await started.wait()
        raise RuntimeError("another part of the push failed")

    async def push() -> None:
        nonlocal writer
        async with asyncio.TaskGroup() as tasks:
            writer = PackWriter(
                store, tasks, part_size=part_size, pack_size=payloads * 1000, window=2,
                on_bytes_stored=lambda n: None, on_pack_durable=lambda p, m: told.append(p),
                on_part_receipt=lambda p, r: None,
            )  # fmt: skip
            for i in range(payloads):
                await writer.add(bytes([i]) * 1000, tag=i)
            if how == "fail":
                tasks.create_task(boom())
            await writer.finish()

    task = asyncio.create_task(push())
    if how == "cancel":
        await started.wait()
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ExceptionGroup):
        await task
    assert writer is not None and not writer.completed_packs, "stopped before it was durable"
    await writer.abort(interrupted=how == "cancel")
    return writer, told


def _slow(store: Store) -> asyncio.Event:
    """The store's final writes (a whole pack's PUT, a multipart upload's complete) take
    SLOW seconds longer; everything else is the real local store. The event: one began."""
    put, begin = store.put, store.begin_upload
    started = asyncio.Event()

    async def slow_put(key: str, data: bytes, *, create_only: bool = False) -> None:
        started.set()
        await asyncio.sleep(SLOW)
        await put(key, data, create_only=create_only)

    async def slow_begin(key: str) -> Any:
        upload = await begin(key)
        complete = upload.complete

        async def slow_complete(**kw: Any) -> None:
            started.set()
            await asyncio.sleep(SLOW)
            await complete(**kw)

        upload.complete = slow_complete  # type: ignore[method-assign]
        return upload

    store.put = slow_put  # type: ignore[method-assign]
    store.begin_upload = slow_begin  # type: ignore[method-assign]
    return started


async def _packs(store: Store) -> list[str]:
    return [o.key for o in await store.list(PACKS_PREFIX)]


def test_a_whole_pack_put_that_lands_after_a_ctrl_c_is_kept_and_journaled(
    tmp_path: Path,
) -> None:
    """One part's worth: a single PUT, cancelled while it runs. It lands; before, abort
    deleted it (never journaled: the journal hears of a whole PUT once it lands)."""

    async def go() -> tuple[list[str], list[str]]:
        store = open_test_store(str(tmp_path / "store"))
        _, told = await _stopped_during_final_write(store, "cancel", 3, 1 << 20)
        return told, await _packs(store)

    told, packs = asyncio.run(go())
    assert len(told) == 1 and packs == [pack_key(told[0])], (packs, told)


def test_a_multipart_pack_completing_as_another_task_fails_is_not_aborted_under_it(
    tmp_path: Path,
) -> None:
    """Three parts, then the complete; another task fails while it runs. Before, abort
    aborted the upload first (its temp file removed under the complete), and the pack was
    lost; now the complete is waited for, and the pack it made is kept."""

    async def go() -> tuple[list[str], list[str], list[str]]:
        store = open_test_store(str(tmp_path / "store"))
        _, told = await _stopped_during_final_write(store, "fail", 3, 1000)
        files = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file()]
        return told, await _packs(store), files

    told, packs, files = asyncio.run(go())
    (pack_id,) = set(told)  # (a multipart pack's chunks are journaled as its parts go)
    assert packs == [pack_key(pack_id)], packs
    assert not [f for f in files if ".tmp-" in f], files  # no upload left behind
