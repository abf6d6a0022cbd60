"""Each operation reads the catalog once (issue 31): one push, one pull, one ``ferry ls``,
``du`` and ``verify`` list the job's manifests at most once and fetch each manifest at most
once, however many questions they ask of it. Retention lists twice, by design: the garbage
collector looks again right before its sweep, so that a part committed since the plan is
seen (FORMAT.md's GC rules); it reads only the manifests new since the first look. A real
local store counts its own requests."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import random_bytes, run, write_file
from transfer.engine import PullPlan, pull, push
from transfer.format import layout
from transfer.store.base import ObjectInfo
from transfer.store.local import LocalStore

JOB = "j"
NODES = ("n0", "n1", "n2")
STEPS = (10, 20, 30)


class CountingStore(LocalStore):
    """A local store that counts the listings and manifest reads made through it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lists: Counter[str] = Counter()
        self.manifest_gets: Counter[str] = Counter()

    async def list(self, prefix: str) -> list[ObjectInfo]:
        self.lists[prefix] += 1
        return await super().list(prefix)

    async def list_dirs(self, prefix: str) -> list[str]:
        self.lists[prefix] += 1
        return await super().list_dirs(prefix)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key.startswith(layout.manifest_prefix(JOB)):
            self.manifest_gets[key] += 1
        return await super().get(key, start, end)

    def reset(self) -> None:
        self.lists.clear()
        self.manifest_gets.clear()

    def job_listings(self) -> int:
        """Listings that walk the job's whole history (its manifests' prefix)."""
        return self.lists[layout.manifest_prefix(JOB)]


def _part(tmp_path: Path, node: str, step: int) -> Path:
    d = tmp_path / "hot" / node / f"step_{step}"
    write_file(d / f"__{NODES.index(node)}_0.distcp", random_bytes(300_000, step + len(node)))
    if node == NODES[0]:  # (rank 0's node's part holds .metadata, as in a real save)
        write_file(d / ".metadata", b"not parsed here")
    return d


@pytest.fixture
def fleet(tmp_path: Path) -> CountingStore:
    """Three nodes' parts of three steps."""
    (tmp_path / "store").mkdir()
    store = CountingStore(tmp_path / "store")
    for step in STEPS:
        for node in NODES:
            run(push(store, _part(tmp_path, node, step), job=JOB, step=step, node=node))
    store.reset()
    return store


def _assert_read_once(store: CountingStore) -> None:
    assert store.job_listings() <= 1, store.lists
    assert all(n == 1 for n in store.manifest_gets.values()), store.manifest_gets


def test_one_push_reads_the_catalog_once(fleet: CountingStore, tmp_path: Path) -> None:
    run(push(fleet, _part(tmp_path, "n1", 40), job=JOB, step=40, node="n1"))
    _assert_read_once(fleet)
    assert fleet.job_listings() == 0  # the node's head names its steps: no listing at all


def test_one_pull_reads_the_catalog_once(fleet: CountingStore, tmp_path: Path) -> None:
    run(pull(fleet, tmp_path / "out", PullPlan(JOB, None)))
    _assert_read_once(fleet)
    assert len(fleet.manifest_gets) == len(NODES)  # the newest step's parts, nothing older


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["ls", "--job", JOB],
        ["du"],
        ["verify", "--job", JOB],
        ["retention", "--keep-last", "1", "--grace", "0", "--repack-min-dead", "0.01"],
    ],
)
def test_one_listing_command_reads_the_catalog_once(
    fleet: CountingStore, command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.cli import main as ferry

    monkeypatch.setattr("transfer.store.open_store", lambda url, options=None: fleet)
    assert ferry([command[0], str(fleet.root), *command[1:]]) == 0
    listings = fleet.lists[layout.manifest_prefix(JOB)] + fleet.lists[layout.manifest_prefix()]
    assert listings <= (2 if command[0] == "retention" else 1), fleet.lists
    assert fleet.manifest_gets, "the command read no manifest: the count says nothing"
    assert all(n == 1 for n in fleet.manifest_gets.values()), fleet.manifest_gets
