"""``ferry demo``: the real thing on an embedded default, on loopback, in a scratch directory.

Two agents (node-a, node-b) share a local-directory store as their tier and know each other
as peers. A small "training run" (float32 weights and Adam state advanced by AdamW-like
steps; half the ranks frozen) saves DCP-shaped checkpoints into node-a's hot directory;
node-a's agent notices each one and pushes it (deduplicated and delta-coded) in the
background. Then a scheduler, about to scale down onto node-b, asks node-b for a migration
estimate and prefetches the latest checkpoint there; the estimate is printed next to the
measured time, and the copy is checked byte for byte. A second round shows a node that holds
the previous checkpoint reusing its unchanged chunks locally; the rest it moves is printed by
source (the peer sends deltas against the chunks node-b holds, as the tier would).
"""

from __future__ import annotations

import asyncio
import filecmp
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from agent.daemon.config import load_config
from agent.node.hotdir import step_dir_name
from agent.rpc.app import create_app
from agent.rpc.client import FerryClient

SHARD_FLOATS = 2 << 20  # 8 MiB of float32 per tensor
FROZEN_SHARDS = 2  # of 4: embeddings and early layers do not change between saves
TOKEN = "demo-token"


class TinyRun:
    """Weights and Adam moments per rank, advanced by AdamW-like steps between saves."""

    def __init__(self, ranks: int = 4, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.weights = [rng.normal(0, 0.02, SHARD_FLOATS).astype(np.float32) for _ in range(ranks)]
        self.exp_avg_sq = [np.full(SHARD_FLOATS, 1e-6, np.float32) for _ in range(ranks)]

    def train(self, steps: int, lr: float = 3e-5) -> None:
        for rank in range(FROZEN_SHARDS, len(self.weights)):
            for _ in range(steps):
                grad = self.rng.normal(0, 1e-3, SHARD_FLOATS).astype(np.float32)
                v = self.exp_avg_sq[rank] = 0.999 * self.exp_avg_sq[rank] + 0.001 * grad * grad
                self.weights[rank] -= (lr * grad / (np.sqrt(v) + 1e-8)).astype(np.float32)

    def save(self, root: Path, step: int) -> Path:
        """A DCP-shaped directory: one shard per rank, then .metadata last (the commit)."""
        ckpt = root / step_dir_name(step)
        ckpt.mkdir(parents=True)
        for rank, (w, v) in enumerate(zip(self.weights, self.exp_avg_sq, strict=True)):
            (ckpt / f"__{rank}_0.distcp").write_bytes(w.tobytes() + v.tobytes())
        (ckpt / ".metadata").write_bytes(f"dcp-metadata step={step}\n".encode())
        return ckpt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _init_store(path: Path) -> None:
    from transfer.engine.catalog import init_store
    from transfer.store import open_store

    store = open_store(str(path))
    try:
        await init_store(store)
    finally:
        await store.close()


async def _start_agent(name: str, hot: Path, store: Path, port: int, peer: int) -> web.AppRunner:
    env = {
        "FERRY_NODE": name,
        "FERRY_HOT_DIR": str(hot),
        "FERRY_TIERS": str(store),
        "FERRY_PEERS": f"http://127.0.0.1:{peer}",
        "FERRY_LISTEN": f"127.0.0.1:{port}",
    }
    runner = web.AppRunner(create_app(load_config(None, env), TOKEN))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _wait_durable(client: FerryClient, step: int) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = (await client._call("GET", "/v1/pushes"))["pushes"]
        for row in rows:
            if row["step"] == step and row["state"] == "durable":
                return dict(row["result"] or {})
            if row["step"] == step and row["state"] == "failed":
                raise RuntimeError(f"push of step {step} failed: {row.get('error')}")
        await asyncio.sleep(0.1)
    raise TimeoutError(f"step {step} was not pushed in time")


def _same(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


async def _scale_down(
    b: FerryClient, step: int | str
) -> tuple[dict[str, Any], dict[str, Any], float]:
    est = await b.estimate("demo", step, gpus=8, gpu_hour_price=2.5)
    began = time.monotonic()
    done = await b.wait_prefetch(await b.prefetch("demo", step), poll=0.02)
    return est, done, time.monotonic() - began


async def run_demo(workdir: Path) -> bool:
    store, hot_a, hot_b = workdir / "store", workdir / "node-a", workdir / "node-b"
    await _init_store(store)  # `ferry init STORE`: agents write only into a store made so
    for hot in (hot_a, hot_b):  # (as a node's disk is there before its agent starts)
        hot.mkdir(parents=True, exist_ok=True)
    port_a, port_b = _free_port(), _free_port()
    runner_a = await _start_agent("node-a", hot_a, store, port_a, port_b)
    runner_b = await _start_agent("node-b", hot_b, store, port_b, port_a)
    ok = True
    try:
        async with (
            FerryClient(f"http://127.0.0.1:{port_a}", TOKEN) as a,
            FerryClient(f"http://127.0.0.1:{port_b}", TOKEN) as b,
        ):
            print(f"ferry demo in {workdir}: agents node-a (:{port_a}) and node-b (:{port_b})")
            print("training on node-a; its agent pushes each save in the background:")
            print(f"{'step':>6} {'raw MB':>8} {'written MB':>11} {'deduped':>8} {'delta':>6}")
            run = TinyRun()
            saves = {}
            for step in (100, 120, 140):
                run.train(4)
                saves[step] = run.save(hot_a / "demo", step)
                r = await _wait_durable(a, step)
                print(
                    f"{step:>6} {r['bytes_raw'] / 1e6:>8.1f} {r['bytes_transferred'] / 1e6:>11.1f} "
                    f"{r['chunks_deduped']:>4}/{r['chunks_total']:<3} {r['chunks_delta']:>6}"
                )
            # (a newcomer read step 140's "delta 0" as a fault)
            print("  deduped: chunks unchanged since an earlier save, not written again;")
            print("  delta: chunks stored as XOR deltas against the save before. A chunk")
            print("  whose chain of deltas a fresh node would pay too much to rebuild is")
            print("  stored whole instead (the keyframe policy: docs/FORMAT.md)")
            print("scheduler: scale down onto node-b (8 GPUs at $2.50/h); estimate, then prefetch:")
            for step in (140, 160):
                if step == 160:
                    run.train(4)
                    saves[step] = run.save(hot_a / "demo", step)
                    await _wait_durable(a, step)
                    print("  training saved step 160; node-b already holds step 140:")
                est, done, seconds = await _scale_down(b, step)
                same = done["state"] == "ready" and _same(saves[step], Path(done["dest"]))
                ok = ok and same
                sources = done["bytes_by_source"].items()
                moved = ", ".join(f"{k.split(':')[0]} {v / 1e6:.1f} MB" for k, v in sources if v)
                # (bytes_missing: the coded bytes to download, deltas and zstd, as "moved")
                print(
                    f"  step {step}: predicted {est['bytes_missing'] / 1e6:.1f} MB to move in "
                    f"{est['seconds']:.2f}s ({est['seconds_low']:.2f}-{est['seconds_high']:.2f}; "
                    f"cost ${est['cost']:.4f}, cooldown "
                    f"{est['cooldown_seconds']:.0f}s); measured {seconds:.2f}s; moved: {moved}; "
                    f"{done['chunks_local']} chunks reused locally; identical: "
                    f"{'yes' if same else 'NO'}"
                )
    finally:
        await runner_b.cleanup()
        await runner_a.cleanup()
    return ok


def main(workdir: Path | None, keep: bool) -> int:
    scratch = workdir or Path(tempfile.mkdtemp(prefix="ferry-demo-"))
    try:
        ok = asyncio.run(run_demo(scratch))
    finally:
        if not keep and workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
            if not scratch.exists():
                print(f"removed {scratch} (ferry demo --workdir DIR keeps everything)")
    return 0 if ok else 1
