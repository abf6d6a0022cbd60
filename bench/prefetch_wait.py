"""How soon the scheduler learns that a prefetch is ready: polling its status every 0.1 s
(FerryClient's way before the long poll) against the long poll (``GET
/v1/prefetch/{id}?wait=``: answered as the prefetch ends), on one real ``ferry agent``
process over SeaweedFS on loopback.

    python -m bench.prefetch_wait [SAVE_DIR] [--runs 5]

SAVE_DIR (default /work/series/full/step_000040) is pushed whole, and a 1 MB step made of
the first MiB of its largest file beside it: the small step shows the fixed part a wait
adds, the whole save what that is worth against its transfer. Each run prefetches each step
onto the empty node once per arm (the arms alternate who goes first), the page cache
dropped before each; the restored step is removed after. Prints medians, min and max.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.rpc.client import FerryClient  # noqa: E402
from bench._measure import drop_caches  # noqa: E402
from bench.agents import TOKEN, Agent, agent_env  # noqa: E402
from bench.peers import Commands, tool_env  # noqa: E402
from tests.s3server import start_s3_server  # noqa: E402

POLL_SECONDS = 0.1  # FerryClient.wait_prefetch's interval before the long poll


async def polled(client: FerryClient, prefetch_id: str) -> dict[str, Any]:
    while True:
        status = await client.prefetch_status(prefetch_id)
        if status["state"] in ("ready", "failed", "cancelled"):
            return status
        await asyncio.sleep(POLL_SECONDS)


async def long_polled(client: FerryClient, prefetch_id: str) -> dict[str, Any]:
    return await client.wait_prefetch(prefetch_id)


def small_step(save: Path, into: Path) -> Path:
    """A real one-tensor DCP save of 1 MiB: the first MiB of ``save``'s largest file, as
    fp32 (a push refuses shards without their ``.metadata``, or shorter than it says)."""
    import torch

    from bench.gen_checkpoints import dcp_save

    largest = max((p for p in save.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "rb") as fh:
        weights = torch.frombuffer(bytearray(fh.read(1 << 20)), dtype=torch.float32)
    step = into / "step_000001"
    dcp_save({"w": weights}, step)
    return step


async def measure(client: FerryClient, steps: dict[str, int], runs: int) -> dict[str, list[float]]:
    arms = [(f"poll every {POLL_SECONDS:g} s", polled), ("long poll", long_polled)]
    took: dict[str, list[float]] = {}
    for rnd in range(runs):
        for job, step in steps.items():
            for name, wait in arms if rnd % 2 == 0 else arms[::-1]:
                drop_caches()
                await asyncio.sleep(1.0)
                began = time.monotonic()
                done = await wait(client, await client.prefetch(job, step))
                took.setdefault(f"{job} | {name}", []).append(time.monotonic() - began)
                if done["state"] != "ready":
                    raise SystemExit(f"prefetch of {job} ended {done}")
                await asyncio.sleep(1.0)  # its flush, after ready
                shutil.rmtree(done["dest"])
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("save", type=Path, nargs="?", default=Path("/work/series/full/step_000040"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    print("python -m bench.prefetch_wait " + " ".join(sys.argv[1:] if argv is None else argv))
    work = Path(tempfile.mkdtemp(prefix="ferry-prefetch-wait-"))
    server = start_s3_server(work / "s3")
    agent = None
    try:
        cmd = Commands(server.endpoint)
        env = {**os.environ, **tool_env(server.endpoint, work / "rclone.conf")}
        env["PYTHONPATH"] = str(REPO)
        # job name -> (save, step): the 1 MB step, and the save itself
        saves = {
            "1 MB step": (small_step(args.save, work / "small"), 1),
            "the save": (args.save, 2),
        }
        for job, (save, step) in saves.items():
            push = cmd.ferry_push(save, "tier", job.replace(" ", "-"), step)
            subprocess.run(push, env=env, check=True, capture_output=True)
        steps = {job.replace(" ", "-"): step for job, (_, step) in saves.items()}
        (work / "token").write_text(TOKEN + "\n")
        node = agent_env(env, "c", work / "hot", cmd.s3("tier"), server.endpoint.url,
                         work / "token", [])  # fmt: skip
        node.update(FERRY_QUIET_SECONDS="3600", FERRY_RETENTION_INTERVAL_SECONDS="3600")
        agent = Agent("c", work / "hot", node)
        agent.launch(work / "agent.log")
        agent.wait_healthy(work / "agent.log")

        async def go() -> dict[str, list[float]]:
            async with FerryClient(agent.url, TOKEN, timeout=900) as client:
                return await measure(client, steps, args.runs)

        took = asyncio.run(go())
    finally:
        if agent is not None:
            agent.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n| step | the scheduler waits by | median ms | min-max ms (n={args.runs}) |")
    print("|---|---|---|---|")
    for key, values in took.items():
        ms = [v * 1000 for v in values]
        print(f"| {key} | {statistics.median(ms):.0f} | {min(ms):.0f}-{max(ms):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
