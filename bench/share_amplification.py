"""What a survivor's share of a real DCP save costs in whole chunks: the bytes a pull of the
share fetches and decodes, against the bytes the share's ranks read.

    python -m bench.share_amplification [STEP_DIR] [--worlds 8,4,2,16] [--chunk-kib 4096,1024]

STEP_DIR is a DCP save (default: the newest save of /work/corpus/full, the real-training
corpus of ``python -m bench.corpus``). From its ``.metadata`` alone (no store, no torch),
for each new world size W and every new rank of it: the share (``dcpshare.layout_ranges``:
what that rank's ``dcp.load`` reads), and, at each chunk size, the chunks that share
overlaps (a pull fetches and decodes a chunk whole: its payload is one zstd frame of byte
planes) and the storage files it touches (the parts whose manifests it reads). The
amplification is the chunks' bytes over the share's bytes, summed over the new ranks.
The first column is the push's own cut (transfer/engine/chunkspans.py: at the items, found
in the storage files themselves, 4 MiB at most), with the chunks it makes.

Why: DCP's save planner spreads the items every rank reads (optimizer step counters,
param_groups, replicated tensors) over every rank's file, a few KB each, so a survivor's
share reaches into every file for a few KB and fetches a whole chunk for each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transfer.engine.chunkspans import Span, chunk_spans
from transfer.engine.dcp import METADATA, required_lengths
from transfer.engine.dcpshare import Layout, Ranges, layout_ranges, parse_metadata, share_bytes
from transfer.format.names import step_from_dirname

DEFAULT_VARIANT = Path("/work/corpus/full")


def newest_save(variant: Path) -> Path:
    found = [d for d in variant.iterdir() if step_from_dirname(d.name) is not None]
    return max(found, key=lambda d: step_from_dirname(d.name) or 0)


def chunk_bytes(ranges: Ranges, sizes: dict[str, int], chunk: int) -> int:
    """Bytes of the fixed-offset chunks of ``chunk`` bytes that ``ranges`` overlap."""
    touched = {
        (path, i) for path, spans in ranges.items() for a, b in spans
        for i in range(a // chunk, (b - 1) // chunk + 1)
    }  # fmt: skip
    return sum(min(chunk, sizes[path] - i * chunk) for path, i in touched)


def cut_bytes(ranges: Ranges, cut: dict[str, list[Span]]) -> int:
    """Bytes of the chunks of ``cut`` (per file: offset, length) that ``ranges`` overlap."""
    total = 0
    for path, spans in ranges.items():
        total += sum(n for o, n in cut[path] if any(a < o + n and o < b for a, b in spans))
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("step_dir", nargs="?", type=Path)
    ap.add_argument("--worlds", default="8,4,2,16", help="new world sizes")
    ap.add_argument("--chunk-kib", default="4096,1024,256,64", help="chunk sizes to compare")
    args = ap.parse_args(argv)
    step_dir = args.step_dir or newest_save(DEFAULT_VARIANT)
    metadata = (step_dir / METADATA).read_bytes()
    parsed, sizes = parse_metadata(metadata), required_lengths(metadata) or {}
    chunks = [int(k) << 10 for k in args.chunk_kib.split(",")]
    cut = {path: chunk_spans(step_dir / path, size, 4 << 20) for path, size in sizes.items()}
    made = sum(len(c) for c in cut.values())
    fixed = sum(-(-size // (4 << 20)) for size in sizes.values())
    print(f"{step_dir}: {len(sizes)} storage files, {sum(sizes.values()) / 1e6:,.0f} MB; "
          f"the push's cut: {made:,} chunks (fixed 4 MiB: {fixed:,})\n")  # fmt: skip
    head = " | ".join(f"{c >> 10} KiB chunks" for c in chunks)
    print(f"| new world | share per rank | files touched per rank | the push's cut | {head} |")
    print("|---|---|---|---|" + "---|" * len(chunks))
    for world in (int(w) for w in args.worlds.split(",")):
        shares = [layout_ranges(parsed, Layout(world, (r,))) for r in range(world)]
        total = sum(share_bytes(s) for s in shares)
        fetched = [sum(cut_bytes(s, cut) for s in shares)]
        fetched += [sum(chunk_bytes(s, sizes, c) for s in shares) for c in chunks]
        touched = sorted(len(s) for s in shares)
        cells = " | ".join(f"{f / total:.2f}x ({f / world / 1e6:,.0f} MB)" for f in fetched)
        print(
            f"| {world} | {total / world / 1e6:,.1f} MB | {touched[0]}-{touched[-1]} of "
            f"{len(sizes)} | {cells} |"
        )


if __name__ == "__main__":
    main()
