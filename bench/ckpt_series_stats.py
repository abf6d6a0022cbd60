"""How delta-friendly a checkpoint series is: the numbers that say whether test data is realistic.

For each pair of consecutive saves (k, k+1) of a series written by ``bench.gen_checkpoints``
(or any dirs of same-layout files), over all files present in both saves:

* identical: fraction of aligned 1 MiB chunks of save k+1 that are byte-identical to save k
  (what whole-chunk dedupe gets);
* zstd-3: compression ratio of save k+1 alone at zstd level 3 (no delta);
* xor+shuf: ratio of zstd -1 on (k XOR k+1) after a byte-plane shuffle (4 planes for fp32,
  2 for bf16), which puts the unchanged sign/exponent bytes together;
* xor: the same without the shuffle.

Ratios are total bytes of save k+1 over total compressed bytes. The shuffle runs over the
whole file: in real DCP files each tensor sits in its own torch.save zip record at any offset
mod 4, so its planes are rotated; shuffling each tensor in its own alignment gained only ~1%
on the torch series. Usage::

    python -m bench.ckpt_series_stats /tmp/ferry-series/*-*          # planes guessed
    python -m bench.ckpt_series_stats DIR --planes 2

Real fine-tuning measured before on a similar setup: zstd alone ~1.1-1.6x, xor+shuf ~2.3x
(full), ~3.7x (most layers frozen) with ~62% identical chunks.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import zstandard

CHUNK = 1 << 20


@dataclasses.dataclass
class PairStats:
    """Byte totals for one (k, k+1) pair; ratios are derived so pairs can be summed."""

    nbytes: int = 0
    chunks: int = 0
    same_chunks: int = 0
    zstd3: int = 0
    xor_shuf: int = 0
    xor_plain: int = 0

    def add(self, other: PairStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def row(self) -> dict[str, float]:
        return {
            "identical": self.same_chunks / max(1, self.chunks),
            "zstd3": self.nbytes / max(1, self.zstd3),
            "xor_shuf_zstd1": self.nbytes / max(1, self.xor_shuf),
            "xor_zstd1": self.nbytes / max(1, self.xor_plain),
        }


def byte_planes(buf: np.ndarray, planes: int) -> bytes:
    """Byte i of every element into plane i (the file is padded to whole elements)."""
    pad = -len(buf) % planes
    if pad:
        buf = np.concatenate([buf, np.zeros(pad, np.uint8)])
    return buf.reshape(-1, planes).T.tobytes()


def compare_files(old: Path, new: Path, planes: int) -> PairStats:
    a = np.fromfile(old, np.uint8)
    b = np.fromfile(new, np.uint8)
    st = PairStats(nbytes=len(b))
    st.chunks = -(-len(b) // CHUNK)
    st.same_chunks = sum(
        1
        for off in range(0, len(b), CHUNK)
        if np.array_equal(a[off : off + CHUNK], b[off : off + CHUNK])
    )
    st.zstd3 = len(zstandard.ZstdCompressor(level=3).compress(b.tobytes()))
    if len(a) == len(b):
        x = a ^ b
        z1 = zstandard.ZstdCompressor(level=1)
        st.xor_shuf = len(z1.compress(byte_planes(x, planes)))
        st.xor_plain = len(z1.compress(x.tobytes()))
    else:  # layout changed: no byte-wise delta; count it as stored compressed
        st.xor_shuf = st.xor_plain = st.zstd3
    return st


def guess_planes(save: Path) -> int:
    """Element size that holds most bytes: from JSON metadata, DCP metadata, or the name."""
    meta = save / ".metadata"
    try:
        tensors = json.loads(meta.read_text())["tensors"]
        by_dtype: dict[str, int] = {}
        for t in tensors:
            by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["nbytes"]
        return 2 if max(by_dtype, key=lambda k: by_dtype[k]) == "bfloat16" else 4
    except (OSError, UnicodeDecodeError, ValueError, KeyError):
        pass
    try:
        import torch
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(save)).read_metadata()
        sizes: dict[int, int] = {}
        for v in md.state_dict_metadata.values():
            if isinstance(v, TensorStorageMetadata):
                es = torch.empty((), dtype=v.properties.dtype).element_size()
                sizes[es] = sizes.get(es, 0) + es * v.size.numel()
        if sizes:
            return max(sizes, key=lambda k: sizes[k])
    except Exception:  # no torch, or not a DCP checkpoint: fall through to the name
        pass
    return 2 if "bf16" in str(save.parent.name) else 4


@dataclasses.dataclass
class SeriesStats:
    series: str
    saves: int
    bytes_per_save: int
    planes: int
    pairs: list[dict[str, object]]
    total: dict[str, float]


def series_stats(series: Path, planes: int | None) -> SeriesStats:
    saves = sorted(d for d in series.iterdir() if d.is_dir() and d.name.startswith("step_"))
    if len(saves) < 2:
        raise SystemExit(f"error: {series} has fewer than 2 step_* saves")
    n_planes = planes or guess_planes(saves[-1])
    pairs: list[dict[str, object]] = []
    total = PairStats()
    for old, new in itertools.pairwise(saves):
        pair = PairStats()
        for f in sorted(p for p in new.iterdir() if p.is_file()):
            if (old / f.name).is_file():
                pair.add(compare_files(old / f.name, f, n_planes))
        total.add(pair)
        pairs.append({"pair": f"{old.name}->{new.name}", **pair.row()})
    return SeriesStats(
        series=str(series),
        saves=len(saves),
        bytes_per_save=sum(f.stat().st_size for f in saves[-1].iterdir() if f.is_file()),
        planes=n_planes,
        pairs=pairs,
        total=total.row(),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ckpt_series_stats", description=__doc__)
    ap.add_argument("series", type=Path, nargs="+", help="dirs holding step_* saves")
    ap.add_argument("--planes", type=int, choices=(1, 2, 4, 8), help="default: from dtypes")
    ap.add_argument("--json", type=Path, help="also write all numbers here")
    args = ap.parse_args(argv)
    print(
        "| series | MB/save | planes | identical 1 MiB chunks (per pair) | zstd-3 "
        "| xor+shuf+zstd-1 | xor+zstd-1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = []
    for series in args.series:
        r = series_stats(series, args.planes)
        results.append(dataclasses.asdict(r))
        t = r.total
        ident = ", ".join(f"{p['identical']:.0%}" for p in r.pairs)
        print(
            f"| {Path(r.series).name} | {r.bytes_per_save / 1e6:.1f} | {r.planes} "
            f"| {t['identical']:.1%} ({ident}) | {t['zstd3']:.2f}x "
            f"| {t['xor_shuf_zstd1']:.2f}x | {t['xor_zstd1']:.2f}x |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
