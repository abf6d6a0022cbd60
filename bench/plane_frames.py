"""One zstd frame per chunk (today's ``bp4+zstd``) against one frame per byte plane: size
and speed, on real checkpoint chunks (a candidate encoding, not used by the writer yet).

    python -m bench.plane_frames [SAVE_DIR] [--base BASE_DIR] [--every 7]

SAVE_DIR: a DCP save (default /work/corpus/full/step_000020); with ``--base``, each chunk
is XORed with the base's chunk at the same offset first (a delta). Every ``--every``-th
4 MiB chunk of the first shard is split into its 4 byte planes and compressed at zstd
level 1 both ways, one thread; prints the stored share of raw and MB/s of raw bytes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import zstandard

CHUNK = 4 << 20


def planes(x: np.ndarray) -> list[bytes]:
    return [p.tobytes() for p in x.reshape(-1, 4).T]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("save", type=Path, nargs="?", default=Path("/work/corpus/full/step_000020"))
    ap.add_argument("--base", type=Path)
    ap.add_argument("--every", type=int, default=7)
    args = ap.parse_args()
    shard = sorted(args.save.glob("__*.distcp"))[0]
    data = np.fromfile(shard, dtype=np.uint8)
    if args.base is not None:
        data = data ^ np.fromfile(args.base / shard.name, dtype=np.uint8)
    chunks = [
        planes(data[o : o + CHUNK]) for o in range(0, len(data) - CHUNK + 1, CHUNK * args.every)
    ]
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    raw = CHUNK * len(chunks)
    rows = []
    for name, frames_of in (
        ("one frame per chunk", lambda ps: [b"".join(ps)]),
        ("one frame per plane", lambda ps: ps),
    ):
        inputs = [frames_of(ps) for ps in chunks]
        began = time.perf_counter()
        packed = [[cctx.compress(f) for f in frames] for frames in inputs]
        encode = time.perf_counter() - began
        began = time.perf_counter()
        for frames in packed:
            for f in frames:
                dctx.decompress(f)
        decode = time.perf_counter() - began
        stored = sum(len(f) for frames in packed for f in frames)
        speeds = f"{raw / encode / 1e6:,.0f} | {raw / decode / 1e6:,.0f}"
        rows.append(f"| {name} | {stored / raw:.4f} | {speeds} |")
    what = f"{args.save} XOR {args.base}" if args.base else str(args.save)
    print(f"`python -m bench.plane_frames` on {what}: {len(chunks)} chunks of {shard.name}\n")
    print("| zstd-1 over bp4 planes | stored / raw | encode MB/s | decode MB/s |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
