"""The peer-routing benchmark (bench/peer_routing.py) must not rot, and what it shows holds at
a tiny size: a new node prefetching from 3 nodes that each hold their part asks each chunk
once, of its owner (asked in turn, a chunk of the third node's part cost three requests), and
reads nothing from S3. Only behaviour is asserted, never a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import peer_routing
from tests.s3server import S3Endpoint


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_a_new_node_asks_each_chunk_once_of_the_node_holding_it(
    s3_env: S3Endpoint, tmp_path: Path
) -> None:
    out = tmp_path / "peer_routing.json"
    args = peer_routing.parse_args(["--nodes", "3", "--chunks", "2", "--json", str(out)])
    (row,) = peer_routing.run(args, s3_env)["rows"]
    assert out.is_file()
    assert row["state"] == "ready", row
    assert row["peer_requests"] == row["served"] == row["chunks"] == 3 * 2 + 1, row
    assert row["from_s3"] == 0 and row["from_peers"] > 0, row
