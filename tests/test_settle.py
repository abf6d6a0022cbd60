"""Restores renamed into place before they are flushed (transfer/engine/settle.py): a
restore made before a reboot is removed, one of this boot is flushed and confirmed."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from tests.conftest import open_test_store, random_bytes, tree_bytes, write_file
from transfer.engine import PullPlan, pull, push
from transfer.engine.restorenames import marker_path
from transfer.engine.settle import boot_id, mark_unsynced, settle


def _restore(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A checkpoint pushed to a local store and pulled into out/<name> (not flushed)."""
    src = tmp_path / "src" / "step_000001"
    write_file(src / "__0_0.distcp", random_bytes(3 << 20, seed=1))
    write_file(src / ".metadata", random_bytes(1000, seed=2))
    store_dir = tmp_path / "store"
    store_dir.mkdir(exist_ok=True)

    async def go() -> None:
        store = open_test_store(str(store_dir))
        await push(store, src, job="j", step=1, node="n")
        await pull(store, tmp_path / "out" / name, PullPlan("j", 1))

    asyncio.run(go())
    return src, tmp_path / "out" / name


def test_a_restore_waits_for_no_flush_and_leaves_a_marker_of_this_boot(tmp_path: Path) -> None:
    src, dest = _restore(tmp_path, "dest")
    assert tree_bytes(dest) == tree_bytes(src)
    marker = json.loads(marker_path(dest).read_text())
    assert marker["boot_id"] == boot_id() and marker["dest"] == "dest"
    assert settle(dest.parent) == []  # same boot: flushed, confirmed, kept
    assert not marker_path(dest).exists() and tree_bytes(dest) == tree_bytes(src)


def test_a_restore_from_before_a_reboot_is_removed(tmp_path: Path) -> None:
    _, dest = _restore(tmp_path, "dest")
    doc = json.loads(marker_path(dest).read_text())
    doc["boot_id"] = "another-boot"  # what the marker says after the machine went down
    marker_path(dest).write_text(json.dumps(doc))
    orphan = dest.parent / ".gone.ferry-unsynced"  # its restore was never renamed in
    orphan.write_text("{not json")
    assert settle(dest.parent) == [dest]
    assert sorted(p.name for p in dest.parent.iterdir()) == []


def test_cli_pull_settles_the_parent_first_and_fsync_leaves_no_marker(tmp_path: Path) -> None:
    src, first = _restore(tmp_path, "first")
    doc = json.loads(marker_path(first).read_text())
    marker_path(first).write_text(json.dumps(doc | {"boot_id": "another-boot"}))
    rc = ferry(["pull", str(tmp_path / "store"), str(first.parent / "second"), "--job", "j",
                "--fsync", "--json"])  # fmt: skip
    assert rc == 0
    # the pre-reboot restore is gone; the --fsync one is flushed and needs no marker
    assert sorted(p.name for p in first.parent.iterdir()) == ["second"]
    assert tree_bytes(first.parent / "second") == tree_bytes(src)


@pytest.mark.skipif(boot_id() is None, reason="needs a boot id (Linux)")
def test_two_settles_of_one_directory_at_once_keep_every_restore(tmp_path: Path) -> None:
    """Two prefetches of one job that finish together settle the job's directory at once.
    A marker the other settle had just dropped was read as unreadable ("assume the
    worst"), and the verified restore of this boot it named was deleted (found by
    tests/test_soak.py: a prefetch of a step restored a moment before found it gone)."""
    parent, boot = tmp_path / "llm", boot_id()
    assert boot is not None
    restores = [write_file(parent / f"step_{i:06d}" / "x", b"x").parent for i in range(40)]
    for dest in restores:
        mark_unsynced(dest, boot)
    with ThreadPoolExecutor(2) as pool:
        removed = [f.result() for f in [pool.submit(settle, parent) for _ in range(2)]]
    assert removed == [[], []]
    assert sorted(p.name for p in parent.iterdir()) == [d.name for d in restores]  # no marker
