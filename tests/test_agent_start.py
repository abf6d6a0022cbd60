"""A start that fails part-way releases exactly what had started: the stores opened before
the failure are closed, and so is the push journal (agent/rpc.py's cleanup contexts, run by
daemon.serve's runner.cleanup)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent import rpc
from agent.config import load_config
from agent.daemon import serve
from agent.pushqueue import JOURNAL_FILE
from tests.harness import TOKEN, reserve_port
from transfer.store import StoreOptions
from transfer.store.base import Store


def _open_files() -> set[Path]:
    """What this process holds open (Linux: /proc/self/fd)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.add(Path(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # closed between the listing and the readlink
            continue
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_failed_start_releases_exactly_what_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hot dir that is a file: the stores open, then the journal, and then the prefetcher's
    # start-up sweep of the hot dir fails for real (NotADirectoryError)
    hot = tmp_path / "hot"
    hot.write_text("not a directory")
    tiers = [tmp_path / "fast", tmp_path / "cold"]
    for d in tiers:
        d.mkdir()
    env = {
        "FERRY_NODE": "a",
        "FERRY_HOT_DIR": str(hot),
        "FERRY_STATE_DIR": str(tmp_path / "state"),
        "FERRY_TIERS": ",".join(str(d) for d in tiers),
        "FERRY_LISTEN": f"127.0.0.1:{reserve_port()}",
    }
    config = load_config(None, env)
    opened: list[str] = []
    closed: list[str] = []
    real_open_store = rpc.open_store

    def recording_open_store(url: str, options: StoreOptions) -> Store:
        store = real_open_store(url, options)
        opened.append(url)
        close = store.close

        async def recording_close() -> None:
            closed.append(url)
            await close()

        store.close = recording_close  # type: ignore[method-assign]
        return store

    monkeypatch.setattr(rpc, "open_store", recording_open_store)
    with pytest.raises(NotADirectoryError):
        asyncio.run(serve(config, TOKEN))

    state = (tmp_path / "state").resolve()
    assert (state / JOURNAL_FILE).exists(), "it failed before the journal opened: no test"
    assert opened == [str(d) for d in tiers]
    assert sorted(closed) == sorted(opened)  # each store closed, once
    held = {p for p in _open_files() if state in p.parents}
    assert not held, f"the journal was left open: {held}"
