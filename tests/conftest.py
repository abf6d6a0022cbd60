"""Fixtures: a real S3 server for the session (MinIO, an external endpoint, or SeaweedFS),
a fresh prefix in it per test, and helpers to build checkpoint directories."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.rpc.client import FerryClient
from tests.faultproxy import FaultProxy
from tests.s3server import S3Endpoint, start_s3_server
from transfer.engine.catalog import init_store
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that reaches the S3 server ``s3``, so ``pytest -m "not s3"`` is the
    fast tier (local and in-memory stores only; no server to start)."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        params = getattr(getattr(item, "callspec", None), "params", {})
        # store_url picks its backend at run time (getfixturevalue): judge by its param
        if params.get("store_url") == "s3" or (
            "s3_endpoint" in names and "store_url" not in params
        ):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    server = start_s3_server(tmp_path_factory.mktemp("s3server"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> S3Endpoint:
    """Point the standard AWS environment (what users set) at the test server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_endpoint


@pytest.fixture
def empty_s3_url(s3_env: S3Endpoint) -> str:
    """A fresh, empty prefix in the test bucket: not a store yet (``ferry init`` makes one)."""
    return f"s3://{s3_env.bucket}/t-{secrets.token_hex(6)}"


@pytest.fixture
def s3_url(empty_s3_url: str) -> str:
    """A fresh, empty ckpt-ferry store in the test bucket (made as ``ferry init`` makes one:
    the CLI and the agent write only into stores made on purpose)."""
    return init_test_store(empty_s3_url)


@pytest.fixture
def s3_proxy(s3_env: S3Endpoint) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the test S3 server (no faults until told), seeded
    per test; pass ``s3_proxy.url`` as the endpoint."""
    proxy = FaultProxy(s3_env.url, seed=1234, stall_seconds=0.5)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def empty_local_url(tmp_path: Path) -> str:
    """A fresh, empty directory: not a store yet (``ferry init`` makes one)."""
    root = tmp_path / "store"
    root.mkdir()
    return str(root)


@pytest.fixture
def local_url(empty_local_url: str) -> str:
    """A fresh, empty ckpt-ferry store in a directory (made as ``ferry init`` makes one)."""
    return init_test_store(empty_local_url)


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every store-agnostic test runs against both backends."""
    if request.param == "local":
        return str(request.getfixturevalue("local_url"))
    return str(request.getfixturevalue("s3_url"))


def open_test_store(url: str) -> Store:
    return open_store(url, StoreOptions())


def init_test_store(url: str) -> str:
    """Make ``url`` a ckpt-ferry store (what ``ferry init URL`` does); returns it."""

    async def go() -> None:
        store = open_test_store(url)
        try:
            await init_store(store)
        finally:
            await store.close()

    asyncio.run(go())
    return url


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def write_file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def random_bytes(n: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def make_checkpoint(root: Path, *, seed: int = 0, shard_bytes: int = 3_000_000) -> Path:
    """A small DCP-shaped checkpoint: two shards, a .metadata, an empty file, a nested dir."""
    write_file(root / "__0_0.distcp", random_bytes(shard_bytes, seed))
    write_file(root / "__1_0.distcp", random_bytes(shard_bytes // 2 + 17, seed + 1))
    write_file(root / ".metadata", b"metadata-" + str(seed).encode())
    write_file(root / "extra" / "empty.bin", b"")
    write_file(root / "extra" / "deep" / "notes.txt", b"hello\n" * 100)
    return root


def adamw_series(
    root: Path, saves: int, *, frozen: float = 0.0, seed: int = 0, mib: int = 3
) -> list[Path]:
    """DCP-shaped checkpoints: weights + two moments, updated a little between saves;
    ``frozen`` is the fraction of weights (and their moments) that never change."""
    rng = np.random.default_rng(seed)
    n = mib * (1 << 20) // 4  # mib MiB per tensor
    w = rng.normal(0, 0.02, n).astype(np.float32)
    m = rng.normal(0, 1e-4, n).astype(np.float32)
    v = np.abs(rng.normal(0, 1e-8, n)).astype(np.float32)
    live = np.arange(n) >= int(n * frozen)
    dirs = []
    for k in range(saves):
        d = root / f"step_{(k + 1) * 20:06d}"
        write_file(d / "__0_0.distcp", w.tobytes() + m.tobytes())
        write_file(d / "__1_0.distcp", v.tobytes())
        write_file(d / ".metadata", b"dcp")
        dirs.append(d)
        g = rng.normal(0, 1e-3, n).astype(np.float32)
        m = np.where(live, 0.9 * m + 0.1 * g, m).astype(np.float32)
        v = np.where(live, 0.999 * v + 0.001 * g * g, v).astype(np.float32)
        w = np.where(live, w - 3e-5 * m / (np.sqrt(v) + 1e-8) * 1e-2, w).astype(np.float32)
    return dirs


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Relative path -> content, for byte-exact comparisons of whole trees."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def tree_modes(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): p.stat().st_mode & 0o777
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def store_objects(url: str) -> list[str]:
    async def go() -> list[str]:
        store = open_test_store(url)
        try:
            return [o.key for o in await store.list("")]
        finally:
            await store.close()

    return asyncio.run(go())


def put_object(url: str, key: str, data: bytes) -> None:
    """One object written straight into a store (what a test plants there)."""

    async def go() -> None:
        store = open_test_store(url)
        try:
            await store.put(key, data)
        finally:
            await store.close()

    asyncio.run(go())


@pytest.fixture(autouse=True)
def _no_ambient_aws_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Never let a developer's ~/.aws config leak into a test, nor a test's push resume
    # logs (agent/node/journal.py) into the developer's ~/.local/state.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))


@pytest.fixture(autouse=True)
def _no_ambient_cgroup_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the node can spare must not depend on the memory limit of the container the
    # suite runs in (tests/test_spare_memory.py reads fake cgroup trees instead).
    import transfer.engine.writepath as writepath

    monkeypatch.setattr(writepath, "cgroup_room", lambda: None)


async def prefetched(client: FerryClient, step: int | str = "latest", job: str = "llm") -> dict:  # type: ignore[type-arg]
    """Prefetch ``step`` through an agent's RPC and wait for it to be ready."""
    done = await client.wait_prefetch(await client.prefetch(job, step), within_s=60)
    assert done["state"] == "ready", done
    return done


def resident_fraction(path: Path) -> float:
    """The part of ``path``'s pages in the page cache: mincore(2) over a private mapping of
    it (mapping faults nothing in, and neither does mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        view = (ctypes.c_char * size).from_buffer(m)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec)
        finally:
            del view
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) / pages
