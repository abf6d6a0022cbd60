"""What a delta of real training costs, plane by plane: is there anything left to squeeze?

    python -m bench.plane_entropy [CORPUS_VARIANT_DIR] [--mib 64]

Takes the two oldest saves of a variant (default /work/corpus/full) and XORs one shard of
the newer with the older (what ``xor+bp4+zstd`` codes). For each byte plane of the float32
(or bf16) elements, cut at the chunk's start as the codec does: its order-0 entropy and its
zstd size at levels 1, 3, 9 and 19 with each level's speed. Then the whole shard coded with
planes cut at the chunk's start against planes cut at each DCP item's own start (the
``.metadata``'s storage offsets: tensors start at arbitrary file offsets), and each plane's
ratio with that cut, to see whether misaligned planes cost anything. Last, what a context
model could reach at best: each item-aligned plane's entropy given the base's byte in the
same plane, and given that and the delta's byte in the plane above (the code length of the
second half of the elements with the first half's counts, add-half smoothed: a bound on a
coder that adapts, not a figure a table fitted to the data it codes would flatter).
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import numpy as np
import zstandard

from transfer.format.names import step_from_dirname

CHUNK = 4 << 20


def saves(variant: Path) -> tuple[Path, Path]:
    found = sorted(
        (d for d in variant.iterdir() if step_from_dirname(d.name) is not None),
        key=lambda d: step_from_dirname(d.name) or 0,
    )
    return found[0], found[1]


def entropy(plane: np.ndarray) -> float:
    counts = np.bincount(plane, minlength=256) / len(plane)
    nz = counts[counts > 0]
    return float(-(nz * np.log2(nz)).sum() / 8)


def per_plane(xor: np.ndarray, width: int) -> list[str]:
    n = len(xor) // width * width
    planes = xor[:n].reshape(-1, width).T.copy()
    rows = []
    for k in range(width):
        raw = planes[k].tobytes()
        cells = [f"plane {k} (byte {k} of each element)", f"{entropy(planes[k]):.3f}"]
        for level in (1, 3, 9, 19):
            began = time.perf_counter()
            size = len(zstandard.ZstdCompressor(level=level).compress(raw))
            took = time.perf_counter() - began
            cells.append(f"{size / len(raw):.3f} @ {len(raw) / took / 1e6:,.0f} MB/s")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def aligned_vs_chunked(
    old: Path, new: Path, name: str, width: int
) -> tuple[float, float, list[float]]:
    """zstd-1 size / raw of the XOR with planes per 4 MiB chunk, and per DCP item; and
    each plane's own ratio with the item-aligned cut (sign/exponent in the last plane)."""
    xor = np.fromfile(old / name, dtype=np.uint8) ^ np.fromfile(new / name, dtype=np.uint8)
    cctx = zstandard.ZstdCompressor(level=1)
    chunked = 0
    for at in range(0, len(xor), CHUNK):
        part = xor[at : at + CHUNK]
        n = len(part) // width * width
        chunked += len(cctx.compress(part[:n].reshape(-1, width).T.tobytes())) + len(part) - n
    # the .metadata is torch's pickle; torch must be installed to read it (bench only)
    meta = pickle.loads((new / ".metadata").read_bytes())
    items = sorted(
        (v.offset, v.length) for v in meta.storage_data.values() if v.relative_path == name
    )
    planes: list[list[np.ndarray]] = [[] for _ in range(width)]
    rest = 0
    for offset, length in items:
        n = length // width * width
        elems = xor[offset : offset + n].reshape(-1, width)
        for k in range(width):
            planes[k].append(elems[:, k])
        rest += length - n
    joined = [np.concatenate(p).tobytes() for p in planes]
    sizes = [len(cctx.compress(p)) for p in joined]
    ratios = [size / max(len(p), 1) for size, p in zip(sizes, joined, strict=True)]
    return chunked / len(xor), (rest + sum(sizes)) / len(xor), ratios


