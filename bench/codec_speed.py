"""Codec speed on real checkpoint chunks: decode (into a reused buffer when the codec can)
and encode of one 4 MiB chunk of save k+1 against the same position of save k, one thread,
CPU seconds. Compare two versions by running it with each on PYTHONPATH::

    python -m bench.codec_speed /work/corpus/full
    git worktree add /tmp/old 687589a
    PYTHONPATH=/tmp/old python bench/codec_speed.py /work/corpus/full
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

from transfer.codec import decode, encode

N = 4 << 20


def rate(fn: object, reps: int) -> float:
    began = time.process_time()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    return N * reps / (time.process_time() - began) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("series", type=Path, help="a corpus variant dir (step_000020, step_000040)")
    ap.add_argument("--file", default="__3_0.distcp")
    ap.add_argument("--offset-mib", type=int, default=100)
    args = ap.parse_args()
    off = args.offset_mib << 20
    chunks = []
    for step in (20, 40):
        with open(args.series / f"step_{step:06d}" / args.file, "rb") as f:
            f.seek(off)
            chunks.append(f.read(N))
    base, new = chunks
    into = "out" in inspect.signature(decode).parameters
    out = memoryview(bytearray(N))
    for label, data, ref in (("keyframe", base, None), ("delta", new, base)):
        enc, payload = encode(data, 1, ref)
        kw = {"out": out} if into else {}
        dec = rate(lambda: decode(enc, payload, N, ref, **kw), 20)  # noqa: B023
        enc_rate = rate(lambda: encode(data, 1, ref), 5)  # noqa: B023
        print(
            f"{label:8s} {enc:14s} stored {len(payload) / N:5.1%}  "
            f"decode {dec:5.2f} GB/s  encode {enc_rate:5.3f} GB/s (CPU, one thread)"
        )


if __name__ == "__main__":
    main()
