"""zstd level 1 as shipped against the writer's tuned level 1 (encodings.LEVEL1_PARAMS), and
levels 3 and 9 (do higher levels pay on planes?), on byte planes of real checkpoint chunks:
keyframes (planes of the save) and deltas (planes of the save XOR its base). Size, encode
and decode speed, one thread, rounds alternated.

    python -m bench.zstd_params [--corpus /work/corpus] [--variant full] [--rounds 5]

Reads 64 MiB of two shards of ``step_000040`` and ``step_000020`` of the variant. Prints
one Markdown row per (candidate, kind): share of raw, and the min-median-max MB/s of raw
bytes over the rounds (the machine is shared: read the spread, not one number).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import zstandard

from transfer.codec._planes import split
from transfer.codec.encodings import make_compressor

CHUNK = 4 << 20
SHARDS = ("__1_0.distcp", "__6_0.distcp")


def planes(corpus: Path, variant: str, width: int) -> dict[str, list[bytes]]:
    """Byte planes of each 4 MiB chunk: of the save (keyframe) and of save XOR base (delta)."""
    kinds: dict[str, list[bytes]] = {"keyframe": [], "delta": []}
    for shard in SHARDS:
        new = (corpus / variant / "step_000040" / shard).read_bytes()[: 64 << 20]
        old = (corpus / variant / "step_000020" / shard).read_bytes()[: 64 << 20]
        for at in range(0, len(new) - CHUNK + 1, CHUNK):
            piece, base = memoryview(new)[at : at + CHUNK], memoryview(old)[at : at + CHUNK]
            for kind, against in (("keyframe", None), ("delta", base)):
                out = bytearray(CHUNK)
                split(piece, against, out, width)
                kinds[kind].append(bytes(out))
    return kinds


def measure(
    cctx: zstandard.ZstdCompressor, dctx: zstandard.ZstdDecompressor, chunks: list[bytes]
) -> tuple[float, float, int]:
    """(encode seconds, decode seconds, stored bytes) of ``chunks``, one frame each."""
    began = time.perf_counter()
    packed = [cctx.compress(x) for x in chunks]
    encoded = time.perf_counter()
    for frame in packed:
        dctx.decompress(frame)
    return encoded - began, time.perf_counter() - encoded, sum(map(len, packed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("/work/corpus"))
    ap.add_argument("--variant", default="full")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    width = 2 if args.variant == "bf16" else 4
    kinds = planes(args.corpus, args.variant, width)
    candidates = {
        "zstd level 1": zstandard.ZstdCompressor(level=1, write_content_size=True),
        "tuned level 1": make_compressor(1),
        # does a higher level pay on the planes? (issue 14: tighter deltas)
        "zstd level 3": zstandard.ZstdCompressor(level=3, write_content_size=True),
        "zstd level 9": zstandard.ZstdCompressor(level=9, write_content_size=True),
    }
    dctx = zstandard.ZstdDecompressor()
    speeds: dict[tuple[str, str], list[tuple[float, float]]] = {}
    shares: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, cctx in candidates.items():
            for kind, chunks in kinds.items():
                raw = CHUNK * len(chunks)
                enc, dec, stored = measure(cctx, dctx, chunks)
                speeds.setdefault((name, kind), []).append((raw / enc / 1e6, raw / dec / 1e6))
                shares[(name, kind)] = stored / raw

    def spread(values: list[float]) -> str:
        return f"{min(values):,.0f} / {statistics.median(values):,.0f} / {max(values):,.0f}"

    print(f"{args.variant}, planes of width {width}, {args.rounds} rounds, one thread\n")
    print("| compressor | chunks | stored / raw | encode MB/s | decode MB/s |")
    print("|---|---|---|---|---|")
    for (name, kind), rows in speeds.items():
        enc = spread([e for e, _ in rows])
        dec = spread([d for _, d in rows])
        print(f"| {name} | {kind} | {shares[(name, kind)]:.4f} | {enc} | {dec} |")


if __name__ == "__main__":
    main()
