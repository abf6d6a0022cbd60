"""What a fresh page costs on this machine: why a buffered restore, and the load after any
restore, can be slow on a VM whose free memory goes back to its host.

    python -m bench.page_cost [--mib 512] [--idle 3] [--rounds 3] [--dir DIR]

Linux free page reporting (``CONFIG_PAGE_REPORTING``, virtio-balloon; the kernel command
line's ``page_reporting.page_reporting_order``) hands free memory back to the host a few
seconds after it was freed; the next touch of such a page faults into the host, and the
guest sees it as system time. Every case below starts right after the page cache is dropped
(its pages freed), then either at once ("recycled": the pages are still the guest's) or
after ``--idle`` seconds ("returned": reported and taken back), and times, per MiB:

- anon: touching ``--mib`` of fresh anonymous memory (what a loader's tensors cost);
- buffered: writing as much into a new file through the page cache, 4 MiB pwrites (a
  buffered restore);
- direct: the same with O_DIRECT (no page of the cache is touched);
- readahead: the direct file's pages read back by the kernel (posix_fadvise WILLNEED, a
  window at a time, then a read of all of it: a warm restore's read-back).

Results: bench/results/page_cost.md and .json. Root is needed (drop_caches).
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._env import reproduce_command, write_results  # noqa: E402
from bench._measure import drop_caches  # noqa: E402
from transfer.directio import aligned  # noqa: E402
from transfer.engine.warmcache import warm_files  # noqa: E402

BLOCK = 4 << 20
CASES = ("anon", "buffered", "direct", "readahead")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds before a 'returned' case")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="on the disk to measure")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return ap.parse_args(argv)


def _sys_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _timed(work: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, system seconds) of ``work``."""
    sys0, t0 = _sys_seconds(), time.perf_counter()
    work()
    return time.perf_counter() - t0, _sys_seconds() - sys0


def _write(path: Path, nbytes: int, direct: bool) -> None:
    data = aligned(BLOCK)
    data[:] = os.urandom(BLOCK)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        for at in range(0, nbytes, BLOCK):
            os.pwrite(fd, data, at)
    finally:
        os.close(fd)


def _touch(nbytes: int) -> None:
    with mmap.mmap(-1, nbytes) as m:
        for at in range(0, nbytes, mmap.PAGESIZE):
            m[at] = 1


def _read_back(path: Path) -> None:
    warm_files([path])
    with path.open("rb") as f:
        while f.read(BLOCK):
            pass


def one(case: str, work: Path, nbytes: int, idle: float) -> tuple[float, float]:
    scratch = work / "scratch"
    if case == "readahead":  # on the device, not in memory
        _write(scratch, nbytes, direct=True)
    drop_caches()
    time.sleep(idle)
    jobs: dict[str, Callable[[], None]] = {
        "anon": lambda: _touch(nbytes),
        "buffered": lambda: _write(scratch, nbytes, direct=False),
        "direct": lambda: _write(scratch, nbytes, direct=True),
        "readahead": lambda: _read_back(scratch),
    }
    try:
        return _timed(jobs[case])
    finally:
        scratch.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.mib << 20
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-page-cost-", dir=args.dir) as tmp:
        for rnd in range(args.rounds):
            for state, idle in (("recycled", 0.0), ("returned", args.idle)):
                for case in CASES:
                    wall, system = one(case, Path(tmp), nbytes, idle)
                    row = {
                        "round": rnd + 1, "state": state, "case": case, "wall": wall,
                        "sys_ms_per_mib": system * 1e3 / args.mib, "mb_per_s": nbytes / wall / 1e6,
                    }  # fmt: skip
                    rows.append(row)
                    print(f"r{rnd + 1} {state:<8} {case:<9} {row['mb_per_s']:7,.0f} MB/s  "
                          f"sys {row['sys_ms_per_mib']:.2f} ms/MiB", flush=True)  # fmt: skip
    return {"mib": args.mib, "idle": args.idle, "rows": rows}


def report(doc: dict[str, Any]) -> str:
    def med(state: str, case: str, key: str) -> float:
        return statistics.median(
            r[key] for r in doc["rows"] if r["state"] == state and r["case"] == case
        )

    lines = [
        f"{doc['mib']} MiB per case, medians of {len(doc['rows']) // (2 * len(CASES))} rounds; "
        f"'returned': {doc['idle']:g} s idle after the page cache was dropped",
        "",
        "| case | recycled MB/s | recycled sys ms/MiB | returned MB/s | returned sys ms/MiB |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        cells = [
            f"{med(s, case, 'mb_per_s'):,.0f} | {med(s, case, 'sys_ms_per_mib'):.2f}"
            for s in ("recycled", "returned")
        ]
        lines.append(f"| {case} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = reproduce_command([sys.executable, "-m", "bench.page_cost",
                                 *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    print(command, flush=True)
    doc = run(args)
    md = report(doc)
    print(md)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    write_results(args.out_dir, "page_cost", command, date, md, **doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
