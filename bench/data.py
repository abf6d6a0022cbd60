"""Benchmark data: the real DCP series, and large checkpoints scaled up from a real-like pair.

- ``series(...)``: ``bench.gen_checkpoints`` saves k and k+1 (``--mode torch``: a real model
  fine-tuned with AdamW and saved with torch DCP; ``--mode synthetic``: numpy, the same
  statistics, see its docstring), generated once into a cache directory and reused.
- ``scale_up(...)``: a checkpoint of any size made from one save of a synthetic series:
  ``copies`` copies of its tensor file spread over ``shards`` DCP-style shard files, copy i
  multiplied by 2**(i - copies // 2). Scaling a float32 by a power of two changes only its
  exponent bits, exactly, so every copy keeps the save's byte statistics (zstd ratio, and the
  XOR delta against copy i of the previous save, which was scaled the same way) while no
  chunk of one copy equals a chunk of another (no dedupe across copies that a real
  checkpoint would not have).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BLOCK = 32 << 20  # bytes scaled and written at a time (memory stays small)


def series(cache: Path, mode: str, variant: str, size_mb: float) -> tuple[Path, Path]:
    """(save k, save k+1) of a generated series, generated unless already in ``cache``."""
    out = cache / f"{mode}-{variant}-{size_mb:g}mb"
    saves = [out / "step_000020", out / "step_000040"]
    if not all((s / ".metadata").exists() for s in saves):
        argv = [sys.executable, "-m", "bench.gen_checkpoints", str(out), "--mode", mode]
        argv += ["--variant", variant, "--saves", "2", "--size-mb", str(size_mb), "--overwrite"]
        subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return saves[0], saves[1]


def scale_up(save: Path, dest: Path, copies: int, shards: int = 4) -> Path:
    """A DCP-shaped checkpoint of ``copies`` scaled copies of ``save``'s tensor file."""
    src = save / "__0_0.distcp"
    size = src.stat().st_size
    whole = size - size % 4
    dest.mkdir(parents=True)
    per_shard = -(-copies // shards)
    with src.open("rb") as fh:
        for shard in range(shards):
            mine = range(shard * per_shard, min(copies, (shard + 1) * per_shard))
            if not mine:
                break
            with (dest / f"__{shard}_0.distcp").open("wb") as out:
                for i in mine:
                    factor = np.float32(2.0 ** (i - copies // 2))
                    for lo in range(0, size, BLOCK):
                        fh.seek(lo)
                        block = bytearray(fh.read(min(BLOCK, size - lo)))
                        n = min(len(block), max(0, whole - lo)) // 4 * 4
                        if factor != 1 and n:
                            floats = np.frombuffer(block, np.float32, n // 4)
                            floats *= factor
                        out.write(block)
    meta = (save / ".metadata").read_bytes()
    (dest / ".metadata").write_bytes(meta + f"\n# scaled: {copies} copies\n".encode())
    return dest


def scaled_pair(k: Path, k1: Path, root: Path, copies: int) -> tuple[Path, Path]:
    """Saves k and k+1 scaled up the same way (so k+1 delta-codes against k as the real
    pair does), cached under ``root``."""
    out = root / f"{k.parent.name}-x{copies}"
    pair = (out / k.name, out / k1.name)
    if not all((p / ".metadata").exists() for p in pair):
        for src, dst in zip((k, k1), pair, strict=True):
            if dst.exists():
                subprocess.run(["rm", "-rf", str(dst)], check=True)
            scale_up(src, dst, copies)
    return pair


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def link_tree(src: Path, dst: Path) -> None:
    """A hard-linked copy (instant, no extra disk): agents only read these files."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    os.sync()
