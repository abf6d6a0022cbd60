"""Peak memory of a push and a pull as the checkpoint grows: flat, or not?

What: checkpoints of about 1.7, 4.2 and 8.4 GB made of the real-training corpus's rank
files (``python -m bench.corpus DIR``; each is hard-linked, so they cost no disk: the
full variant's step k as 8 ranks, then more ranks taken from its other saves and the other
variants, renamed ``__<rank>_0.distcp``), each pushed cold to SeaweedFS on loopback and
pulled back cold into an empty directory, page cache dropped before each; the peak RSS
of each ``ferry`` process (``getrusage``), its wall and CPU seconds, and a byte-for-byte
check of the restore. The issue's target: at most 512 MB, flat from 1 to 8 GB.

How::

    python -m bench.rss_scale --corpus /work/corpus [--sizes 8,20,40]   # rank files each

writes bench/results/rss_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._measure import check_same, drop_caches, run_timed, tree_digest  # noqa: E402
from bench.peers import Commands, tool_env  # noqa: E402
from tests.s3server import start_s3_server  # noqa: E402

MB = 1e6
RESULTS = REPO / "bench" / "results"


def rank_files(corpus: Path) -> list[Path]:
    """Every rank file of the corpus, the full variant's first save first."""
    files = sorted(corpus.glob("full/step_*/__*_0.distcp"))
    files += sorted(p for p in corpus.glob("*/step_*/__*_0.distcp") if p not in set(files))
    return files


def make_checkpoint(dest: Path, files: list[Path], ranks: int) -> int:
    """A DCP-shaped directory of ``ranks`` rank files hard-linked from ``files``."""
    if ranks > len(files):
        raise SystemExit(f"the corpus has {len(files)} rank files, {ranks} asked for")
    dest.mkdir(parents=True)
    (dest / ".metadata").write_bytes((files[0].parent / ".metadata").read_bytes())
    for rank, src in enumerate(files[:ranks]):
        os.link(src, dest / f"__{rank}_0.distcp")
    return sum(p.stat().st_size for p in dest.iterdir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="python -m bench.corpus DIR")
    ap.add_argument("--sizes", default="8,20,40", help="rank files per checkpoint (~211 MB each)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    command = "python -m bench.rss_scale " + " ".join(sys.argv[1:] if argv is None else argv)
    print(command, flush=True)
    files = rank_files(args.corpus)
    work = Path(tempfile.mkdtemp(prefix="ferry-rss-", dir=args.corpus))  # same fs: links
    server_dir = Path(tempfile.mkdtemp(prefix="ferry-rss-s3-"))
    server = start_s3_server(server_dir)
    rows: list[dict[str, Any]] = []
    try:
        cmd = Commands(server.endpoint)
        env = {**os.environ, **tool_env(server.endpoint, work / "rclone.conf")}
        env["PYTHONPATH"] = str(REPO)
        pid = getattr(getattr(server, "_proc", None), "pid", None)
        for ranks in (int(n) for n in args.sizes.split(",")):
            ckpt = work / f"r{ranks}" / "step_000020"
            raw = make_checkpoint(ckpt, files, ranks)
            digest = tree_digest(ckpt)
            dest = work / f"r{ranks}-pulled"
            store = f"rss{ranks}"
            for op, argv_ in (
                ("cold full push", cmd.ferry_push(ckpt, store, "j", 20)),
                ("cold full pull", cmd.ferry_pull(store, "j", 20, dest)),
            ):
                drop_caches()
                ran = run_timed(argv_, env, pid)
                if ran.returncode != 0:
                    raise SystemExit(f"{op} of {raw / MB:,.0f} MB failed:\n{ran.stderr[-2000:]}")
                row = {
                    "raw_mb": round(raw / MB), "op": op, "seconds": round(ran.seconds, 2),
                    "cpu": round(ran.cpu_user + ran.cpu_sys, 2),
                    "peak_rss_mb": round(ran.peak_rss_mb),
                    "moved_mb": round(json.loads(ran.stdout)["bytes_transferred"] / MB),
                }  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            check_same(digest, dest, f"the pull of {raw / MB:,.0f} MB")
            shutil.rmtree(dest)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(server_dir, ignore_errors=True)  # the pushed packs: 11 GB
    write(args.out_dir, command, rows)
    return 0


def write(out_dir: Path, command: str, rows: list[dict[str, Any]]) -> None:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rss_scale.json").write_text(json.dumps({"when": when, "rows": rows}, indent=1))
    lines = [
        "# bench.rss_scale", "", f"`{command}`", "",
        f"{when}, SeaweedFS on loopback, page cache dropped before each operation, one run",
        "", "| checkpoint MB | operation | s | CPU s | MB moved | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['raw_mb']:,} | {r['op']} | {r['seconds']} | {r['cpu']} | "
            f"{r['moved_mb']:,} | {r['peak_rss_mb']} |"
        )
    (out_dir / "rss_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
