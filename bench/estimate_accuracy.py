"""Does the agent's migration estimate predict the measured prefetch time?

    python -m bench.estimate_accuracy [--size-gb 1.2] [--warmup-mb 256]

Starts SeaweedFS (tests/s3server.py) and one agent (in process, real aiohttp server on
loopback), pushes a warm-up checkpoint and the measured one (float32 shards, like weights)
into S3, lets the agent prefetch the warm-up one (its first bandwidth sample), then asks
GET /v1/estimate for the big one, prefetches it, and prints predicted vs measured seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from bench._loopback import agent, loopback_s3
from transfer.engine import push
from transfer.store import open_store


def write_checkpoint(root: Path, size: int, seed: int) -> Path:
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per_shard = size // 4 // 4 * 4
    for rank in range(4):
        with open(root / f"__{rank}_0.distcp", "wb") as fh:
            left = per_shard
            while left:
                n = min(left, 32 << 20)
                fh.write(rng.normal(0, 0.02, n // 4).astype(np.float32).tobytes())
                left -= n
    (root / ".metadata").write_bytes(b"dcp")
    return root


async def run(work: Path, size: int, warmup: int, url: str) -> dict[str, float]:
    src = work / "src"
    warm = write_checkpoint(src / "warm" / "step_000001", warmup, 1)
    big = write_checkpoint(src / "big" / "step_000001", size, 2)
    store = open_store(url)
    await push(store, warm, job="warm", step=1, node="a")
    await push(store, big, job="big", step=1, node="a")
    await store.close()
    async with agent("b", work / "hot-b", url) as client:
        first = await client.estimate("warm")
        await client.wait_prefetch(await client.prefetch("warm"))
        est = await client.estimate("big", gpus=8, gpu_hour_price=2.0)
        began = time.monotonic()
        done = await client.wait_prefetch(await client.prefetch("big"), poll=0.05)
        measured = time.monotonic() - began
        assert done["state"] == "ready", done
    return {
        "bytes_total": est["bytes_total"],
        "bytes_missing": est["bytes_missing"],
        "default_rate_prediction_s": first["seconds"]
        * est["bytes_missing"]
        / max(first["bytes_missing"], 1),
        "predicted_s": est["seconds"],
        "measured_s": measured,
        "error": est["seconds"] / measured - 1,
        "cooldown_s": est["cooldown_seconds"],
        "cost": est["cost"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--warmup-mb", type=float, default=256)
    args = parser.parse_args()
    print("command: python -m bench.estimate_accuracy " + " ".join(sys.argv[1:]))
    with loopback_s3("ferry-est-") as (work, ep):
        r = asyncio.run(
            run(work, int(args.size_gb * 1e9), int(args.warmup_mb * 1e6), f"s3://{ep.bucket}/est")
        )
    cols = ["checkpoint", "missing", "predicted (default rates)", "predicted (measured)"]
    print("| " + " | ".join([*cols, "measured", "error"]) + " |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {r['bytes_total'] / 1e9:.2f} GB | {r['bytes_missing'] / 1e9:.2f} GB | "
        f"{r['default_rate_prediction_s']:.2f} s | {r['predicted_s']:.2f} s | "
        f"{r['measured_s']:.2f} s | {r['error']:+.0%} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
