"""Delta coding on a real checkpoint series: bytes written per save, codec throughput, and
what a pull onto a node holding the previous save downloads.

    python -m bench.delta_ratio SERIES_DIR [SERIES_DIR ...] [--json OUT.json]

SERIES_DIR holds step_*/ directories from bench/gen_checkpoints.py (torch or synthetic).
For each series, every save k+1 is pushed with save k already in a local-directory store
(base bytes from the sibling directory, as on a training node). Columns:

- raw MB: size of save k+1;
- zstd-3: each file of save k+1 compressed whole with zstd level 3 (what generic tools get);
- ours: bytes the push of k+1 wrote (packs + manifest), and raw/ours;
- encode / decode MB/s: the codec alone on every chunk of k+1 against k (2 threads, this
  machine), then the whole push and pull wall time (hashing, I/O, store) for context;
- pull bytes: what a pull of k+1 with --base-dir k downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zstandard

from transfer.codec import decode, encode
from transfer.engine import PullPlan, Sources, TransferOptions, pull, push
from transfer.format.names import step_from_dirname
from transfer.store.local import LocalStore

CHUNK = TransferOptions().chunk_size


def zstd3_size(ckpt: Path) -> int:
    cctx = zstandard.ZstdCompressor(level=3, threads=2)
    return sum(len(cctx.compress(p.read_bytes())) for p in sorted(ckpt.rglob("*")) if p.is_file())


def chunk_pairs(new: Path, base: Path) -> list[tuple[bytes, bytes | None]]:
    pairs = []
    for p in sorted(new.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        old_path = base / p.relative_to(new)
        old = old_path.read_bytes() if old_path.exists() else b""
        for off in range(0, len(data), CHUNK):
            chunk, prev = data[off : off + CHUNK], old[off : off + CHUNK]
            if chunk != prev:  # identical chunks are deduplicated, never encoded
                pairs.append((chunk, prev or None))
    return pairs


def codec_speed(pairs: list[tuple[bytes, bytes | None]]) -> tuple[float, float]:
    """(encode MB/s, decode MB/s) of the changed chunks, 2 threads."""
    total = sum(len(c) for c, _ in pairs) or 1
    with ThreadPoolExecutor(2) as pool:
        began = time.perf_counter()
        encoded = list(pool.map(lambda cb: encode(cb[0], 1, cb[1]), pairs))
        enc_s = time.perf_counter() - began
        began = time.perf_counter()
        list(
            pool.map(
                lambda args: decode(args[0][0], args[0][1], len(args[1][0]), args[1][1]),
                zip(encoded, pairs, strict=True),
            )
        )
        dec_s = time.perf_counter() - began
    return total / enc_s / 1e6, total / dec_s / 1e6


def step_dirs(series: Path) -> list[Path]:
    found = [d for d in series.iterdir() if d.is_dir() and step_from_dirname(d.name) is not None]
    return sorted(found, key=lambda d: step_from_dirname(d.name) or 0)


async def measure(series: Path, work: Path) -> list[dict[str, object]]:
    steps = step_dirs(series)
    store_dir = work / "store"
    store_dir.mkdir()
    store = LocalStore(store_dir)
    hot = work / "hot"
    rows: list[dict[str, object]] = []
    prev: Path | None = None
    for d in steps:
        local = hot / d.name
        shutil.copytree(d, local)
        step = step_from_dirname(d.name) or 0
        r = await push(store, local, job="bench", step=step, node="n")
        if prev is not None:
            pairs = chunk_pairs(local, prev)
            enc_mbs, dec_mbs = codec_speed(pairs)
            node2 = work / f"node2-{step}"
            p = await pull(store, node2, PullPlan("bench", step), Sources(base_dir=prev))
            shutil.rmtree(node2)
            z3 = zstd3_size(local)
            rows.append(
                {
                    "series": series.name,
                    "step": step,
                    "raw_mb": r.bytes_raw / 1e6,
                    "zstd3_ratio": r.bytes_raw / z3,
                    "ours_mb": r.bytes_transferred / 1e6,
                    "ours_fraction": r.bytes_transferred / r.bytes_raw,
                    "ours_ratio": r.bytes_raw / max(r.bytes_transferred, 1),
                    "chunks_deduped": r.chunks_deduped,
                    "chunks_delta": r.chunks_delta,
                    "chunks_raw": r.chunks_raw,
                    "codec_encode_mbs": enc_mbs,
                    "codec_decode_mbs": dec_mbs,
                    "push_mbs": r.bytes_raw / r.seconds / 1e6,
                    "pull_mbs": p.bytes_raw / p.seconds / 1e6,
                    "pull_downloaded_mb": p.bytes_transferred / 1e6,
                }
            )
            shutil.rmtree(prev)
        prev = local
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("series", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shown = sys.argv[1:] if argv is None else argv
    print("command: python -m bench.delta_ratio " + " ".join(shown))
    all_rows = []
    header = (
        "| series | step | raw MB | zstd-3 | ours MB | ours/raw | raw/ours | dedup/delta/raw "
        "chunks | encode MB/s | decode MB/s | push MB/s | pull MB/s | pull downloaded MB |"
    )
    print(header)
    print("|" + "---|" * 14)
    for series in args.series:
        with tempfile.TemporaryDirectory(prefix="ferry-delta-") as tmp:
            rows = asyncio.run(measure(series, Path(tmp)))
        for r in rows:
            print(
                f"| {r['series']} | {r['step']} | {r['raw_mb']:.1f} | {r['zstd3_ratio']:.2f}x | "
                f"{r['ours_mb']:.1f} | {r['ours_fraction']:.1%} | {r['ours_ratio']:.2f}x | "
                f"{r['chunks_deduped']}/{r['chunks_delta']}/{r['chunks_raw']} | "
                f"{r['codec_encode_mbs']:.0f} | {r['codec_decode_mbs']:.0f} | "
                f"{r['push_mbs']:.0f} | {r['pull_mbs']:.0f} | {r['pull_downloaded_mb']:.1f} |"
            )
        all_rows.extend(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(all_rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
