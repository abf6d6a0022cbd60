"""A store is made on purpose (issue 29, item 9): ``ferry init URL`` (or ``ferry push
--init``) writes its descriptor; every other push into a URL that is not a store fails in one
line and writes nothing there, locally and on S3; the agent refuses to start on such a tier
and its pushes never make one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from tests.conftest import make_checkpoint, open_test_store, put_object, store_objects
from tests.harness import REPO, make_node, make_queue, queue_agent, save, until
from transfer.errors import NotAStoreError
from transfer.format.layout import STORE_DESCRIPTOR_KEY

SMALL = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert ferry(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def entries(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("what", ["a shared scratch directory", "an empty mount point"])
def test_a_push_into_a_directory_that_is_no_store_fails_and_writes_nothing_there(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000010")
    target = tmp_path / "target"
    target.mkdir()
    if what == "a shared scratch directory":
        (target / "results.csv").write_text("someone else's\n")
    before = entries(target)
    err = one_line_error(capsys, "push", str(src), str(target), "--job", "j", "--node", "n")
    assert f"{target} is not a ckpt-ferry store" in err
    if what == "an empty mount point":
        assert f"create it with `ferry init {target}` (or pass --init)" in err
    else:  # (init would refuse it: not offered, the URL is most likely wrong)
        assert "holds other files: check the URL" in err and "--init" not in err, err
    assert entries(target) == before  # no packs/, manifests/, locks/, heads/, descriptor


def test_a_push_into_an_s3_prefix_that_is_no_store_fails_and_writes_nothing_there(
    empty_s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000010")
    err = one_line_error(capsys, "push", str(src), empty_s3_url, "--job", "j", "--node", "n")
    assert f"{empty_s3_url} is not a ckpt-ferry store" in err and "ferry init" in err
    assert store_objects(empty_s3_url) == []

    # a prefix that holds something else: refused by a push, by init and by push --init
    put_object(empty_s3_url, "data/part-0000.parquet", b"not a checkpoint")
    err = one_line_error(capsys, "push", str(src), empty_s3_url, "--job", "j", "--node", "n")
    assert "holds other files: check the URL" in err and "create it with" not in err, err
    err = one_line_error(capsys, "init", empty_s3_url)
    assert "is not empty and is not a ckpt-ferry store" in err
    one_line_error(capsys, "push", str(src), empty_s3_url, "--job", "j", "--init")
    assert store_objects(empty_s3_url) == ["data/part-0000.parquet"]


def test_a_checkpoint_given_as_the_store_is_named_as_one_by_push_pull_and_ls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Arguments swapped or a wrong path: the commands say the URL is a DCP checkpoint and
    offer no `ferry init` (which would refuse it); a pull does not call it merely empty
    of checkpoints; nothing is written there."""
    src = make_checkpoint(tmp_path / "src" / "step_000010")
    wrong = make_checkpoint(tmp_path / "ckpt" / "step_000020")
    before = entries(wrong)
    want = "(a DCP checkpoint: it has .metadata): check the URL"
    for argv in (
        ["push", str(src), str(wrong), "--job", "j", "--node", "n"],
        ["pull", str(wrong), str(tmp_path / "out"), "--job", "j"],
        ["ls", str(wrong)],
    ):
        err = one_line_error(capsys, *argv)
        assert f"{wrong} is not a ckpt-ferry store" in err and want in err, err
        assert "create it with" not in err, err
    assert entries(wrong) == before and not (tmp_path / "out").exists()


