"""Every store backend against a model store (hypothesis): random puts (create-only or
not), multipart uploads written out of order then completed or aborted, deletes, whole
and ranged reads, range-reader reads, heads and listings, on a local directory and on the
in-memory (fsspec) store. After every step the backend lists exactly the model's objects
and leaves no upload pending. The conformance suite checks each rule once; this checks
that no sequence of them drifts from a plain dict (issue 15: "an in-memory store that
runs the same conformance suite, plus a Hypothesis state machine against a model")."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from transfer.errors import AlreadyExistsError, NotFoundError
from transfer.store import open_store
from transfer.store.base import Store

# leaves only: a local store keeps keys as files, so no key is another's directory
KEYS = ("p/x", "p/y", "q/z/1", "q/z/2", "r")
PREFIXES = ("", "p/", "q/", "q/z/", "q/z/1", "r", "s/")
keys = st.sampled_from(KEYS)
blobs = st.binary(min_size=0, max_size=300)


class StoreMachine(RuleBasedStateMachine):
    backend = "local"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root: Path | None = None
        if self.backend == "local":
            self.root = Path(tempfile.mkdtemp(prefix="ferry-store-model-"))
            url = str(self.root)
        else:
            url = f"memory://store-model-{secrets.token_hex(6)}"
        self.store: Store = open_store(url)
        self.model: dict[str, bytes] = {}

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    @rule(key=keys, data=blobs, create_only=st.booleans())
    def put(self, key: str, data: bytes, create_only: bool) -> None:
        if create_only and key in self.model:
            with pytest.raises(AlreadyExistsError):
                self.run(self.store.put(key, data, create_only=True))
            return
        self.run(self.store.put(key, data, create_only=create_only))
        self.model[key] = data

    @rule(
        key=keys,
        parts=st.lists(st.binary(min_size=1, max_size=120), min_size=1, max_size=4),
        order=st.randoms(use_true_random=False),
        create_only=st.booleans(),
        finish=st.booleans(),
    )
    def upload(self, key: str, parts: list[bytes], order, create_only: bool, finish: bool) -> None:  # type: ignore[no-untyped-def]
        async def go() -> None:
            upload = await self.store.begin_upload(key)
            offsets = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
            numbered = list(enumerate(parts, start=1))
            order.shuffle(numbered)  # parts land in any order
            for number, data in numbered:
                receipt = await upload.prepare_part(number, data)
                await upload.write_part(number, offsets[number - 1], data, receipt)
            if not finish:
                await upload.abort()
            elif create_only and key in self.model:
                with pytest.raises(AlreadyExistsError):
                    await upload.complete(create_only=True)
                await upload.abort()
            else:
                await upload.complete(create_only=create_only)
                self.model[key] = b"".join(parts)

        self.run(go())

    @rule(key=keys)
    def delete(self, key: str) -> None:
        self.run(self.store.delete(key))  # a missing key is not an error
        self.model.pop(key, None)

    @rule(key=keys)
    def get_whole(self, key: str) -> None:
        if key not in self.model:
            with pytest.raises(NotFoundError):
                self.run(self.store.get(key))
            return
        assert self.run(self.store.get(key)) == self.model[key]
        assert self.run(self.store.head(key)).size == len(self.model[key])

    def _start_in(self, key: str, data: st.DataObject) -> tuple[bytes, int] | None:
        """The model's bytes of ``key`` and a position drawn inside them (None: no bytes)."""
        blob = self.model.get(key)
        if not blob:
            return None
        return blob, data.draw(st.integers(0, len(blob) - 1))

    @rule(key=keys, data=st.data())
    def get_range(self, key: str, data: st.DataObject) -> None:
        if (held := self._start_in(key, data)) is None:
            return
        blob, start = held
        end = data.draw(st.integers(start + 1, len(blob)) | st.none())
        assert self.run(self.store.get(key, start, end)) == blob[start:end]

    @rule(key=keys, data=st.data())
    def read_into(self, key: str, data: st.DataObject) -> None:
        if (held := self._start_in(key, data)) is None:
            return
        blob, start = held
        size = data.draw(st.integers(1, len(blob) + 10))  # may run past the object's end

        def read() -> tuple[int, bytes] | None:
            reader = self.store.range_reader()
            if reader is None:
                return None
            buf = memoryview(bytearray(size))
            got = reader.read_into(key, start, buf)
            return got, bytes(buf[:got])

        got = self.run(asyncio.to_thread(read))
        if got is not None:
            assert got == (len(blob[start : start + size]), blob[start : start + size])

    @rule(prefix=st.sampled_from(PREFIXES))
    def listing(self, prefix: str) -> None:
        want = sorted((k, len(v)) for k, v in self.model.items() if k.startswith(prefix))
        got = [(o.key, o.size) for o in self.run(self.store.list(prefix))]
        assert got == want

    @invariant()
    def lists_exactly_the_model_and_no_pending_upload(self) -> None:
        got = [(o.key, o.size) for o in self.run(self.store.list(""))]
        assert got == sorted((k, len(v)) for k, v in self.model.items())
        assert self.run(self.store.list_uploads("")) == []


class LocalStoreMachine(StoreMachine):
    backend = "local"


class MemoryStoreMachine(StoreMachine):
    backend = "memory"


SETTINGS = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestLocalStoreAgainstModel = LocalStoreMachine.TestCase
TestLocalStoreAgainstModel.settings = SETTINGS
TestMemoryStoreAgainstModel = MemoryStoreMachine.TestCase
TestMemoryStoreAgainstModel.settings = SETTINGS
