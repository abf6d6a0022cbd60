"""One conformance suite for every store backend: local directory, real S3, and fsspec's
in-memory filesystem (``memory://``, the fsspec backend any other fsspec protocol uses)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import open_test_store, random_bytes
from transfer.errors import AlreadyExistsError, NotFoundError
from transfer.store.base import Store


@pytest.fixture(params=["local", "s3", "memory"])
def store_url(request: pytest.FixtureRequest) -> str:
    """This module's backends: conftest's two (an empty directory or prefix, no store
    descriptor in it), plus the fsspec one."""
    if request.param == "memory":
        import secrets

        return f"memory://conformance-{secrets.token_hex(6)}"
    return str(request.getfixturevalue(f"empty_{request.param}_url"))


def with_store(url: str, body):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        store = open_test_store(url)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(go())


def test_put_get_head_list_delete(store_url: str) -> None:
    async def body(store: Store) -> None:
        await store.put("a/b/one", b"0123456789")
        await store.put("a/two", b"xy")
        await store.put("other", b"z")
        assert await store.get("a/b/one") == b"0123456789"
        assert await store.get("a/b/one", 2, 5) == b"234"
        assert await store.get("a/b/one", 7) == b"789"
        assert (await store.head("a/b/one")).size == 10
        assert [o.key for o in await store.list("a/")] == ["a/b/one", "a/two"]
        assert [o.key for o in await store.list("")] == ["a/b/one", "a/two", "other"]
        await store.delete("a/two")
        await store.delete("a/two")  # deleting a missing key is not an error
        assert not await store.exists("a/two")
        assert await store.exists("a/b/one")

    with_store(store_url, body)


def test_list_dirs_names_one_level_below_a_prefix(store_url: str) -> None:
    """A delimiter listing: the names just below the prefix that hold objects (a job's
    steps), not every key under them, and nothing from a sibling prefix."""

    async def body(store: Store) -> None:
        for key in ("m/j/002/a.json", "m/j/002/b.json", "m/j/010/a.json", "m/jj/003/a.json"):
            await store.put(key, b"{}")
        await store.put("m/j/loose", b"x")  # an object, not a name below
        assert await store.list_dirs("m/j/") == ["002", "010"]
        assert await store.list_dirs("m/") == ["j", "jj"]
        assert await store.list_dirs("m/none/") == []

    with_store(store_url, body)


def test_missing_key_is_not_found(store_url: str) -> None:
    async def body(store: Store) -> None:
        with pytest.raises(NotFoundError):
            await store.get("nope")
        with pytest.raises(NotFoundError):
            await store.head("nope")

    with_store(store_url, body)


def test_create_only_put_refuses_to_overwrite(store_url: str) -> None:
    async def body(store: Store) -> None:
        await store.put("m.json", b"first", create_only=True)
        with pytest.raises(AlreadyExistsError):
            await store.put("m.json", b"second", create_only=True)
        assert await store.get("m.json") == b"first"
        await store.put("m.json", b"third")  # a plain put replaces
        assert await store.get("m.json") == b"third"

    with_store(store_url, body)


def test_concurrent_create_only_puts_have_exactly_one_winner(store_url: str) -> None:
    async def body(store: Store) -> None:
        results = await asyncio.gather(
            *(store.put("race", str(i).encode(), create_only=True) for i in range(8)),
            return_exceptions=True,
        )
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        assert all(isinstance(r, AlreadyExistsError) for r in results if r is not None)
        assert await store.get("race") == str(winners[0]).encode()

    with_store(store_url, body)


def test_multipart_out_of_order_is_invisible_until_complete(store_url: str) -> None:
    part = 5 << 20  # S3's minimum for all but the last part
    blobs = [random_bytes(part, 1), random_bytes(part, 2), random_bytes(1234, 3)]

    async def body(store: Store) -> None:
        up = await store.begin_upload("big/obj")
        offsets = [0, part, 2 * part]
        await asyncio.gather(
            up.write_part(3, offsets[2], blobs[2]),
            up.write_part(1, offsets[0], blobs[0]),
            up.write_part(2, offsets[1], blobs[1]),
        )
        assert not await store.exists("big/obj")
        assert [o.key for o in await store.list("big/")] == []
        await up.complete()
        assert await store.get("big/obj") == b"".join(blobs)
        assert await store.get("big/obj", part - 3, part + 3) == blobs[0][-3:] + blobs[1][:3]

    with_store(store_url, body)


def test_aborted_upload_leaves_nothing(store_url: str) -> None:
    async def body(store: Store) -> None:
        up = await store.begin_upload("gone")
        await up.write_part(1, 0, b"x" * 1000)
        await up.abort()
        assert not await store.exists("gone")
        assert await store.list("") == []

    with_store(store_url, body)


def test_holds_objects_sees_any_object_below_the_root(store_url: str) -> None:
    """Whether a new store may be made here (``ferry init``): any object, however deep."""

    async def body(store: Store) -> None:
        await store.create_root()  # there already: nothing changes
        assert not await store.holds_objects()
        await store.put("deep/down/one", b"1")
        assert await store.holds_objects()
        await store.delete("deep/down/one")
        assert not await store.holds_objects()

    with_store(store_url, body)


def test_keys_cannot_escape_the_store(store_url: str) -> None:
    async def body(store: Store) -> None:
        for bad in ("../x", "/abs", "a/../../b", ""):
            with pytest.raises(ValueError):
                await store.put(bad, b"x")

    with_store(store_url, body)


def test_unfinished_uploads_are_listed_and_orphans_aborted(store_url: str) -> None:
    from transfer.engine.orphans import abort_orphaned_uploads

    async def body(store: Store) -> None:
        up = await store.begin_upload("packs/ab/abandoned.pack")
        await up.write_part(1, 0, b"x" * 1000)
        pending = await store.list_uploads("packs/")
        assert [p.key for p in pending] == ["packs/ab/abandoned.pack"]
        assert [p.size for p in pending] == [1000]  # (on S3: 0 B in `ferry du` before)
        assert await abort_orphaned_uploads(store, older_than_s=3600) == 0  # too young
        assert await abort_orphaned_uploads(store, older_than_s=-60) == 1
        assert await store.list_uploads("packs/") == []
        assert await store.list("") == []

    with_store(store_url, body)


def test_an_upload_that_completes_while_it_is_listed_is_gone_not_an_error(s3_url: str) -> None:
    """S3 lists an upload's size by listing its parts, a request after the upload listing:
    another node's push completing its pack in between (retention runs after each push)
    answers NoSuchUpload there, which failed the whole listing, and retention with it."""

    async def body(store: Store) -> None:
        done = await store.begin_upload("packs/aa/done.pack")
        await done.write_part(1, 0, b"x" * 1000)
        open_ = await store.begin_upload("packs/bb/open.pack")
        await open_.write_part(1, 0, b"y" * 500)
        list_parts = store._list_parts  # type: ignore[attr-defined]

        async def completing_first(full: str, upload_id: str) -> object:
            if full.endswith("done.pack"):
                await done.complete()  # (another node's push, finishing just now)
            return await list_parts(full, upload_id)

        store._list_parts = completing_first  # type: ignore[attr-defined]
        pending = await store.list_uploads("packs/")
        assert [(p.key, p.size) for p in pending] == [("packs/bb/open.pack", 500)]
        await open_.abort()

    with_store(s3_url, body)


def test_range_reader_reads_into_buffers(store_url: str) -> None:
    """The bulk read path of pulls: bytes land in the caller's buffer, a read past the end
    of the object is short (not an error), a missing key is NotFoundError."""

    async def body(store: Store) -> None:
        data = random_bytes(3 << 20)
        await store.put("packs/blob", data)
        reader = await asyncio.to_thread(store.range_reader)
        assert reader is not None  # every shipped backend has one
        buf = memoryview(bytearray(1 << 20))

        def read(start: int, size: int) -> bytes:
            got = reader.read_into("packs/blob", start, buf[:size])
            return bytes(buf[:got])

        assert await asyncio.to_thread(read, 0, 1 << 20) == data[: 1 << 20]
        assert await asyncio.to_thread(read, 12345, 1000) == data[12345:13345]
        assert await asyncio.to_thread(read, len(data) - 10, 1 << 20) == data[-10:]
        assert await asyncio.to_thread(read, 5, 0) == b""
        with pytest.raises(NotFoundError):
            await asyncio.to_thread(reader.read_into, "packs/missing", 0, buf[:10])

    with_store(store_url, body)
