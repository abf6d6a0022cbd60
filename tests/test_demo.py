"""``ferry demo``, a newcomer's first command: it runs the whole flow (two agents, a
training run's saves pushed in the background, an estimate and a prefetch onto the other
node, twice), says every copy is identical, and leaves nothing behind but says so."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from agent.cli.run import main as ferry


def test_the_demo_runs_the_whole_flow_and_says_what_it_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert ferry(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical: yes") == 2 and "identical: NO" not in out, out
    assert "the keyframe policy" in out, out  # (step 140's "delta 0" is explained)
    # the estimate's bytes to move are the coded bytes that then move (both read as MB)
    pairs = re.findall(r"predicted ([\d.]+) MB to move.*moved: peer ([\d.]+) MB", out)
    assert len(pairs) == 2, out
    for predicted, moved in pairs:
        assert abs(float(predicted) - float(moved)) <= 0.25 * float(moved), out
    (removed,) = re.findall(r"^removed (\S+) ", out, re.M)
    assert not Path(removed).exists() and Path(removed).parent == tmp_path, out
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "state"]), list(tmp_path.iterdir())
