"""A prefetch onto a node holding k, served by a peer that holds k and k+1, next to the same
prefetch served by the tier.

    python -m bench.peer_deltas [SERIES_DIR] [--rounds 2]

SERIES_DIR holds step_*/ saves (default /work/corpus/full); its two oldest are k and k+1.
Starts SeaweedFS, pushes both (k+1 as deltas of k), and runs agents in process on loopback:
A (the node that trained: k and k+1 in its hot dir), C (holds k, A is its peer) and B
(holds k, no peer). Each round times C's and B's prefetch of k+1, page cache dropped
first, and prints the bytes each moved and from where. The peer sends each chunk as a
delta against C's copy of k (issue 12); on one machine its encoding shares the cores with
C's decoding, which a real peer on its own node does not.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from agent.rpc.client import FerryClient
from bench._loopback import agent, loopback_s3
from bench._measure import drop_caches
from bench.data import link_tree
from transfer.engine import push
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB = "bench"


async def timed_prefetch(client: FerryClient, step: int) -> tuple[float, dict[str, Any]]:
    drop_caches()
    began = time.monotonic()
    done = await client.wait_prefetch(await client.prefetch(JOB, step), poll=0.02)
    if done["state"] != "ready":
        raise SystemExit(f"prefetch failed: {done}")
    return time.monotonic() - began, done


def oldest_two(series: Path) -> tuple[Path, Path]:
    saves = sorted(
        (d for d in series.iterdir() if step_from_dirname(d.name) is not None),
        key=lambda d: step_from_dirname(d.name) or 0,
    )
    return saves[0], saves[1]


async def run(series: Path, work: Path, bucket: str, rounds: int) -> list[str]:
    k, k1 = oldest_two(series)
    base, step = step_from_dirname(k.name) or 0, step_from_dirname(k1.name) or 0
    tier = f"s3://{bucket}/peer-deltas"
    store = open_store(tier, StoreOptions())
    try:
        await push(store, k, job=JOB, step=base, node="a")
        await push(store, k1, job=JOB, step=step, node="a")
    finally:
        await store.close()
    link_tree(k, work / "a" / JOB / k.name)
    link_tree(k1, work / "a" / JOB / k1.name)
    rows = []
    async with agent("a", work / "a", tier) as a:
        for rnd in range(rounds):
            for name, peers in (("c", a.base_url), ("b", "")):
                hot = work / f"{name}{rnd}"
                link_tree(k, hot / JOB / k.name)
                async with agent(name, hot, tier, FERRY_PEERS=peers) as client:
                    await asyncio.sleep(3)  # its watcher sees k (already in the tier)
                    took, done = await timed_prefetch(client, step)
                by_source = {s: n for s, n in done["bytes_by_source"].items() if n}
                moved = ", ".join(f"{s} {n / 1e6:,.0f} MB" for s, n in by_source.items())
                source = "peer A" if peers else "tier"
                rows.append(f"| {rnd + 1} | {source} | {took:.2f} s | {moved} |")
                print(rows[-1], file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("series", nargs="?", type=Path, default=Path("/work/corpus/full"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print("command: python -m bench.peer_deltas " + " ".join(sys.argv[1:]))
    with loopback_s3("ferry-peer-deltas-") as (work, ep):
        rows = asyncio.run(run(args.series, work, ep.bucket, args.rounds))
    print("| round | served by | prefetch of k+1 onto a node holding k | moved |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
