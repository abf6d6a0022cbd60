"""Two checkouts' pushes side by side: step k (``--full``) then k+1 (a delta of k) into a
fresh local-directory store, alternated round by round, with the saves in the page cache
(as the agent pushes a save training has just written) or the cache dropped (``--cold``).

    git worktree add /tmp/before <commit>; cp transfer/codec/*.so /tmp/before/transfer/codec/
    python -m bench.push_ab /work/corpus/full --before /tmp/before [--runs 2] [--cold]

Prints, per round, tree and step: wall seconds, CPU seconds (user + system), stored MB,
chunks and delta chunks. For A/B work on the push path (here: cutting DCP files at their
items, transfer/engine/chunkspans.py); bench.local_push is the rate against ``cp``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._measure import drop_caches
from bench.store_cost import saves

REPO = Path(__file__).resolve().parent.parent


def push_once(tree: Path, store: Path, save: Path, step: int, full: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "agent", "push", str(save), str(store), "--job", "j",
            "--step", str(step), "--node", "n", "--json"]  # fmt: skip
    argv += ["--full"] if full else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    ran = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
    took = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if ran.returncode != 0:
        raise SystemExit(f"push of {save} by {tree} failed: {ran.stderr[-2000:]}")
    done = json.loads(ran.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": took, "cpu": cpu, "stored_mb": done["bytes_transferred"] / 1e6,
            "chunks": done["chunks_total"], "delta": done.get("chunks_delta") or 0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("series", type=Path, help="a directory of step_*/ saves: its two newest")
    ap.add_argument("--before", type=Path, required=True, help="the other checkout")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each push")
    args = ap.parse_args(argv)
    k, k1 = saves(args.series)[-2:]
    trees = {"before": args.before.resolve(), "after": REPO}
    for rnd in range(args.runs):
        for name in list(trees)[:: 1 if rnd % 2 == 0 else -1]:
            work = Path(tempfile.mkdtemp(prefix="ferry-push-ab-"))
            try:
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                init = [sys.executable, "-m", "agent", "init", str(work / "store")]
                subprocess.run(init, env=env, cwd=trees[name], check=True, capture_output=True)
                for step, save in enumerate((k, k1), start=1):
                    if args.cold:
                        drop_caches()
                    else:
                        for f in save.iterdir():
                            f.read_bytes()
                    got = push_once(trees[name], work / "store", save, step, full=step == 1)
                    print(f"r{rnd + 1} {name:<6} {save.name} ({'full' if step == 1 else 'delta'}):"
                          f" {got['seconds']:5.2f} s  CPU {got['cpu']:5.2f} s  stored"
                          f" {got['stored_mb']:8.1f} MB  chunks {got['chunks']:5.0f}"
                          f" (delta {got['delta']:.0f})", flush=True)  # fmt: skip
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
