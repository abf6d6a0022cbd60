"""Already there before the decision: a standby's prefetch next to a cold one and s5cmd.

    python -m bench.standby [SERIES_DIR] [--rounds 3]

SERIES_DIR holds step_*/ saves (default /work/corpus/full, from ``python -m bench.corpus``);
its two newest are k and k+1. Starts SeaweedFS (tests/s3server.py), pushes k and k+1 (as
deltas) under job ``bench`` and k+1 as plain files for s5cmd, then runs two agents in
process on loopback:

- B is a standby for the job (``standby_jobs``): it copies k+1 in the background as soon
  as it is durable; the bench waits for that, then times the decision-time prefetch;
- C is not: its prefetch of k+1 is a cold restore.

Each round drops the page cache before each timed operation and times ``s5cmd cp`` of
k+1 beside them. Target (issue 12): the standby's decision-time prefetch takes <= 0.1x of
a cold full pull.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.rpc.client import FerryClient
from bench._loopback import agent, loopback_s3
from bench._measure import drop_caches
from transfer.engine import push
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB = "bench"


async def timed_prefetch(client: FerryClient, step: int) -> tuple[float, dict[str, Any]]:
    drop_caches()
    began = time.monotonic()
    done = await client.wait_prefetch(await client.prefetch(JOB, step), poll=0.01)
    took = time.monotonic() - began
    if done["state"] != "ready":
        raise SystemExit(f"prefetch failed: {done}")
    return took, done


async def replicated(client: FerryClient, step: int) -> dict[str, Any]:
    while True:
        doc = await client._call("GET", "/v1/standby")
        entry = next(e for e in doc["jobs"] if e["job"] == JOB)
        if entry["replicated_step"] == step:
            return entry  # type: ignore[no-any-return]
        if entry["last_error"]:
            raise SystemExit(f"replication failed: {entry['last_error']}")
        await asyncio.sleep(0.1)


def s5cmd(src: str, dest: str) -> float:
    drop_caches()
    began = time.monotonic()
    subprocess.run(
        ["s5cmd", "--endpoint-url", os.environ["AWS_ENDPOINT_URL"], "cp", src, dest],
        check=True,
        capture_output=True,
    )
    return time.monotonic() - began


def newest_two(series: Path) -> tuple[Path, Path]:
    saves = sorted(
        (d for d in series.iterdir() if step_from_dirname(d.name) is not None),
        key=lambda d: step_from_dirname(d.name) or 0,
    )
    return saves[-2], saves[-1]


async def run(series: Path, work: Path, bucket: str, rounds: int) -> list[dict[str, float]]:
    k, k1 = newest_two(series)
    step = step_from_dirname(k1.name)
    assert step is not None
    tier = f"s3://{bucket}/standby"
    store = open_store(tier, StoreOptions())
    try:
        for d in (k, k1):
            await push(store, d, job=JOB, step=step_from_dirname(d.name) or 0, node="a")
    finally:
        await store.close()
    s5cmd(f"{k1}/*", f"s3://{bucket}/raw/")
    rows = []
    for rnd in range(rounds):
        hot_b, hot_c = work / f"b{rnd}", work / f"c{rnd}"
        standby = {"FERRY_STANDBY_JOBS": JOB, "FERRY_STANDBY_POLL_SECONDS": "0.2",
                   "FERRY_STANDBY_MAX_RATE": "0"}  # fmt: skip
        async with agent("b", hot_b, tier, **standby) as b:
            began = time.monotonic()
            entry = await replicated(b, step)
            background = time.monotonic() - began
            at_decision, done = await timed_prefetch(b, step)
            assert done["satisfied_by"] == "replica", done
        async with agent("c", hot_c, tier) as c:
            cold, _ = await timed_prefetch(c, step)
        dest = work / f"s5-{rnd}"
        plain = s5cmd(f"s3://{bucket}/raw/*", f"{dest}/")
        rows.append(
            {
                "background_s": background,
                "background_bytes": sum(entry["last_replication"]["bytes_by_source"].values()),
                "at_decision_s": at_decision,
                "cold_s": cold,
                "s5cmd_s": plain,
            }
        )
        print(rows[-1], file=sys.stderr)
        for d in (hot_b, hot_c, dest):
            shutil.rmtree(d, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("series", nargs="?", type=Path, default=Path("/work/corpus/full"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print("command: python -m bench.standby " + " ".join(sys.argv[1:]))
    with loopback_s3("ferry-standby-") as (work, ep):
        rows = asyncio.run(run(args.series, work, ep.bucket, args.rounds))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print("| decision-time prefetch, standby | cold prefetch | s5cmd cp | standby / cold "
          "| standby / s5cmd | background copy (before the decision) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(
        f"| {med('at_decision_s'):.3f} s | {med('cold_s'):.2f} s | {med('s5cmd_s'):.2f} s | "
        f"{med('at_decision_s') / med('cold_s'):.3f}x | "
        f"{med('at_decision_s') / med('s5cmd_s'):.3f}x | "
        f"{med('background_s'):.1f} s, {med('background_bytes') / 1e6:,.0f} MB |"
    )
    print(f"(medians of {len(rows)} rounds; page cache dropped before each timed operation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
