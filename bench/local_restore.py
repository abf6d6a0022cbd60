"""Restore from a local-directory store (NVMe, NFS) onto a node holding k, against a copy.

The peer here is the plain way to move a checkpoint between two local directories:
``cp -r`` of save k+1, then ``sync`` (so its data is on disk, as a restore's is once it is
settled). ferry pulls k+1 from a local-dir store that holds k and k+1 (k+1 delta-coded),
with ``--base-dir`` k: it reads k+1's stored bytes plus k's where it needs them, decodes and
verifies every chunk, and writes k+1. Two variants of ferry: the default (returns once
renamed into place; transfer/engine/settle.py) and ``--fsync`` (flushed before it returns,
the same promise as ``cp`` + ``sync``). Page cache dropped before each, rounds alternate::

    python -m bench.local_restore --corpus /work/corpus

writes bench/results/local_restore.{json,md}.
"""

from __future__ import annotations

import datetime
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
from bench._measure import (  # noqa: E402
    check_same,
    drop_caches,
    local_corpus_args,
    tree_digest,
)

MB = 1e6


def main(argv: list[str] | None = None) -> int:
    args = local_corpus_args(__doc__, argv)
    command = shlex.join(["python", "-m", "bench.local_restore", *(argv or sys.argv[1:])])
    k, k1 = (args.corpus / args.variant / f"step_{s:06d}" for s in (20, 40))
    work = Path(tempfile.mkdtemp(prefix="ferry-local-", dir=args.workdir))
    ferry = ferry_command()
    try:
        store = work / "store"
        store.mkdir()
        for step, ckpt in ((20, k), (40, k1)):
            push = [*ferry, "push", str(ckpt), str(store), "--job", "j", "--node", "n0", "--init"]
            subprocess.run([*push, "--step", str(step)], check=True, capture_output=True)
        digest = tree_digest(k1)
        pull = [*ferry, "pull", str(store), "DEST", "--job", "j", "--step", "40"]
        pull += ["--base-dir", str(k), "--json"]
        tools = {
            "cp -r + sync": ["sh", "-c", f"cp -r {k1} DEST && sync"],
            "ferry pull": pull,
            "ferry pull --fsync": [*pull, "--fsync"],
        }
        samples: dict[str, list[float]] = {t: [] for t in tools}
        for rnd in range(args.runs):
            names = list(tools)
            names = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in names:
                dest = work / "dest"
                drop_caches()
                t = time.monotonic()
                argv = [a.replace("DEST", str(dest)) for a in tools[name]]
                subprocess.run(argv, check=True, capture_output=True)
                samples[name].append(time.monotonic() - t)
                check_same(digest, dest, name)
                print(f"  r{rnd + 1} {name:<20} {samples[name][-1]:6.2f} s", flush=True)
                shutil.rmtree(dest)
                for marker in work.glob(".dest.ferry-unsynced"):
                    marker.unlink()
        med = {t: statistics.median(v) for t, v in samples.items()}
        now = datetime.datetime.now(datetime.UTC)
        rows = "".join(
            f"| {t} | {med[t]:.2f} | {med[t] / med['cp -r + sync']:.2f}x |\n" for t in tools
        )
        md = (
            f"# bench.local_restore\n\n`{command}`\n\n{now:%Y-%m-%d %H:%M} UTC, {args.variant} "
            f"save k+1 of {data.tree_bytes(k1) / MB:,.0f} MB from a local-dir store onto a "
            f"node holding k, page cache dropped before each, median of {args.runs}\n\n"
            f"| tool | median s | / cp -r + sync |\n|---|---|---|\n{rows}"
        )
        write_results(
            args.out_dir,
            "local_restore",
            command,
            now.isoformat(timespec="seconds"),
            md,
            seconds=samples,
            median_s=med,
        )
        print(md)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
