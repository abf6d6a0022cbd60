"""``ferry demo``: the whole flow on an embedded default, in a scratch directory.

Writes three DCP-shaped checkpoints of a small "training run" (float32 weights and Adam
state advanced by AdamW-like steps; half the ranks frozen, so successive saves share their
chunks and the rest delta-code against the previous save), pushes each to a local-directory
store, pulls the latest into a fresh directory, checks it byte for byte, and prints what
moved.
"""

from __future__ import annotations

import asyncio
import filecmp
import shutil
import tempfile
from pathlib import Path

import numpy as np

from transfer.engine import TransferOptions, pull, push
from transfer.store.local import LocalStore

SHARD_FLOATS = 2 << 20  # 8 MiB of float32 per tensor
FROZEN_SHARDS = 2  # of 4: embeddings and early layers do not change between saves


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
        """A DCP-shaped directory: one shard per rank (weights + Adam state) + .metadata."""
        ckpt = root / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        for rank, (w, v) in enumerate(zip(self.weights, self.exp_avg_sq, strict=True)):
            (ckpt / f"__{rank}_0.distcp").write_bytes(w.tobytes() + v.tobytes())
        (ckpt / ".metadata").write_bytes(f"dcp-metadata step={step}\n".encode())
        return ckpt


async def run_demo(workdir: Path) -> None:
    store_dir = workdir / "store"
    store_dir.mkdir(parents=True)
    store = LocalStore(store_dir)
    options = TransferOptions(chunk_size=4 << 20)
    print(f"ferry demo in {workdir}")
    print(
        f"{'step':>6} {'raw MB':>8} {'written MB':>11} {'deduped':>8} {'delta':>6} {'seconds':>8}"
    )
    last = None
    run = TinyRun()
    for step in (100, 120, 140):
        run.train(4)
        last = run.save(workdir / "hot", step)
        r = await push(store, last, job="demo", step=step, node="node-a", options=options)
        print(
            f"{step:>6} {r.bytes_raw / 1e6:>8.1f} {r.bytes_transferred / 1e6:>11.1f} "
            f"{r.chunks_deduped:>4}/{r.chunks_total:<3} {r.chunks_delta:>6} {r.seconds:>8.2f}"
        )
    dest = workdir / "restored" / "step_000140"
    p = await pull(store, dest, job="demo", step=None, options=options)
    assert last is not None
    same = not filecmp.dircmp(last, dest).diff_files and sorted(
        f.name for f in last.iterdir()
    ) == sorted(f.name for f in dest.iterdir())
    stored = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file())
    print(
        f"pulled latest (step {p.step}) into {dest}: {p.bytes_raw / 1e6:.1f} MB, read "
        f"{p.bytes_transferred / 1e6:.1f} MB in {p.seconds:.2f}s, every chunk verified; "
        f"identical to the original: {'yes' if same else 'NO'}"
    )
    near = await pull(
        store,
        workdir / "node-b" / "step_000140",
        job="demo",
        step=None,
        options=options,
        base_dir=workdir / "hot" / "step_000120",
    )
    print(
        f"pulled it again onto a node that holds step 120: read {near.bytes_transferred / 1e6:.1f}"
        f" MB ({near.chunks_local} chunks reused from the local copy) in {near.seconds:.2f}s"
    )
    print(f"store holds {stored / 1e6:.1f} MB for 3 checkpoints of {p.bytes_raw / 1e6:.1f} MB each")
    if not same:
        raise SystemExit(1)


def main(workdir: Path | None, keep: bool) -> int:
    scratch = workdir or Path(tempfile.mkdtemp(prefix="ferry-demo-"))
    try:
        asyncio.run(run_demo(scratch))
    finally:
        if not keep and workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0
