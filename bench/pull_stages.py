"""The pulls of issue 11, alone and fast: ferry against ``s5cmd cp``, where the time goes.

What: one variant of the real-training corpus (``python -m bench.corpus DIR``) pushed once
(step k as a keyframe, k+1 delta-coded against it) to SeaweedFS on loopback, then ``--runs``
alternated rounds, page cache dropped before every operation, of:

- ``s5cmd cp`` of k+1 (the plain download a user compares with);
- ``ferry pull`` of k+1 onto a node holding k (``--base-dir``);
- ``ferry pull`` of k, cold (a keyframe restore: the cold full pull);
- with ``--scenarios ...,cold-delta``: ``ferry pull`` of k+1 onto an empty node (its delta
  chunks' bases come from the store too).

For every ferry run it prints the pull's own per-stage thread seconds (``stage_seconds``:
receive, base_read, decode, hash, write) beside the process's CPU seconds and the server's,
so the gap between a stage and its limit is visible; every restore is compared byte for
byte with its source. Quicker than ``bench.compare`` (no pushes per round, no agents), for
A/B work on the restore path; ``bench.compare`` stays the decisive run.

How::

    python -m bench.pull_stages --corpus /work/corpus [--variant full] [--runs 3]
    python -m bench.pull_stages --corpus /work/corpus --ferry-arg=--write-path=direct  # A/B
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tempfile  # noqa: E402

from bench._measure import check_same, drop_caches, run_timed, tree_digest  # noqa: E402
from bench.peers import Commands, tool_env  # noqa: E402
from tests.s3server import start_s3_server  # noqa: E402

MB = 1e6
BASE_STEP, NEXT_STEP = 20, 40


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="python -m bench.corpus DIR")
    ap.add_argument("--variant", default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ferry-arg", action="append", default=[], metavar="ARG",
                    help="a flag of `ferry pull` for a second ferry arm (A/B), repeatable; "
                    "e.g. --ferry-arg=--write-path=direct")  # fmt: skip
    ap.add_argument("--scenarios", default="s5cmd,holding-k,cold",
                    help="comma-separated subset of s5cmd,holding-k,cold,cold-delta")  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    series = args.corpus / args.variant
    k, k1 = series / f"step_{BASE_STEP:06d}", series / f"step_{NEXT_STEP:06d}"
    print("python -m bench.pull_stages " + " ".join(sys.argv[1:] if argv is None else argv))
    digest_k, digest_k1 = tree_digest(k), tree_digest(k1)
    wanted = set(args.scenarios.split(","))
    work = Path(tempfile.mkdtemp(prefix="ferry-pull-stages-"))
    server = start_s3_server(work / "s3")
    try:
        ep = server.endpoint
        cmd = Commands(ep)
        env = {**os.environ, **tool_env(ep, work / "rclone.conf"), "PYTHONPATH": str(REPO)}
        arms: dict[str, list[str]] = {"ferry": []}
        if args.ferry_arg:
            arms["ferry " + " ".join(args.ferry_arg)] = list(args.ferry_arg)
        proc = getattr(server, "_proc", None)
        server_pid = proc.pid if proc is not None else None
        for step, ckpt in ((BASE_STEP, k), (NEXT_STEP, k1)):
            ran = run_timed(cmd.ferry_push(ckpt, "ferry", "j", step), env, server_pid)
            assert ran.returncode == 0, (ran.returncode, ran.stdout[-2000:], ran.stderr[-2000:])
        ran = run_timed(cmd.s5cmd("cp", f"{k1}/*", f"{cmd.s3('plain')}/"), env, server_pid)
        assert ran.returncode == 0, (ran.returncode, ran.stdout[-2000:], ran.stderr[-2000:])
        rows: list[dict[str, Any]] = []
        dest = work / "dest"
        for rnd in range(1, args.runs + 1):
            plan: list[tuple[str, str, list[str], dict[str, str], Any]] = []
            if "s5cmd" in wanted:
                argv_ = cmd.s5cmd("cp", f"{cmd.s3('plain')}/*", f"{dest}/")
                plan.append(("s5cmd cp k+1", "s5cmd", argv_, env, digest_k1))
            for arm, extra in arms.items():
                if "holding-k" in wanted:
                    argv_ = [*cmd.ferry_pull("ferry", "j", NEXT_STEP, dest), "--base-dir", str(k)]
                    plan.append(("pull k+1 holding k", arm, [*argv_, *extra], env, digest_k1))
                if "cold" in wanted:
                    argv_ = cmd.ferry_pull("ferry", "j", BASE_STEP, dest)
                    plan.append(("cold pull of k", arm, [*argv_, *extra], env, digest_k))
                if "cold-delta" in wanted:  # k+1's deltas need k's chunks from the store too
                    argv_ = cmd.ferry_pull("ferry", "j", NEXT_STEP, dest)
                    plan.append(("cold pull of k+1", arm, [*argv_, *extra], env, digest_k1))
            shift = (rnd - 1) % len(plan)  # alternate who goes first
            for what, tool, argv_, arm_env, digest in plan[shift:] + plan[:shift]:
                drop_caches()
                ran = run_timed(argv_, arm_env, server_pid)
                if ran.returncode != 0:
                    raise SystemExit(f"{what} by {tool} failed:\n{ran.stderr[-2000:]}")
                check_same(digest, dest, f"{what} by {tool}")
                shutil.rmtree(dest)
                detail = json.loads(ran.stdout) if tool != "s5cmd" else {}
                row = {
                    "round": rnd, "what": what, "tool": tool, "seconds": ran.seconds,
                    "cpu": ran.cpu_user + ran.cpu_sys, "sys": ran.cpu_sys,
                    "rss_mb": ran.peak_rss_mb, "server_cpu": ran.server_cpu or 0.0,
                    "moved_mb": detail.get("bytes_transferred", 0) / MB,
                    "stages": detail.get("stage_seconds", {}),
                }  # fmt: skip
                rows.append(row)
                stages = " ".join(f"{s}={v:.2f}" for s, v in sorted(row["stages"].items()))
                print(f"r{rnd} {what:<20} {tool:<10} {ran.seconds:6.2f} s  CPU {row['cpu']:5.2f}"
                      f" (sys {ran.cpu_sys:4.2f}) server {row['server_cpu']:4.2f}"
                      f"  RSS {ran.peak_rss_mb:4.0f} MB  {stages}", flush=True)  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\n| scenario | tool | median s | median CPU s | / s5cmd |\n|---|---|---|---|---|")
    plain = [r["seconds"] for r in rows if r["tool"] == "s5cmd"]
    base = statistics.median(plain) if plain else None
    for what, tool in dict.fromkeys((r["what"], r["tool"]) for r in rows):
        mine = [r for r in rows if (r["what"], r["tool"]) == (what, tool)]
        s = statistics.median(r["seconds"] for r in mine)
        c = statistics.median(r["cpu"] for r in mine)
        ratio = f"{s / base:.2f}x" if base else ""
        print(f"| {what} | {tool} | {s:.2f} | {c:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
