"""Restores renamed into place before they are flushed (transfer/engine/settle.py): one of
this boot is flushed and confirmed; one made before a reboot is read back and checked
against the chunks its marker names: whole, it is kept; torn (or not checkable), the agent
removes it and ``ferry pull`` moves it aside and says so, the user's own files in it kept."""

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


def _rebooted(dest: Path) -> None:
    """What the marker says after the machine went down (another boot's id)."""
    doc = json.loads(marker_path(dest).read_text())
    marker_path(dest).write_text(json.dumps(doc | {"boot_id": "another-boot"}))


def test_a_whole_restore_from_before_a_reboot_is_checked_and_kept(tmp_path: Path) -> None:
    """A clean reboot (or one long after the kernel wrote the restore back) costs nothing:
    the restore is read back, every chunk checked, and kept (it was removed, found by a
    newcomer's trial: a later pull into the same directory deleted an earlier restore and
    the notes the user had put in it, without a word)."""
    src, dest = _restore(tmp_path, "dest")
    (dest / "NOTES.txt").write_text("mine")
    _rebooted(dest)
    orphan = dest.parent / ".gone.ferry-unsynced"  # its restore was never renamed in
    orphan.write_text("{not json")
    told: list[Path] = []
    (found,) = settle(dest.parent, move_torn=True, before_check=told.append)
    assert (found.dest, found.whole) == (dest, True) and told == [dest]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest"]  # markers dropped
    assert tree_bytes(dest) == tree_bytes(src) | {"NOTES.txt": b"mine"}


@pytest.mark.parametrize("move_torn", [False, True])
def test_a_torn_restore_from_before_a_reboot_is_removed_or_moved_aside(
    tmp_path: Path, move_torn: bool
) -> None:
    """Torn: a page the kernel never wrote back reads as zeros. The agent's hot dir loses
    the restore; a user's directory gets it back aside, with the user's own files."""
    _, dest = _restore(tmp_path, "dest")
    (dest / "NOTES.txt").write_text("mine")
    shard = dest / "__0_0.distcp"
    with shard.open("r+b") as f:
        f.seek(1 << 20)
        f.write(bytes(4096))
    _rebooted(dest)
    (found,) = settle(dest.parent, move_torn)
    assert not found.whole
    if move_torn:
        assert "__0_0.distcp: the chunk at byte" in found.why
        assert found.moved_to == dest.with_name("dest.torn")
        assert (found.moved_to / "NOTES.txt").read_text() == "mine"
        assert sorted(p.name for p in dest.parent.iterdir()) == ["dest.torn"]
    else:  # (the agent, before it serves: never reads GBs back, removes)
        assert "not checked here" in found.why
        assert found.moved_to is None and list(dest.parent.iterdir()) == []


def test_a_restore_its_user_changed_since_is_kept_and_a_malformed_marker_is_not_trusted(
    tmp_path: Path,
) -> None:
    """(Found in review: a rewritten .metadata made the restore "torn" and moved it away; a
    marker with a 3 GiB chunk size made the check allocate it.)"""
    import os
    import time

    _, dest = _restore(tmp_path, "dest")
    _rebooted(dest)
    later = time.time() + 10
    (dest / ".metadata").write_bytes(b"edited")
    os.utime(dest / ".metadata", (later, later))
    (found,) = settle(dest.parent, move_torn=True)
    assert found.whole and "changed since it was restored" in found.why
    assert (dest / ".metadata").read_bytes() == b"edited"
    _, other = _restore(tmp_path, "other")
    doc = json.loads(marker_path(other).read_text())
    doc["chunks"] = {"__0_0.distcp": [[0, 3 << 30, "0" * 64]]}
    marker_path(other).write_text(json.dumps(doc | {"boot_id": "another-boot"}))
    (found,) = [f for f in settle(other.parent, move_torn=True) if f.dest == other]
    assert not found.whole and "malformed" in found.why and found.moved_to is not None


def test_a_share_from_before_a_reboot_cannot_be_checked(tmp_path: Path) -> None:
    """A share's marker names no chunks (it holds only some of its files' bytes)."""
    dest = write_file(tmp_path / "out" / "step_000001" / "x", b"x").parent
    boot = boot_id() or "this-boot"
    mark_unsynced(dest, boot)
    _rebooted(dest)
    (found,) = settle(dest.parent, move_torn=True)
    assert not found.whole and "names no chunks" in found.why
    assert found.moved_to is not None and (found.moved_to / "x").read_bytes() == b"x"


def test_cli_pull_settles_the_parent_first_and_says_what_it_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, first = _restore(tmp_path, "first")
    _rebooted(first)
    rc = ferry(["pull", str(tmp_path / "store"), str(first.parent / "second"), "--job", "j",
                "--fsync", "--json"])  # fmt: skip
    assert rc == 0
    assert f"{first}: restored before the last reboot; every chunk" in capsys.readouterr().err
    # the pre-reboot restore is whole and kept; the --fsync one is flushed, with no marker
    assert sorted(p.name for p in first.parent.iterdir()) == ["first", "second"]
    assert tree_bytes(first.parent / "second") == tree_bytes(src) == tree_bytes(first)
    # and a pull that fails settles the same way, never deleting a restore
    assert not marker_path(first).exists()
    rc = ferry(["pull", str(tmp_path / "store"), str(first.parent / "third"), "--job", "nosuch"])
    assert rc != 0 and sorted(p.name for p in first.parent.iterdir()) == ["first", "second"]


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
