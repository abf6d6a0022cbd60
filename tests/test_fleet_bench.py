"""The fleet benchmark (bench/fleet.py) must not rot: its quick mode (N = 4, 8; 2 steps) runs
in-process against the session's S3 server. Only behaviour is asserted, never a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import fleet
from tests.s3server import S3Endpoint


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_quick_fleet_counts_requests(s3_env: S3Endpoint, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    doc = fleet.run(fleet.parse_args(["--quick", "--json", str(out)]), s3_env)

    assert out.is_file()
    runs: dict[int, dict[str, Any]] = {r["nodes"]: r for r in doc["runs"]}
    assert sorted(runs) == [4, 8]
    for n, r in runs.items():
        assert r["populate_seconds"] >= 0 and r["objects"] > 2 * n  # a manifest + pack each
        assert set(r["ops"]) == set(fleet.OPS)
        for name, op in r["ops"].items():
            if name == "load, another rank":  # its plan came from the coordinator
                assert op["control_requests"] == 0 and op["data_requests"] > 0, (n, op)
                continue
            assert op["control_requests"] > 0, (n, name, op)
            assert op["bytes"]["control_down"] > 0, (n, name, op)
        # a load reads the step's manifests once, on its coordinator
        assert r["ops"]["load, coordinator"]["areas"].get("GET manifests", 0) == n
        pull_step = r["ops"]["pull step"]["areas"]
        assert pull_step.get("GET manifests", 0) >= n, pull_step
        assert r["ops"]["pull step"]["data_requests"] >= n  # every part's pack at least
        assert r["ops"]["pull latest"]["areas"].get("GET manifests", 0) >= n
        # a survivor's share: every part without the marker's file map, three with it
        # (.metadata's, and the two old ranks' files it reads), whatever N
        assert r["ops"]["share, every part"]["areas"].get("GET manifests", 0) == n
        assert r["ops"]["share, by the map"]["areas"].get("GET manifests", 0) == 3
    push = runs[8]["ops"]["push"]
    assert push["areas"].get("PUT manifests", 0) >= 1, push
    assert push["data"].get("PUT", 0) + push["data"].get("POST", 0) >= 1, push  # its pack
    assert "| 8 |" in fleet.report(doc)


def test_classify_keys_and_listings() -> None:
    def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str]:
        return fleet.classify(method, path, query, "bkt", "fleet-n8")

    assert classify("GET", "/bkt/fleet-n8/manifests/j/000000000000000100/n0.json", {}) == (
        "GET",
        "manifests/j/000000000000000100/n0.json",
    )
    assert classify("GET", "/bkt", {"list-type": "2", "prefix": "fleet-n8/manifests/j/"}) == (
        "LIST",
        "manifests/j/",
    )
    assert classify("GET", "/bkt", {"list-type": "2", "prefix": "fleet-n8/"}) == ("LIST", "")
    tally = fleet.Tally()
    tally.add("PUT", "packs/ab/ab.pack", 100, 0)
    tally.add("LIST", "packs/", 0, 50)
    tally.add("GET", "manifests/j/1/n0.json", 0, 7)
    d = tally.to_dict()
    assert (d["control_requests"], d["data_requests"]) == (2, 1)  # a listing is control
    assert d["bytes"] == {"control_down": 57, "control_up": 0, "data_down": 0, "data_up": 100}
