"""A local store removes the directories its deletes empty (a step's manifest directory, a
push lease's), so a job's listing does not grow with every step retention ever expired,
and a writer whose directory a concurrent delete removed makes it again: real directories,
real threads racing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.cli.run import main as ferry
from transfer.engine.catalog import list_steps
from transfer.store.local import LocalStore


def empty_dirs(root: Path) -> list[str]:
    """Empty directories below the store's top-level ones (``locks/``, ``packs/``, ...)."""
    found = (p for p in root.rglob("*") if p.is_dir() and not any(p.iterdir()))
    return sorted(str(p.relative_to(root)) for p in found if len(p.relative_to(root).parts) > 1)


def test_retention_leaves_no_emptied_step_directory(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert ferry(["init", str(store)]) == 0
    for step in (10, 20, 30):
        save = tmp_path / f"step_{step:06d}"
        save.mkdir()
        (save / "weights.bin").write_bytes(bytes([step]) * 5000)
        assert ferry(["push", str(save), str(store), "--job", "j", "--node", "n"]) == 0
    assert ferry(["retention", str(store), "--keep-last", "1"]) == 0
    assert empty_dirs(store) == []  # were manifests/j/<10>, <20> and locks/push/j/<step>
    assert asyncio.run(list_steps(LocalStore(store), "j")) == [30]
    assert ferry(["pull", str(store), str(tmp_path / "back"), "--job", "j"]) == 0
    assert (tmp_path / "back" / "weights.bin").read_bytes() == bytes([30]) * 5000


def test_a_write_into_a_directory_a_delete_empties_lands(tmp_path: Path) -> None:
    """Two threads: one puts and deletes keys of one directory over and over (each delete
    empties it and removes it), the other puts (and uploads) keys into it meanwhile;
    every write lands and stays, whatever the interleaving."""
    store = LocalStore(tmp_path / "s")
    rounds = 300
    errors: list[BaseException] = []

    async def churn() -> None:
        for i in range(rounds):
            await store.put(f"locks/push/j/0001/churn-{i}", b"x")
            await store.delete(f"locks/push/j/0001/churn-{i}")

    async def write() -> None:
        for i in range(rounds):
            if i % 2:
                await store.put(f"locks/push/j/0001/kept-{i}", b"k")
            else:
                upload = await store.begin_upload(f"locks/push/j/0001/kept-{i}")
                await upload.write_part(1, 0, b"k")
                await upload.complete()
            await store.delete(f"locks/push/j/0001/kept-{i}") if i % 3 == 0 else None

    def run(work: object) -> None:
        try:
            asyncio.run(work)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job(),)) for job in (churn, write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    kept = sorted(o.key for o in asyncio.run(store.list("locks/push/j/")))
    want = sorted(f"locks/push/j/0001/kept-{i}" for i in range(rounds) if i % 3)
    assert kept == want


def test_a_directory_removed_between_its_making_and_the_write_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the racing test above rarely hits, made certain: right after a writer
    makes its directory, a concurrent delete's prune removes it (injected: one rmdir, the
    prune's own call, at the one moment it can fall)."""
    store = LocalStore(tmp_path / "s")
    real_mkdir = Path.mkdir
    armed: list[bool] = []  # one prune per write
    pruned: list[Path] = []

    def mkdir_then_pruned(self: Path, *args: Any, **kwargs: Any) -> None:
        real_mkdir(self, *args, **kwargs)
        if self.name.startswith("000") and armed and self.is_dir() and not any(self.iterdir()):
            armed.pop()
            self.rmdir()
            pruned.append(self)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_pruned)
    armed.append(True)
    asyncio.run(store.put("locks/push/j/0001/a", b"a"))

    async def upload() -> None:
        up = await store.begin_upload("locks/push/j/0002/b")
        await up.write_part(1, 0, b"b")
        await up.complete()

    armed.append(True)
    asyncio.run(upload())
    assert len(pruned) == 2
    assert asyncio.run(store.get("locks/push/j/0001/a")) == b"a"
    assert asyncio.run(store.get("locks/push/j/0002/b")) == b"b"
