"""The share/fan-out benchmark (bench/share_fanout.py) must not rot: a tiny configuration (a
4-rank drill save of width 2048 in 16 KiB chunks, 4 agents) runs in-process against the
session's S3 server. Only behaviour is asserted, never a time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.s3server import S3Endpoint

pytest.importorskip("torch")
from bench import share_fanout


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_share_fanout_reads_less_from_s3_in_a_group(
    s3_env: S3Endpoint, tmp_path: Path
) -> None:
    out = tmp_path / "share_fanout.json"
    argv = ["--agents", "4", "--save-ranks", "4", "--width", "2048", "--chunk-size-kib", "16"]
    args = share_fanout.parse_args([*argv, "--timeout", "60", "--json", str(out)])
    doc = share_fanout.run(args, s3_env)

    assert out.is_file()
    assert os.environ["AWS_ENDPOINT_URL"] == s3_env.url  # the proxy's URL did not leak
    rounds = {r["name"]: r for r in doc["rounds"]}
    assert list(rounds) == list(share_fanout.ROUNDS)
    for r in rounds.values():
        assert len(r["agents"]) == 4
        for a in r["agents"]:
            assert a["state"] == "ready" and a["satisfied_by"] == "restored", (r["name"], a)
    pack = {name: r["tally"]["bytes"]["data_down"] for name, r in rounds.items()}
    assert 0 < pack["fan-out shares"] < pack["alone"], pack
    assert all(a["record_bytes"] for a in rounds["fan-out shares"]["agents"])  # partial copies
    assert all(a["record_bytes"] is None for a in rounds["fan-out whole"]["agents"])
    assert any(a["from_peers"] for a in rounds["fan-out shares"]["agents"])
    assert "| fan-out shares | 4/4 |" in share_fanout.report(doc)
