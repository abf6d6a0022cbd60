"""Issue 32: the one-shot CLI writes a restore the way this node's agent chose for its disk
(agent/node/writechoice.py), not always warm: the agent's probe found buffered the faster way
on one VM (a cold pull 0.61 s buffered against 0.76 s warm), which the CLI could not know."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agent.cli.push_pull import _pull_options
from agent.cli.run import main as ferry
from agent.node import writechoice
from agent.node.writechoice import RECORDS, record_choice, recorded_choice
from tests.conftest import make_checkpoint, tree_bytes

pytestmark = pytest.mark.skipif(
    not writechoice.BOOT_ID.exists(), reason="the kernel's boot id keys the record"
)


def pull_write_path(capsys: pytest.CaptureFixture[str], url: str, dest: Path) -> str:
    assert ferry(["pull", url, str(dest), "--job", "j", "--step", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return str(doc["write_path"])


def test_a_cli_pull_writes_the_way_the_agents_probe_chose_for_that_disk(
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transfer.engine import writepath

    monkeypatch.setattr(writepath, "spare_memory", lambda: 1 << 30)  # (not this machine's)
    src = make_checkpoint(tmp_path / "src" / "step_000001", shard_bytes=2_000_000)
    assert ferry(["push", str(src), local_url, "--job", "j", "--node", "n0", "--json"]) == 0
    capsys.readouterr()
    # no agent has probed this disk: warm, as before
    assert pull_write_path(capsys, local_url, tmp_path / "d0") == "warm"
    # an agent whose hot dir is on this disk found the page cache the faster way
    (tmp_path / "hot").mkdir()
    record_choice(tmp_path / "hot", True, 1e9, 3e9)
    assert pull_write_path(capsys, local_url, tmp_path / "d1") == "buffered"
    assert tree_bytes(tmp_path / "d1") == tree_bytes(src)
    # a destination whose parents do not exist yet: its nearest existing one's disk
    assert pull_write_path(capsys, local_url, tmp_path / "not" / "made" / "d2") == "buffered"
    # where it found warm the faster way, warm
    record_choice(tmp_path / "hot", False, 3e9, 1e9)
    assert pull_write_path(capsys, local_url, tmp_path / "d3") == "warm"


def test_a_write_path_given_is_the_callers_own_choice(tmp_path: Path) -> None:
    from agent.cli.run import build_parser

    record_choice(tmp_path, True, 1e9, 3e9)

    def page_cache_first(*flags: str) -> bool:
        line = ["pull", "s3://b/p", str(tmp_path / "d"), "--job", "j", *flags]
        return _pull_options(build_parser(line).parse_args(line)).page_cache_first

    assert page_cache_first() is True  # (auto)
    assert page_cache_first("--write-path", "warm") is False
    assert page_cache_first("--write-path", "direct") is False


def test_a_record_too_old_of_another_boot_or_not_a_record_is_none(tmp_path: Path) -> None:
    state = tmp_path / "state"
    record_choice(tmp_path, True, 1e9, 3e9, state_dir=state)
    device = os.stat(tmp_path).st_dev
    assert recorded_choice(device, state_dir=state) is True
    (path,) = (state / RECORDS).iterdir()
    doc = json.loads(path.read_text())
    # too old: the disk's neighbours change
    doc[str(device)]["at"] = time.time() - writechoice.MAX_AGE_SECONDS - 60
    path.write_text(json.dumps(doc))
    assert recorded_choice(device, state_dir=state) is None
    # another boot's (device numbers are given out anew) is not read
    os.rename(path, path.with_name("another-boot.json"))
    assert recorded_choice(device, state_dir=state) is None
    # files that are not a record say nothing, and raise nothing (nor hang: a FIFO)
    for text in ("not json", "[]", "[" * 100_000, json.dumps({str(device): {"at": 0}})):
        path.write_text(text)
        assert recorded_choice(device, state_dir=state) is None
    path.unlink()
    os.mkfifo(path)
    assert recorded_choice(device, state_dir=state) is None
    # and the next agent replaces it with a record
    path.unlink()
    path.write_text("not json")
    record_choice(tmp_path, False, 3e9, 1e9, state_dir=state)
    assert recorded_choice(device, state_dir=state) is False


def test_nodes_sharing_a_home_keep_their_own_records_and_old_boots_go(tmp_path: Path) -> None:
    """A home directory on NFS is shared by every node of a cluster: one file per boot, so
    one node's agent never drops another's record; another boot's file goes once it is
    older than MAX_AGE_SECONDS."""
    state = tmp_path / "state"
    records = state / RECORDS
    records.mkdir(parents=True)
    other_node = records / "another-nodes-boot.json"
    other_node.write_text(json.dumps({"1": {"page_cache_first": True, "at": time.time()}}))
    gone = records / "a-boot-long-ago.json"
    gone.write_text("{}")
    long_ago = time.time() - writechoice.MAX_AGE_SECONDS - 60
    os.utime(gone, (long_ago, long_ago))
    record_choice(tmp_path, True, 1e9, 3e9, state_dir=state)
    names = sorted(p.name for p in records.iterdir())
    assert "another-nodes-boot.json" in names and "a-boot-long-ago.json" not in names
    assert len(names) == 2, names


def test_no_home_or_no_state_dir_is_no_record_and_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert recorded_choice(os.stat(tmp_path).st_dev) is None
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    if os.access(read_only, os.W_OK):  # (root writes anywhere: a file where the dir goes)
        read_only = tmp_path / "a-file"
        read_only.write_text("")
    with pytest.raises(OSError):
        record_choice(tmp_path, True, 1e9, 3e9, state_dir=read_only / "state")


def test_agents_leaving_their_choice_at_once_leave_one_readable_record(tmp_path: Path) -> None:
    """Agents of one user (or of one test process) may probe and write at once: each
    writes a file of its own and renames it over the record."""
    from concurrent.futures import ThreadPoolExecutor

    state = tmp_path / "state"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: record_choice(tmp_path, i % 2 == 0, 1e9, 2e9, state), range(64)))
    assert recorded_choice(os.stat(tmp_path).st_dev, state_dir=state) in (True, False)
    assert len(list((state / RECORDS).iterdir())) == 1  # (no file of a writer left)


def test_a_record_whose_probed_directory_is_gone_is_none(tmp_path: Path) -> None:
    """The demo's agents (and a benchmark's) probe a hot dir they remove when they stop:
    their record must not decide the user's next pulls for a week."""
    hot, state = tmp_path / "demo-hot", tmp_path / "state"
    hot.mkdir()
    record_choice(hot, True, 1e9, 3e9, state_dir=state)
    device = os.stat(tmp_path).st_dev
    assert recorded_choice(device, state_dir=state) is True
    hot.rmdir()
    assert recorded_choice(device, state_dir=state) is None
