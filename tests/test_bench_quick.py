"""The benchmark harness must not rot: its quick mode runs in CI on tiny data (~30 s on 2
quiet cores). The timeout only catches a hang; no time is asserted (shared machines)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEEDS = ("s5cmd", "rclone", "zstd", "dd")


@pytest.mark.s3  # bench.compare starts its own S3 server
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    any(shutil.which(t) is None for t in NEEDS), reason=f"needs {', '.join(NEEDS)} on PATH"
)
def test_quick_compare_produces_sane_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    argv = [sys.executable, "-m", "bench.compare", "--quick", "--out-dir", str(out)]
    argv += ["--cache", str(tmp_path / "cache"), "--workdir", str(tmp_path / "work")]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    doc = json.loads((out / "compare.json").read_text())
    rows = {(r["scenario"], r["tool"]): r for r in doc["summary"]}
    for scenario in ("cold full push", "incremental push (k in store)", "cold full pull"):
        for tool in ("ferry", "s5cmd", "rclone", "zstd"):
            row = rows[(scenario, tool)]
            assert row["median_s"] > 0 and row["bytes_moved"] > 0 and row["peak_rss_mb"] > 0
        assert rows[(scenario, "ferry")]["vs_s5cmd"] > 0
    for scenario in ("prefetch onto node holding k", "peer-to-peer prefetch"):
        assert rows[(scenario, "ferry")]["vs_s5cmd"] > 0
    raw = rows[("incremental push (k in store)", "s5cmd")]["bytes_moved"]
    assert rows[("incremental push (k in store)", "ferry")]["bytes_moved"] < raw  # deltas
    p2p = [s for s in doc["samples"] if s["scenario"] == "peer-to-peer prefetch"]
    assert all(s["detail"]["bytes_by_source"].get("peer") for s in p2p), p2p
    assert {r["op"] for r in doc["scaling"]} == {"push", "pull"}
    assert len({r["size_mb"] for r in doc["scaling"]}) == 2
    limits = doc["limits_mb_per_s"]
    assert all(limits[k] > 0 for k in ("disk_write_direct", "s3_get_one_object", "memcpy"))
    for name in doc["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| cold full push | ferry |" in (out / "compare.md").read_text()
