"""How far the agent's migration estimate is from the measured prefetch, in the cases of
issue 12: a node holding nothing, a node holding k, a peer-served node, a tier-served node,
the step already here, and a standby's replica of it. At first contact (a fresh agent: no
rate measured yet) and after (the same agent, its meter calibrated by the first transfer).

    python -m bench.estimate_cases [SERIES_DIR]

SERIES_DIR holds step_*/ saves (default /work/series/full, 272 MB saves); its two newest
are k and k+1. Starts SeaweedFS, pushes k, then k+1 as deltas of k, and runs agents in
this process on loopback. Each case asks ``GET /v1/estimate`` for k+1, then times the
prefetch (first the machine is left to settle: a removed step is trimmed for seconds after
`rm` on this discard-mounted ext4; then the page cache is dropped); the second round
removes the restored step and does it again (not the held copy or the replica: those are
checked again). Error = predicted /
measured - 1 (target: within +-25%; for a check that takes under 0.1 s, how many ms off);
"in range": the measured time falls within the estimate's seconds_low..seconds_high.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agent.rpc.client import FerryClient
from bench._loopback import agent, loopback_s3
from bench._measure import drop_caches, settle, throttled_disk
from bench.data import link_tree
from bench.store_cost import saves
from transfer.engine import PushPlan, push
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB = "bench"


async def settled(hot: Path, name: str) -> None:
    """Until the agent has flushed its last restore (settle.py runs after `ready`): a flush
    still running would be timed as part of the next prefetch."""
    marker = hot / JOB / f".{name}.ferry-unsynced"
    for _ in range(600):
        if not marker.exists():
            return
        await asyncio.sleep(0.05)


async def replicated(client: FerryClient, step: int) -> None:
    """Until the standby replication has put ``step`` here (it starts on its own)."""
    for _ in range(1200):
        doc = await client._call("GET", "/v1/standby")
        if any(e["job"] == JOB and e["replicated_step"] == step for e in doc["jobs"]):
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"step {step} was never replicated")


async def measure(
    client: FerryClient, step: int, disk: Path
) -> tuple[dict[str, Any], float, dict[str, Any]]:
    # the machine quiet (a removed step is trimmed for seconds after `rm`) and the page
    # cache dropped: asked in the state the prefetch then runs in (a probe reads this disk)
    await asyncio.to_thread(settle, disk)
    drop_caches()
    est = await client.estimate(JOB, step)
    drop_caches()
    began = time.monotonic()
    done = await ready(client, await client.prefetch(JOB, step))
    if done["state"] != "ready":
        raise SystemExit(f"prefetch failed: {done}")
    return est, time.monotonic() - began, done


async def ready(client: FerryClient, prefetch_id: str) -> dict[str, Any]:
    """The prefetch's final state, by the agent's long poll: it answers when the prefetch
    ends, so the time measured is the prefetch's own. (Before the long poll this polled
    every 5 ms for 0.1 s, then every 50 ms; 5 ms throughout, 200 requests a second on the
    agent's event loop, made the prefetch it timed ~10% slower.)"""
    return await client.wait_prefetch(prefetch_id)


@contextlib.asynccontextmanager
async def node(
    name: str, work: Path, tier: str, held: list[Path], **env: str
) -> AsyncIterator[tuple[FerryClient, Path]]:
    hot = work / name
    for save in held:
        link_tree(save, hot / JOB / save.name)
    # the saves are in the tier already (pushed by "trainer"): an agent's watcher would push
    # its held copies again as its own parts, reading and hashing 1.7-3.4 GB beside the
    # measured prefetch (the held copy's second re-check ran 40% slower beside it)
    env = {"FERRY_QUIET_SECONDS": "3600", **env}
    async with agent(name, hot, tier, **env) as client:
        yield client, hot


async def run(series: Path, work: Path, bucket: str) -> list[str]:
    k, k1 = saves(series)[-2:]
    base, step = step_from_dirname(k.name) or 0, step_from_dirname(k1.name) or 0
    tier = f"s3://{bucket}/est"
    store = open_store(tier, StoreOptions())
    try:
        await push(store, k, job=JOB, step=base, node="trainer", plan=PushPlan(full=True))
        await push(store, k1, job=JOB, step=step, node="trainer", plan=PushPlan(base_dir=k))
    finally:
        await store.close()
    rows = [
        f"`python -m bench.estimate_cases {series}`: estimate of step {step} "
        f"({sum(f.stat().st_size for f in k1.iterdir()) / 1e6:,.0f} MB) against the "
        "measured prefetch",
        "",
        "| case | contact | source (estimate) | rate from | disk MB/s (from) | "
        "bytes predicted / moved | predicted s (range) | measured s | error | in range |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    async with node("trainer", work, tier, [k, k1]) as (peer, _):
        cases = [
            ("holding nothing, tier", [], {}),
            ("holding k, tier", [k], {}),
            ("holding k, peer holds k and k+1", [k], {"FERRY_PEERS": peer.base_url}),
            ("step already here", [k, k1], {}),
            ("replica present (standby)", [k], {"FERRY_STANDBY_JOBS": JOB}),
        ]
        for i, (label, held, env) in enumerate(cases):
            async with node(f"case{i}", work, tier, held, **env) as (
                client,
                hot,
            ):
                if "FERRY_STANDBY_JOBS" in env:
                    await replicated(client, step)
                for contact in ("first", "after"):
                    est, took, done = await measure(client, step, work)
                    moved = sum(done["bytes_by_source"].values())
                    low, high = est["seconds_low"], est["seconds_high"]
                    # a check with nothing to move takes milliseconds: off by how long, then
                    off = (
                        f"{est['seconds'] / took - 1:+.0%}"
                        if took >= 0.1
                        else (f"{(est['seconds'] - took) * 1e3:+.0f} ms")
                    )
                    rows.append(
                        f"| {label} | {contact} | {est['source']} | {est['rate_basis']} | "
                        f"{est['disk_rate'] / 1e6:,.0f} ({est['disk_rate_basis'] or '-'}) | "
                        f"{est['bytes_missing'] / 1e6:,.0f} / {moved / 1e6:,.0f} MB | "
                        f"{est['seconds']:.2f} ({low:.2f}-{high:.2f}) | {took:.2f} | "
                        f"{off} | {'yes' if low <= took <= high else 'no'} |"
                    )
                    await settled(hot, k1.name)
                    if label.startswith("holding"):
                        shutil.rmtree(hot / JOB / k1.name)  # the second round moves it again
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("series", type=Path, nargs="?", default=Path("/work/series/full"))
    ap.add_argument(
        "--disk-mbps",
        type=float,
        help="the agents' disk throttled to this many MB/s each way (a second, slower disk "
        "made of this one; root: bench._measure.throttled_disk); the S3 server is not",
    )
    args = ap.parse_args()
    rate = args.disk_mbps * 1e6 if args.disk_mbps else None
    with loopback_s3("ferry-estcases-") as (work, ep), throttled_disk(work, rate):
        rows = asyncio.run(run(args.series, work, ep.bucket))
    if rate:
        rows[0] += f" (the agents' disk throttled to {args.disk_mbps:g} MB/s: --disk-mbps)"
    print("\n".join(rows))


if __name__ == "__main__":
    main()
