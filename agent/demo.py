"""``ferry demo``: the whole flow on an embedded default, in a scratch directory.

Writes three DCP-shaped checkpoints of a small "training run" (float32 weights and Adam
moments; some layers frozen, so successive saves share most chunks), pushes each to a
local-directory store, pulls the latest into a fresh directory, checks it byte for byte,
and prints what moved.
"""

from __future__ import annotations

import asyncio
import filecmp
import random
import shutil
import tempfile
from array import array
from pathlib import Path

from transfer.engine import TransferOptions, pull, push
from transfer.store.local import LocalStore

SHARD_FLOATS = 2 << 20  # 8 MiB of float32 per shard
FROZEN_SHARDS = 2  # of 4: embeddings and early layers do not change between saves


def _floats(rng: random.Random, n: int, scale: float) -> bytes:
    return array("f", (rng.gauss(0.0, scale) for _ in range(n))).tobytes()


def write_checkpoint(root: Path, step: int) -> Path:
    """A DCP-shaped directory: 4 shards + .metadata; trained shards change every save."""
    ckpt = root / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    for rank in range(4):
        trained = rank >= FROZEN_SHARDS
        rng = random.Random(rank * 1000 + (step if trained else 0))
        (ckpt / f"__{rank}_0.distcp").write_bytes(_floats(rng, SHARD_FLOATS, 0.02))
    (ckpt / ".metadata").write_bytes(f"dcp-metadata step={step}\n".encode())
    return ckpt


async def run_demo(workdir: Path) -> None:
    store_dir = workdir / "store"
    store_dir.mkdir(parents=True)
    store = LocalStore(store_dir)
    options = TransferOptions(chunk_size=4 << 20)
    print(f"ferry demo in {workdir}")
    print(f"{'step':>6} {'raw MB':>8} {'written MB':>11} {'deduped':>8} {'seconds':>8}")
    last = None
    for step in (100, 200, 300):
        last = write_checkpoint(workdir / "hot", step)
        r = await push(store, last, job="demo", step=step, node="node-a", options=options)
        print(
            f"{step:>6} {r.bytes_raw / 1e6:>8.1f} {r.bytes_transferred / 1e6:>11.1f} "
            f"{r.chunks_deduped:>4}/{r.chunks_total:<3} {r.seconds:>8.2f}"
        )
    dest = workdir / "restored" / "step_000300"
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
