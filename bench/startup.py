"""What a command costs before it moves a byte: ``ferry --help``, the time to a first S3
answer (``ferry ls`` of a store holding one tiny checkpoint) and a whole pull of a 1 MB
step (the fixed cost a small step pays: start, listing, manifest, staging, rename, exit),
side by side with ``s5cmd ls`` and ``s5cmd cp`` of the same files in the same run.

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
import os
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


#: a pull's destination, emptied (untimed) after every run: a pull refuses one that exists
Case = tuple[list[str], dict[str, str], Path | None]


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
        (tiny / "__0_0.distcp").write_bytes(os.urandom(1 << 20))  # the fixed cost: any bytes
        push = [*ferry_command(), "push", str(tiny), store, "--job", "j", "--init"]
        subprocess.run(push, env=env | {"PYTHONPATH": str(REPO)}, check=True, capture_output=True)
        checkouts = {"ferry": REPO} | ({"ferry (old)": args.old.resolve()} if args.old else {})
        dest = work / "dest"
        cases: dict[str, Case] = {}
        for name, root in checkouts.items():
            ferry_env = env | {"PYTHONPATH": str(root)}
            ferry = ferry_command(root)
            cases[f"{name} --help"] = ([*ferry, "--help"], ferry_env, None)
            cases[f"{name} ls (first S3 answer)"] = ([*ferry, "ls", store], ferry_env, None)
            pull = [*ferry, "pull", store, str(dest), "--job", "j", "--step", "1"]
            cases[f"{name} pull (1 MB step)"] = (pull, ferry_env, dest)
        s5cmd = ["s5cmd", "--endpoint-url", ep.url]
        # the step's files as objects: s5cmd ls lists them, s5cmd cp copies them
        subprocess.run([*s5cmd, "cp", f"{tiny}/*", f"s3://{ep.bucket}/s5/"], env=env, check=True)
        cases["s5cmd ls (first S3 answer)"] = ([*s5cmd, "ls", f"s3://{ep.bucket}/s5/*"], env, None)
        s5cp = [*s5cmd, "cp", f"s3://{ep.bucket}/s5/*", f"{dest}/"]
        cases["s5cmd cp (the same 1 MB step)"] = (s5cp, env, dest)
        for argv_, env_, out in cases.values():  # warm the page cache and the server
            subprocess.run(argv_, env=env_, capture_output=True, check=False)
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for rnd in range(args.runs):
            names = list(cases) if rnd % 2 == 0 else list(reversed(cases))
            for name in names:
                argv_, env_, out = cases[name]
                samples[name].append(seconds(argv_, env_))
                if out is not None:
                    shutil.rmtree(out)
        med = {name: statistics.median(v) for name, v in samples.items()}
        plain = {
            "ls": med["s5cmd ls (first S3 answer)"],
            "cp": med["s5cmd cp (the same 1 MB step)"],
        }
        rows = ["| command | median s | / s5cmd ls or cp |", "|---|---|---|"]
        for name, m in med.items():
            peer = plain["cp"] if "pull" in name or " cp " in name else plain["ls"]
            rows.append(f"| {name} | {m:.3f} | {m / peer:.2f}x |")
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