def test_init_makes_a_store_once_and_refuses_a_directory_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_checkpoint(tmp_path / "step_000010")
    store = tmp_path / "store"
    store.mkdir()
    assert ferry(["init", str(store), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"store": str(store), "created": True}
    assert entries(store) == [STORE_DESCRIPTOR_KEY]
    descriptor = (store / STORE_DESCRIPTOR_KEY).read_bytes()
    # idempotent: a store is left as it is, and said to be one
    assert ferry(["init", str(store)]) == 0
    assert "is already a ckpt-ferry store (nothing changed)" in capsys.readouterr().out
    assert (store / STORE_DESCRIPTOR_KEY).read_bytes() == descriptor
    assert ferry(["push", str(src), str(store), "--job", "j", "--node", "n", *SMALL]) == 0
    assert ferry(["ls", str(store)]) == 0
    # a directory that is not there yet is made (restic's `init` does the same)
    new = tmp_path / "new" / "nested"
    assert ferry(["init", str(new)]) == 0 and entries(new) == [STORE_DESCRIPTOR_KEY]
    capsys.readouterr()  # (the push's note on the fixture's stand-in .metadata)
    # one in use for something else is not
    scratch = tmp_path / "scratch"
    (scratch / "sub").mkdir(parents=True)
    (scratch / "sub" / ".hidden-notes").write_text("mine")
    err = one_line_error(capsys, "init", str(scratch))
    assert "is not empty and is not a ckpt-ferry store" in err
    assert entries(scratch) == ["sub", "sub/.hidden-notes"]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_push_init_makes_the_store_then_pushes(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = str(request.getfixturevalue(f"empty_{backend}_url"))
    src = make_checkpoint(tmp_path / "step_000010")
    argv = ["push", str(src), url, "--job", "j", "--node", "n", "--init", *SMALL]
    assert ferry(argv) == 0
    assert STORE_DESCRIPTOR_KEY in store_objects(url)
    assert ferry([*argv[: -len(SMALL)], "--step", "11", *SMALL]) == 0  # a store now: as is
    assert ferry(["pull", url, str(tmp_path / "back"), "--job", "j", "--step", "11"]) == 0


def test_the_agent_refuses_to_start_on_a_tier_that_is_no_store(tmp_path: Path) -> None:
    """A real ``ferry agent`` whose tier is an empty directory (a mount point whose mount is
    missing) exits 1 at start in one line naming ``ferry init``; the tier stays empty."""
    tier = tmp_path / "mnt-nfs"
    tier.mkdir()
    node = make_node(tmp_path, "a", [str(tier)], init_tiers=False)
    done = subprocess.run(
        [sys.executable, "-m", "agent", "agent"],
        env=node.env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"ferry agent: error: tier {tier} is not a ckpt-ferry store (no ferry-store.json): "
        f"create it with `ferry init {tier}`"
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert entries(tier) == []


def test_the_push_queue_never_makes_a_store(tmp_path: Path) -> None:
    """A tier that was down when the agent started and comes back as a bare directory: its
    pushes fail, naming ``ferry init``, and write nothing there."""
    hot, tier = tmp_path / "hot", tmp_path / "late-mount"
    queue, stores = make_queue([str(tier)], tmp_path / "state", max_attempts=1)  # missing now
    tier.mkdir()  # ... and mounted, empty, once the agent runs
    save(hot / "job1" / "step_000010", {"__0_0.distcp": os.urandom(100_000)})

    async def go() -> list[dict[str, object]]:
        async with queue_agent(queue, hot):
            await until(lambda: any(r["state"] == "failed" for r in queue.states()), within=30)
            rows = queue.states()
        for store in stores:
            await store.close()
        return rows

    (row,) = asyncio.run(go())
    assert "is not a ckpt-ferry store" in str(row["error"]) and "ferry init" in str(row["error"])
    assert entries(tier) == []


def test_the_python_api_still_makes_a_store_unless_told_not_to(tmp_path: Path) -> None:
    from transfer.engine import PushPlan, push

    src = make_checkpoint(tmp_path / "step_000010")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    async def go() -> None:
        a, b = open_test_store(str(tmp_path / "a")), open_test_store(str(tmp_path / "b"))
        try:
            await push(a, src, job="j", step=10, node="n")  # as tests and benchmarks do
            with pytest.raises(NotAStoreError, match="ferry init"):
                await push(b, src, job="j", step=10, node="n", plan=PushPlan(create_store=False))
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())
    assert STORE_DESCRIPTOR_KEY in store_objects(str(tmp_path / "a"))
    assert entries(tmp_path / "b") == []
