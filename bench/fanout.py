"""Fan-out restore: N agents prefetching one step at once, with and without the group.

    python -m bench.fanout [SAVE_DIR] [--agents 4]

SAVE_DIR is one real DCP save (default: the newest of /work/series/full, 272 MB). Starts
SeaweedFS behind a counting proxy (tests/faultproxy.py, no faults), pushes the save, then
runs ``--agents`` agents in this process on loopback, each with an empty hot dir, and has
them all prefetch it at once: first each on its own, then as one fan-out group (issue 12).
Prints the bytes read from S3 in all (at the proxy) as a multiple of one stored copy, the
wall time, and where each agent's bytes came from. All agents share these 2 cores, so the
times say little about real nodes; the bytes are what the group saves the store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

from bench._loopback import agent, loopback_s3
from bench._measure import drop_caches
from bench.store_cost import pack_bytes, saves
from tests.faultproxy import FaultProxy
from transfer.engine import push
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB = "bench"


async def prefetch_all(
    work: Path, tier: str, step: int, n: int, grouped: bool, tag: str
) -> tuple[float, list[dict[str, object]]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(agent(f"{tag}{i}", work / f"{tag}{i}", tier))
            for i in range(n)
        ]
        urls = [c.base_url for c in clients]
        drop_caches()
        began = time.monotonic()
        ids = [
            await c.prefetch(JOB, step, fanout=(urls, u) if grouped else None)
            for c, u in zip(clients, urls, strict=True)
        ]
        done = await asyncio.gather(
            *(c.wait_prefetch(i, poll=0.05) for c, i in zip(clients, ids, strict=True))
        )
        took = time.monotonic() - began
    for d in done:
        if d["state"] != "ready":
            raise SystemExit(f"prefetch failed: {d}")
    return took, list(done)


async def run(save: Path, work: Path, bucket: str, n: int, proxy: FaultProxy) -> list[str]:
    step = step_from_dirname(save.name) or 0
    tier = f"s3://{bucket}/fanout"
    store = open_store(tier, StoreOptions(endpoint_url=proxy.url))
    try:
        await push(store, save, job=JOB, step=step, node="trainer")
        stored = await pack_bytes(store)
    finally:
        await store.close()
    lines = [
        f"`python -m bench.fanout {save} --agents {n}`: {n} agents prefetch step {step} "
        f"({stored / 1e6:,.0f} MB stored) at once",
        "",
        "| mode | S3 bytes read in all / one copy | wall s | per agent: MB tier / peers |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for grouped in (False, True):
        before = proxy.stats.bytes_down
        took, done = await prefetch_all(work, tier, step, n, grouped, "g" if grouped else "a")
        read = (proxy.stats.bytes_down - before) / stored
        per = ", ".join(
            f"{_mb(d, 'tier:')}/{_mb(d, 'peer')}"
            for d in done  # type: ignore[arg-type]
        )
        mode = "fan-out group" if grouped else "each on its own"
        lines.append(f"| {mode} | {read:.2f}x | {took:.1f} | {per} |")
    return lines


def _mb(status: dict[str, object], prefix: str) -> str:
    by = status["bytes_by_source"]
    assert isinstance(by, dict)
    return f"{sum(v for k, v in by.items() if k.startswith(prefix)) / 1e6:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("save", type=Path, nargs="?", default=None)
    ap.add_argument("--agents", type=int, default=4)
    args = ap.parse_args()
    save = args.save or saves(Path("/work/series/full"))[-1]
    with loopback_s3("ferry-fanout-") as (work, ep), FaultProxy(ep.url) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url  # the agents read S3 through the proxy
        lines = asyncio.run(run(save, work, ep.bucket, args.agents, proxy))
    print("\n".join(lines))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