def _held_out_bits(context: np.ndarray, symbol: np.ndarray, contexts: int) -> float:
    """Bits per symbol coding the second half with the first half's counts per context."""
    half = len(symbol) // 2
    counts = np.zeros((contexts, 256))
    np.add.at(counts, (context[:half], symbol[:half]), 1)
    probs = (counts + 0.5) / (counts.sum(axis=1, keepdims=True) + 128)
    return float(-np.log2(probs[context[half:], symbol[half:]]).mean())


def context_bounds(old: Path, new: Path, name: str, width: int, limit: int) -> list[str]:
    """Per item-aligned plane of the first ``limit`` bytes of items: order-0, given the
    base's byte, given that and the delta's byte above, as fractions of the plane."""
    meta = pickle.loads((new / ".metadata").read_bytes())
    items = sorted(
        (v.offset, v.length) for v in meta.storage_data.values() if v.relative_path == name
    )
    a = np.fromfile(old / name, dtype=np.uint8)
    b = np.fromfile(new / name, dtype=np.uint8)
    base_parts: list[np.ndarray] = []
    xor_parts: list[np.ndarray] = []
    taken = 0
    for offset, length in items:
        n = min(length, limit - taken) // width * width
        if n <= 0:
            break
        base_parts.append(a[offset : offset + n].reshape(-1, width))
        xor_parts.append((a[offset : offset + n] ^ b[offset : offset + n]).reshape(-1, width))
        taken += n
    base, xor = np.concatenate(base_parts), np.concatenate(xor_parts)
    zeros = np.zeros(len(xor), dtype=np.int64)
    rows, totals = [], np.zeros(3)
    for k in range(width):
        above = xor[:, k + 1].astype(np.int64) if k + 1 < width else zeros
        here = base[:, k].astype(np.int64)
        bits = (
            _held_out_bits(zeros, xor[:, k], 1),
            _held_out_bits(here, xor[:, k], 256),
            _held_out_bits(here * 256 + above, xor[:, k], 65536),
        )
        totals += bits
        rows.append(f"| plane {k} | " + " | ".join(f"{x / 8:.3f}" for x in bits) + " |")
    rows.append("| all | " + " | ".join(f"**{x / 8 / width:.3f}**" for x in totals) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variant", nargs="?", type=Path, default=Path("/work/corpus/full"))
    ap.add_argument("--mib", type=int, default=64, help="MiB of the shard to look at")
    ap.add_argument("--width", type=int, default=4, help="element bytes: 4 fp32, 2 bf16")
    args = ap.parse_args(argv)
    old, new = saves(args.variant)
    name = "__0_0.distcp"
    n = args.mib << 20
    xor = np.fromfile(old / name, dtype=np.uint8, count=n) ^ np.fromfile(
        new / name, dtype=np.uint8, count=n
    )
    print(f"command: python -m bench.plane_entropy {args.variant} --mib {args.mib}")
    print(f"{new.name} XOR {old.name}, {name}, first {args.mib} MiB, element width {args.width}")
    print("| plane | order-0 entropy | zstd-1 | zstd-3 | zstd-9 | zstd-19 |")
    print("|---|---|---|---|---|---|")
    print("\n".join(per_plane(xor, args.width)))
    chunked, aligned, ratios = aligned_vs_chunked(old, new, name, args.width)
    print(
        f"\nwhole shard, zstd-1 / raw: planes per 4 MiB chunk {chunked:.4f}, planes per DCP "
        f"item (each tensor's own element boundaries) {aligned:.4f}; per plane, item-aligned"
        f" (byte 0 = lowest mantissa byte): {', '.join(f'{r:.3f}' for r in ratios)}"
    )
    print("\nwhat a context model could reach (held-out code length / raw, item-aligned):")
    print("| plane | order-0 | given the base's byte | given it and the delta's byte above |")
    print("|---|---|---|---|")
    print("\n".join(context_bounds(old, new, name, args.width, n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
