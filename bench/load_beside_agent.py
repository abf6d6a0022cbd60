"""Is the load after an agent's prefetch slower because the agent is still running?

    python -m bench.load_beside_agent SAVE_DIR [--runs 4]

bench.decision_to_loaded found the ``dcp.load`` after an agent's prefetch slower than after
``ferry pull`` or ``s5cmd cp`` (the 1.69 GB corpus: 3.3-5.7 s against 2.5-4.3 s), although
every load read memory. This tries to isolate it (two runs: only each run's first load was
slow, whatever restored it; bench/README): SAVE_DIR is pushed to SeaweedFS on loopback, then
in alternated rounds, page cache dropped and the machine settled before each, it is
restored by (a) a fresh agent's prefetch, loaded while that agent runs; (b) the same, the
agent stopped before the load; (c) ``ferry pull``; and loaded by a fresh, warmed loader
(bench/write_path.py). Prints each load's seconds, the medians, and the agent's resident
memory at ready (what it holds that a stopped agent gives back).
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.rpc.client import FerryClient  # noqa: E402
from bench._measure import drop_caches, settle  # noqa: E402
from bench.agents import TOKEN, Agent, agent_env  # noqa: E402
from bench.peers import Commands, tool_env  # noqa: E402
from bench.write_path import load, start_loader  # noqa: E402
from tests.s3server import start_s3_server  # noqa: E402

ARMS = ("agent running", "agent stopped", "ferry pull")
STEP = 1


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def prefetched(agent: Agent) -> Path:
    async with FerryClient(agent.url, TOKEN, timeout=900) as client:
        done = await client.wait_prefetch(await client.prefetch("j", STEP))
    if done["state"] != "ready":
        raise SystemExit(f"the prefetch ended {done}")
    return Path(done["dest"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("save", type=Path)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args(argv)
    print("python -m bench.load_beside_agent " + " ".join(sys.argv[1:] if argv is None else argv))
    work = Path(tempfile.mkdtemp(prefix="ferry-load-beside-"))
    server = start_s3_server(work / "s3")
    loads: dict[str, list[float]] = {arm: [] for arm in ARMS}
    held: list[float] = []
    try:
        cmd = Commands(server.endpoint)
        env = {**os.environ, **tool_env(server.endpoint, work / "rclone.conf")}
        env["PYTHONPATH"] = str(REPO)
        push = cmd.ferry_push(args.save, "tier", "j", STEP)
        subprocess.run(push, env=env, check=True, capture_output=True)
        (work / "token").write_text(TOKEN + "\n")
        node = agent_env(env, "c", work / "hot", cmd.s3("tier"), server.endpoint.url,
                         work / "token", [])  # fmt: skip
        node.update(FERRY_QUIET_SECONDS="3600", FERRY_RETENTION_INTERVAL_SECONDS="3600")
        for rnd in range(args.runs):
            for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
                pulled, restored = work / "pulled", work / "hot" / "j" / f"step_{STEP:06d}"
                loader = start_loader(pulled if arm == "ferry pull" else restored, warm=True)
                drop_caches()
                settle(work, limit=10)
                agent = None
                if arm == "ferry pull":
                    pull = cmd.ferry_pull("tier", "j", STEP, pulled)
                    subprocess.run(pull, env=env, check=True, capture_output=True)
                    out = pulled
                else:
                    agent = Agent("c", work / "hot", node)
                    agent.start(work / "agent.log")
                    out = asyncio.run(prefetched(agent))
                    assert agent.proc is not None
                    held.append(rss_mb(agent.proc.pid))
                    if arm == "agent stopped":
                        agent.stop()
                time.sleep(0.3)  # as long after the fetch in every arm
                got = load(loader)
                if agent is not None:
                    agent.stop()
                loads[arm].append(got.seconds)
                print(f"r{rnd + 1} {arm:<14} load {got.seconds:5.2f} s", flush=True)
                shutil.rmtree(out)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n| restored by | load s, median of {args.runs} | each |\n|---|---|---|")
    for arm, values in loads.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {arm} | {statistics.median(values):.2f} | {each} |")
    print(f"\nThe agent's resident memory at ready: {min(held):.0f}-{max(held):.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
