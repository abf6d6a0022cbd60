"""What a command costs before it moves a byte: ``ferry --help`` and the time to a first S3
answer (``ferry ls`` of a store holding one tiny checkpoint), side by side with ``s5cmd
ls`` in the same run.

Every command runs ``--runs`` times, the tools interleaved, page cache warm (the programs
are loaded; bench.compare measures the cold case). ``--old DIR`` adds a second ferry from
another checkout (``git worktree add /tmp/old <commit>``) for a before/after::

    python -m bench.startup
    python -m bench.startup --old /tmp/old --runs 9

prints medians and writes bench/results/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._env import ferry_command, write_results  # noqa: E402
from bench.peers import tool_env  # noqa: E402
from tests.s3server import S3Server  # noqa: E402


def seconds(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"failed: {shlex.join(argv)}\n{done.stderr[-2000:]}")
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--old", type=Path, help="another checkout to time beside this one")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.startup", *(argv or sys.argv[1:])])
    work = Path(tempfile.mkdtemp(prefix="ferry-startup-"))
    server = S3Server(work / "s3")
    (work / "s3").mkdir()
    try:
        ep = server.start()
        env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
        env |= tool_env(ep, work / "rclone.conf")
        store = f"s3://{ep.bucket}/startup"
        tiny = work / "ckpt" / "step_000001"  # `ferry ls` of a non-store is an error now
        tiny.mkdir(parents=True)
        (tiny / ".metadata").write_bytes(b"x")
        push = [*ferry_command(), "push", str(tiny), store, "--job", "j", "--init"]
        subprocess.run(push, env=env | {"PYTHONPATH": str(REPO)}, check=True, capture_output=True)
        checkouts = {"ferry": REPO} | ({"ferry (old)": args.old.resolve()} if args.old else {})
        cases: dict[str, tuple[list[str], dict[str, str]]] = {}
        for name, root in checkouts.items():
            ferry_env = env | {"PYTHONPATH": str(root)}
            ferry = ferry_command(root)
            cases[f"{name} --help"] = ([*ferry, "--help"], ferry_env)
            cases[f"{name} ls (first S3 answer)"] = ([*ferry, "ls", store], ferry_env)
        marker = work / "one-object"
        marker.write_bytes(b"x")  # s5cmd ls of an empty prefix is an error
        s5cmd = ["s5cmd", "--endpoint-url", ep.url]
        subprocess.run([*s5cmd, "cp", str(marker), f"s3://{ep.bucket}/s5/"], env=env, check=True)
        cases["s5cmd ls (first S3 answer)"] = ([*s5cmd, "ls", f"s3://{ep.bucket}/s5/*"], env)
        for argv_, env_ in cases.values():  # warm the page cache and the server
            subprocess.run(argv_, env=env_, capture_output=True, check=False)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for rnd in range(args.runs):
            names = list(cases) if rnd % 2 == 0 else list(reversed(cases))
            for name in names:
                samples[name].append(seconds(*cases[name]))
        med = {name: statistics.median(v) for name, v in samples.items()}
        s5 = med["s5cmd ls (first S3 answer)"]
        rows = ["| command | median s | / s5cmd ls |", "|---|---|---|"]
        for name, m in med.items():
            rows.append(f"| {name} | {m:.3f} | {m / s5:.2f}x |")
        md = (
            f"Start-up, page cache warm, medians of {args.runs} interleaved runs "
            f"({ep.kind} on loopback).\n\n`{command}`\n\n" + "\n".join(rows) + "\n"
        )
        print(md)
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        write_results(args.out_dir, "startup", command, date, md, samples=samples, medians=med)
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
