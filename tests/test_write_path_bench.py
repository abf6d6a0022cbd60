"""The write-path benchmark (bench/write_path.py) must not rot: one round of every arm on a
small real DCP save; only behaviour is asserted (every arm pulled and loaded), never a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.mark.timeout(300)
def test_every_write_path_is_pulled_and_loaded(tmp_path: Path) -> None:
    from bench import write_path

    save = tmp_path / "series" / "tiny" / "step_000001"
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB of fp32
    dcp.save(state, checkpoint_id=str(save), no_dist=True)
    out = tmp_path / "results"
    argv = [str(save), "--runs", "1", "--workdir", str(tmp_path), "--out-dir", str(out)]
    assert write_path.main(argv) == 0
    doc = json.loads((out / "write_path_series_tiny.json").read_text())
    assert sorted(r["arm"] for r in doc["rows"]) == ["auto", "buffered", "direct", "warm"]
    for row in doc["rows"]:
        assert row["loaded_bytes"] == 4 * 256 * 1024 * 4, row
        assert row["pull"] > 0 and row["load"] > 0 and row["total"] >= row["pull"], row
    assert "| direct |" in (out / "write_path_series_tiny.md").read_text()
