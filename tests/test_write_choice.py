"""Issue 32: the one-shot CLI writes a restore the way this node's agent chose for its disk
(agent/node/writechoice.py), not always warm: the agent's probe found buffered the faster way
on one VM (a cold pull 0.61 s buffered against 0.76 s warm), which the CLI could not know."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from agent.node import writechoice
from agent.node.writechoice import RECORD_NAME, record_choice, recorded_choice
from tests.conftest import make_checkpoint, tree_bytes

pytestmark = pytest.mark.skipif(
    not writechoice.BOOT_ID.exists(), reason="the kernel's boot id keys the record"
)


def pull_write_path(capsys: pytest.CaptureFixture[str], url: str, dest: Path) -> str:
    assert ferry(["pull", url, str(dest), "--job", "j", "--step", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return str(doc["write_path"])


def test_a_cli_pull_writes_the_way_the_agents_probe_chose_for_that_disk(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "src" / "step_000001", shard_bytes=2_000_000)
    url = local_url
    assert ferry(["push", str(src), url, "--job", "j", "--node", "n0", "--json"]) == 0
    capsys.readouterr()
    # no agent has probed this disk: warm, as before (the restore fits in spare memory)
    assert pull_write_path(capsys, url, tmp_path / "d0") == "warm"
    # an agent whose hot dir is on this disk found the page cache the faster way
    (tmp_path / "hot").mkdir()
    record_choice(tmp_path / "hot", True, 1e9, 3e9)
    assert recorded_choice(tmp_path / "not" / "made" / "yet") is True  # (its nearest parent)
    assert pull_write_path(capsys, url, tmp_path / "d1") == "buffered"
    assert tree_bytes(tmp_path / "d1") == tree_bytes(src)
    # and where it found warm the faster way, warm
    record_choice(tmp_path / "hot", False, 3e9, 1e9)
    assert pull_write_path(capsys, url, tmp_path / "d2") == "warm"
    # a flag given is the caller's own choice
    record_choice(tmp_path / "hot", True, 1e9, 3e9)
    argv = ["pull", url, str(tmp_path / "d3"), "--job", "j", "--write-path", "warm", "--json"]
    assert ferry(argv) == 0
    assert json.loads(capsys.readouterr().out)["write_path"] == "warm"


def test_a_record_of_another_boot_an_old_one_or_a_bad_file_is_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    record_choice(tmp_path, True, 1e9, 3e9, state_dir=state)
    assert recorded_choice(tmp_path, state_dir=state) is True
    path = state / RECORD_NAME
    doc = json.loads(path.read_text())
    (key,) = doc
    # too old: the disk's neighbours change
    doc[key]["at"] = time.time() - writechoice.MAX_AGE_SECONDS - 60
    path.write_text(json.dumps(doc))
    assert recorded_choice(tmp_path, state_dir=state) is None
    # another boot's (device numbers are given out anew): not taken, and dropped when the
    # next agent leaves its own
    dev = key.split(":")[1]
    doc = {f"another-boot:{dev}": {**doc[key], "at": time.time()}}
    path.write_text(json.dumps(doc))
    assert recorded_choice(tmp_path, state_dir=state) is None
    record_choice(tmp_path, False, 3e9, 1e9, state_dir=state)
    assert list(json.loads(path.read_text())) == [key]
    assert recorded_choice(tmp_path, state_dir=state) is False
    # a file that is not what it should be says nothing, and raises nothing
    for text in ("not json", "[]", json.dumps({key: {"page_cache_first": "yes", "at": 0}})):
        path.write_text(text)
        assert recorded_choice(tmp_path, state_dir=state) is None
    path.unlink()
    os.mkdir(path)  # (not even a file)
    assert recorded_choice(tmp_path, state_dir=state) is None


def test_agents_leaving_their_choice_at_once_leave_one_readable_record(tmp_path: Path) -> None:
    """Agents of one user (or of one test process) may probe and write at once: each
    writes a file of its own and renames it over the record."""
    from concurrent.futures import ThreadPoolExecutor

    state = tmp_path / "state"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: record_choice(tmp_path, i % 2 == 0, 1e9, 2e9, state), range(64)))
    assert recorded_choice(tmp_path, state_dir=state) in (True, False)
    assert [p.name for p in state.iterdir()] == [RECORD_NAME]  # (no file of a writer left)
