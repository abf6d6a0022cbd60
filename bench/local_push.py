"""Delta push into a local-directory store (NVMe, NFS) holding k, against a plain copy.

The issue's target is a rate: a local delta push of a 2 GB-class save at >= 400 MB/s of raw
checkpoint on 2 cores. ferry pushes save k+1 into a local-dir store that holds k (pushed
once, ``--full``; each round starts from a hard-linked copy of that store), reading k+1 and
its local base k, hashing, delta-coding and writing fsynced packs. The peer is
``cp -r`` of k+1 into the store's disk, then ``sync``: what moving it there costs without
any coding. Both with the page cache dropped (cold: a node that saved long ago) and warm
(k+1 was just written by training, k shortly before: the agent's usual case); rounds
alternate::

    python -m bench.local_push --corpus /work/corpus [--variant full] [--runs 3]

writes bench/results/local_push.{json,md}.
"""

from __future__ import annotations

import datetime
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import data  # noqa: E402
from bench._env import ferry_command, write_results  # noqa: E402
from bench._measure import drop_caches, local_corpus_args  # noqa: E402

MB = 1e6


def _warm(*dirs: Path) -> None:
    for d in dirs:
        for f in d.iterdir():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def main(argv: list[str] | None = None) -> int:
    args = local_corpus_args(__doc__, argv)
    command = shlex.join(["python", "-m", "bench.local_push", *(argv or sys.argv[1:])])
    k, k1 = (args.corpus / args.variant / f"step_{s:06d}" for s in (20, 40))
    raw = data.tree_bytes(k1)
    work = Path(tempfile.mkdtemp(prefix="ferry-lpush-", dir=args.workdir))
    ferry = [*ferry_command(), "push", "--job", "j", "--node", "n0"]
    try:
        base_store = work / "base-store"
        base_store.mkdir()
        subprocess.run(
            [*ferry, str(k), str(base_store), "--step", "20", "--full", "--init"],
            check=True,
            capture_output=True,
        )
        tools = {
            "cp -r + sync": ["sh", "-c", f"cp -r {k1} STORE/copy && sync"],
            "ferry push": [*ferry, str(k1), "STORE", "--step", "40", "--json"],
        }
        samples: dict[tuple[str, str], list[float]] = {}
        stored: dict[str, int] = {}
        for rnd in range(args.runs):
            for cache in ("cold", "warm"):
                names = list(tools) if rnd % 2 == 0 else list(reversed(tools))
                for name in names:
                    store = work / "store"
                    shutil.rmtree(store, ignore_errors=True)
                    subprocess.run(["cp", "-al", str(base_store), str(store)], check=True)
                    drop_caches()
                    if cache == "warm":
                        _warm(k, k1)
                    t = time.monotonic()
                    argv_ = [a.replace("STORE", str(store)) for a in tools[name]]
                    done = subprocess.run(argv_, check=True, capture_output=True, text=True)
                    seconds = time.monotonic() - t
                    samples.setdefault((name, cache), []).append(seconds)
                    if name == "ferry push":
                        stored[cache] = json.loads(done.stdout)["bytes_transferred"]
                    print(f"  r{rnd + 1} {cache} {name:<14} {seconds:6.2f} s", flush=True)
        med = {key: statistics.median(v) for key, v in samples.items()}
        now = datetime.datetime.now(datetime.UTC)
        rows = "".join(
            f"| {cache} | {name} | {med[(name, cache)]:.2f} | "
            f"{raw / med[(name, cache)] / MB:,.0f} | "
            f"{med[(name, cache)] / med[('cp -r + sync', cache)]:.2f}x |\n"
            for cache in ("cold", "warm")
            for name in tools
        )
        md = (
            f"# bench.local_push\n\n`{command}`\n\n{now:%Y-%m-%d %H:%M} UTC, {args.variant} "
            f"save k+1 of {raw / MB:,.0f} MB into a local-dir store holding k (ferry stored "
            f"{stored['cold'] / MB:,.0f} MB), median of {args.runs}\n\n"
            "| page cache | tool | median s | MB/s of raw | / cp -r + sync |\n"
            f"|---|---|---|---|---|\n{rows}"
        )
        write_results(
            args.out_dir,
            "local_push",
            command,
            now.isoformat(timespec="seconds"),
            md,
            seconds={f"{n} {c}": v for (n, c), v in samples.items()},
            median_s={f"{n} {c}": v for (n, c), v in med.items()},
            stored_bytes=stored,
        )
        print(md)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
