"""Multi-GB sparse and random files, and a push killed with SIGKILL mid-flight."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from tests.conftest import store_objects, tree_bytes, write_file
from transfer.format.layout import MANIFESTS_PREFIX, PACKS_PREFIX

GiB = 1 << 30


def file_digest(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def make_sparse(path: Path, size: int, islands: int = 24) -> None:
    """A file of ``size`` bytes that is mostly holes, with random data islands."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
        step = size // islands
        for i in range(islands):
            fh.seek(i * step + 12345 * i)
            fh.write(os.urandom(300_000))


@pytest.mark.slow
def test_multi_gb_sparse_and_random_files_round_trip(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "step_000042"
    make_sparse(src / "__0_0.distcp", 3 * GiB + 4097)
    with open(src / "__1_0.distcp", "wb") as fh:
        for _ in range(24):
            fh.write(os.urandom(8 << 20))  # 192 MiB of incompressible data
    write_file(src / ".metadata", b"meta")

    assert ferry(["push", str(src), store_url, "--job", "big", "--node", "n", "--json"]) == 0
    pushed = json.loads(capsys.readouterr().out)
    assert pushed["bytes_raw"] == 3 * GiB + 4097 + (192 << 20) + 4
    # holes dedupe to a single zero chunk: far less than the raw size is stored
    assert pushed["bytes_transferred"] < (192 << 20) + 32 * (4 << 20)

    dest = tmp_path / "out"
    assert ferry(["pull", store_url, str(dest), "--job", "big", "--json"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert pulled["bytes_raw"] == pushed["bytes_raw"]
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        assert (dest / name).stat().st_size == (src / name).stat().st_size
        assert file_digest(dest / name) == file_digest(src / name), name
    # the restored sparse file stays sparse: holes are not written
    assert (dest / "__0_0.distcp").stat().st_blocks * 512 < GiB


def test_sigkilled_push_leaves_no_manifest_and_a_retry_succeeds(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "step_000009"
    for rank in range(3):
        write_file(src / f"__{rank}_0.distcp", os.urandom(80 << 20))
    write_file(src / ".metadata", b"metadata")  # (shards without it: an unfinished save)
    cmd = [
        sys.executable, "-m", "agent", "push", str(src), store_url, "--job", "k", "--node", "n",
        "--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10", "--window", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(k.startswith(PACKS_PREFIX) for k in store_objects(store_url)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the push finished before it could be interrupted"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    keys = store_objects(store_url)
    assert any(k.startswith(PACKS_PREFIX) for k in keys), "some data was already durable"
    assert not any(k.startswith(MANIFESTS_PREFIX) for k in keys), "but no manifest"
    assert ferry(["ls", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == []
    assert ferry(["pull", store_url, str(tmp_path / "none"), "--job", "k"]) == 1
    assert f"{store_url} holds no checkpoints" in capsys.readouterr().err  # (packs only)

    assert ferry(["push", str(src), store_url, "--job", "k", "--node", "n"]) == 0
    assert ferry(["pull", store_url, str(tmp_path / "out"), "--job", "k"]) == 0
    assert tree_bytes(tmp_path / "out") == tree_bytes(src)
