"""What a fresh page costs on this machine: why a buffered restore, and the load after any
restore, can be slow on a VM whose free memory goes back to its host.

    python -m bench.page_cost [--mib 512] [--idle 3] [--rounds 3] [--dir DIR]

Linux free page reporting (``CONFIG_PAGE_REPORTING``, virtio-balloon; the kernel command
line's ``page_reporting.page_reporting_order``) hands free memory back to the host a few
seconds after it was freed; the next touch of such a page faults into the host, and the
guest sees it as system time. Each case runs ``--idle`` seconds after the page cache was
dropped ("returned": its pages reported and taken back), then again at once into the pages
the first run just freed ("recycled": still the guest's), and times, per MiB:

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

from bench._env import run_and_record  # noqa: E402
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


def one(case: str, work: Path, nbytes: int, idle: float) -> list[tuple[float, float]]:
    """(wall, system seconds) of ``case`` after ``idle`` seconds of a dropped page cache
    ("returned"), then of the same again at once, into the pages the first one just freed
    ("recycled")."""
    scratch = work / "scratch"
    jobs: dict[str, Callable[[], None]] = {
        "anon": lambda: _touch(nbytes),
        "buffered": lambda: _write(scratch, nbytes, direct=False),
        "direct": lambda: _write(scratch, nbytes, direct=True),
        "readahead": lambda: _read_back(scratch),
    }
    times = []
    for rest in (idle, 0.0):
        if case == "readahead":  # on the device, not in memory
            _write(scratch, nbytes, direct=True)
        if rest:
            drop_caches()
            time.sleep(rest)
        else:  # (the first one's pages freed, its file's page cache included)
            drop_caches()
        try:
            times.append(_timed(jobs[case]))
        finally:
            scratch.unlink(missing_ok=True)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.mib << 20
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-page-cost-", dir=args.dir) as tmp:
        for rnd in range(args.rounds):
            for case in CASES:
                timed = one(case, Path(tmp), nbytes, args.idle)
                for state, (wall, system) in zip(("returned", "recycled"), timed, strict=True):
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
        "| case | returned MB/s | returned sys ms/MiB | recycled MB/s | recycled sys ms/MiB |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        cells = [
            f"{med(s, case, 'mb_per_s'):,.0f} | {med(s, case, 'sys_ms_per_mib'):.2f}"
            for s in ("returned", "recycled")
        ]
        lines.append(f"| {case} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_and_record(
        "bench.page_cost", argv, parse_args, run, report, lambda _args: "page_cost"
    )


if __name__ == "__main__":
    raise SystemExit(main())
