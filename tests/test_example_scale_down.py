"""examples/scale_down.py --world-size 4 as a user runs it: the local 8 -> 4 ranks drill
(8 gloo ranks save, 4 nodes push their parts, 2 survivors pull their shares with the ferry
CLI, 4 ranks load) ends with every tensor equal and exit status 0. A small width: ~20 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

pytest.importorskip("torch")


@pytest.mark.slow  # ~20 s alone: the 8-rank save and two 4-rank loads are real gloo processes
def test_scale_down_drill_resumes_on_4_ranks_from_the_survivors_shares(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "examples" / "scale_down.py"), "--world-size", "4"]
    cmd += ["--width", "256", "--workdir", str(tmp_path / "drill")]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every tensor equal: yes" in done.stdout, done.stdout
    assert "--world-size 4 --ranks 0-1" in done.stdout  # the survivors' share pulls ran
    assert "--world-size 4 --ranks 2-3" in done.stdout
