"""ferry vs s5cmd against a real S3 server (SeaweedFS on loopback): push, pull, incremental.

Run from the repository root::

    python -m bench.s3_throughput                 # 1.2 GB checkpoint, 3 rounds
    python -m bench.s3_throughput --size-gb 0.3 --runs 1   # quick look

Every operation is a fresh CLI subprocess, timed with the wall clock; its CPU seconds and
peak RSS come from ``os.wait4``. Rounds alternate the tools (and flip which goes first) so
that noise on this shared machine lands on both. Every pulled tree is checked byte for byte
(BLAKE3 of every file) against the source: a benchmark of a wrong result is worthless.
Results: a markdown table on stdout and ``bench/results/s3_throughput.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # also runnable as `python bench/s3_throughput.py`
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench._env import describe_source, ferry_command, machine_info, source_info  # noqa: E402
from bench._env import reproduce_command as env_reproduce_command  # noqa: E402
from bench._measure import check_same, drop_caches, run_timed, tree_digest  # noqa: E402
from tests.s3server import S3Endpoint, S3Server, start_s3_server  # noqa: E402

RESULTS = REPO / "bench" / "results" / "s3_throughput.json"
SHARDS = 4
SEED = 20240601
BLOCK_FLOATS = 8 << 20  # 32 MB of float32 per generated block keeps memory low
MB = 1e6

UPLOAD = "upload, cold (empty prefix)"
UPLOAD_RAW = "upload, cold, --zstd-level 0"
UPLOAD_INCR = "upload, incremental (new step, all deduplicated)"
DOWNLOAD = "download to a new dir"
DOWNLOAD_RAW = "download, chunks stored raw (zstd 0)"
# scenario -> the s5cmd scenario it is compared with
BASELINE = {
    UPLOAD: UPLOAD,
    UPLOAD_RAW: UPLOAD,
    UPLOAD_INCR: UPLOAD,
    DOWNLOAD: DOWNLOAD,
    DOWNLOAD_RAW: DOWNLOAD,
}
ORDER = [UPLOAD, UPLOAD_RAW, UPLOAD_INCR, DOWNLOAD, DOWNLOAD_RAW]


@dataclasses.dataclass
class Sample:
    scenario: str
    tool: str
    round: int
    seconds: float  # wall clock of the subprocess, start to exit
    cpu_user: float
    cpu_sys: float
    peak_rss_mb: float
    bytes_moved: int
    server_cpu: float | None  # CPU seconds the S3 server burned meanwhile (local server only)
    other_cpu: float | None  # busy CPU s of all else (kernel threads, neighbours): noise
    sync_after: float  # seconds an os.sync() took right after (unflushed writes left behind)
    tool_seconds: float | None = None  # what ferry itself reports (no interpreter start-up)
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def cpu(self) -> float:
        return self.cpu_user + self.cpu_sys


# -- checkpoint ------------------------------------------------------------------------


def generate_checkpoint(root: Path, total_bytes: int, seed: int = SEED) -> None:
    """A DCP-shaped directory: ``.metadata`` plus ``__<rank>_0.distcp`` shards of float32
    drawn from N(0, 0.02), which zstd shrinks about as little as real weights (~1.08x)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    meta_lines = [
        f"tensor layers.{i}.{name} dtype=float32 shape=[4096,4096] rank={i % SHARDS}"
        for i in range(256)
        for name in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")
    ]
    meta = "\n".join(meta_lines).encode()
    (root / ".metadata").write_bytes(meta)
    shard_floats = (total_bytes - len(meta)) // SHARDS // 4
    for rank in range(SHARDS):
        with (root / f"__{rank}_0.distcp").open("wb") as f:
            left = shard_floats
            while left:
                n = min(left, BLOCK_FLOATS)
                block = rng.standard_normal(n, dtype=np.float32)
                block *= np.float32(0.02)
                f.write(block.tobytes())
                left -= n


class Bench:
    def __init__(self, args: argparse.Namespace, endpoint: S3Endpoint, server_pid: int | None):
        self.args = args
        self.ep = endpoint
        self.server_pid = server_pid
        self.samples: list[Sample] = []
        self.env = {k: v for k, v in os.environ.items() if k != "AWS_PROFILE"}
        self.env.update(
            AWS_ACCESS_KEY_ID=endpoint.access_key,
            AWS_SECRET_ACCESS_KEY=endpoint.secret_key,
            AWS_ENDPOINT_URL=endpoint.url,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        # the ferry under test is the one beside this script, whatever pip installed
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.drop = not args.no_drop_caches
        self.ferry = ferry_command()

    def measure(
        self, scenario: str, tool: str, rnd: int, argv: list[str], bytes_moved: int | None
    ) -> Sample:
        if self.drop and not drop_caches():
            print("note: cannot drop the page cache (not root?); running warm", flush=True)
            self.drop = False
        ran = run_timed(argv, self.env, self.server_pid)
        if ran.returncode != 0:
            raise SystemExit(
                f"{shlex.join(argv)} failed with exit code {ran.returncode}:\n"
                f"{ran.stdout[-2000:]}\n{ran.stderr[-2000:]}"
            )
        t0 = time.perf_counter()
        os.sync()
        sync_after = time.perf_counter() - t0
        detail: dict[str, Any] = {}
        tool_seconds = None
        if tool == "ferry":
            detail = json.loads(ran.stdout)
            tool_seconds = float(detail["seconds"])
            bytes_moved = int(detail["bytes_transferred"])
        assert bytes_moved is not None
        sample = Sample(
            scenario=scenario,
            tool=tool,
            round=rnd,
            seconds=ran.seconds,
            cpu_user=ran.cpu_user,
            cpu_sys=ran.cpu_sys,
            peak_rss_mb=ran.peak_rss_mb,
            bytes_moved=bytes_moved,
            server_cpu=ran.server_cpu,
            other_cpu=ran.other_cpu,
            sync_after=sync_after,
            tool_seconds=tool_seconds,
            detail=detail,
        )
        self.samples.append(sample)
        srv = "" if ran.server_cpu is None else f", server CPU {ran.server_cpu:5.1f} s"
        if ran.other_cpu is not None:
            srv += f", other CPU {ran.other_cpu:5.1f} s"
        print(
            f"  round {rnd} {tool:6} {scenario:<50} {ran.seconds:7.2f} s, "
            f"CPU {sample.cpu:5.1f} s, RSS {ran.peak_rss_mb:6.0f} MB{srv}",
            flush=True,
        )
        return sample

    def ferry_push(self, ckpt: Path, url: str, step: int, extra: list[str]) -> list[str]:
        return [
            *self.ferry,
            "push",
            str(ckpt),
            url,
            "--job",
            "bench",
            "--step",
            str(step),
            "--node",
            "n0",
            "--endpoint-url",
            self.ep.url,
            "--json",
            "--init",  # a new prefix is made a store by its first push
            *extra,
        ]

    def ferry_pull(self, url: str, dest: Path, step: int) -> list[str]:
        return [
            *self.ferry,
            "pull",
            url,
            str(dest),
            "--job",
            "bench",
            "--step",
            str(step),
            "--endpoint-url",
            self.ep.url,
            "--json",
        ]

    def s5cmd(self, *args: str) -> list[str]:
        return ["s5cmd", "--endpoint-url", self.ep.url, *args]

    def warm_up(self, ckpt: Path) -> float:
        """One untimed upload by each tool: a fresh server allocates its volumes on the
        first big write, which would otherwise land on whichever tool goes first."""
        t0 = time.perf_counter()
        tok = secrets.token_hex(4)
        s5_prefix = f"s3://{self.ep.bucket}/warmup-{tok}-s5cmd"
        ferry_url = f"s3://{self.ep.bucket}/warmup-{tok}-ferry"
        for argv in (
            self.s5cmd("cp", f"{ckpt}/*", f"{s5_prefix}/"),
            self.ferry_push(ckpt, ferry_url, 1, []),
            self.s5cmd("rm", f"{s5_prefix}/*"),
            self.s5cmd("rm", f"{ferry_url}/*"),
        ):
            subprocess.run(
                argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True
            )
        return time.perf_counter() - t0

    def round(self, rnd: int, ckpt: Path, raw_bytes: int, expected: Any, scratch: Path) -> None:
        tok = secrets.token_hex(4)
        b = self.ep.bucket
        ferry_url = f"s3://{b}/bench-{tok}-r{rnd}-ferry"
        raw_url = f"s3://{b}/bench-{tok}-r{rnd}-ferry-zstd0"
        s5_prefix = f"s3://{b}/bench-{tok}-r{rnd}-s5cmd/"
        ferry_dest = scratch / f"pull-ferry-r{rnd}"
        raw_dest = scratch / f"pull-ferry-zstd0-r{rnd}"
        s5_dest = scratch / f"pull-s5cmd-r{rnd}"

        def ferry_up() -> None:
            self.measure(UPLOAD, "ferry", rnd, self.ferry_push(ckpt, ferry_url, 1, []), None)

        def s5_up() -> None:
            argv = self.s5cmd("cp", f"{ckpt}/*", s5_prefix)
            self.measure(UPLOAD, "s5cmd", rnd, argv, raw_bytes)

        def ferry_down() -> None:
            self.measure(DOWNLOAD, "ferry", rnd, self.ferry_pull(ferry_url, ferry_dest, 1), None)
            check_same(expected, ferry_dest, "ferry pull")
            shutil.rmtree(ferry_dest)

        def s5_down() -> None:
            argv = self.s5cmd("cp", f"{s5_prefix}*", f"{s5_dest}/")
            self.measure(DOWNLOAD, "s5cmd", rnd, argv, raw_bytes)
            check_same(expected, s5_dest, "s5cmd cp download")
            shutil.rmtree(s5_dest)

        # alternate which tool goes first, so slow drifts (server compaction, neighbours
        # on this shared machine, a warming disk) do not always hit the same one
        pairs = [(ferry_up, s5_up), (ferry_down, s5_down)]
        for first, second in pairs:
            if rnd % 2:
                first, second = second, first
            first()
            second()
        incr = self.measure(
            UPLOAD_INCR, "ferry", rnd, self.ferry_push(ckpt, ferry_url, 2, []), None
        )
        if incr.detail.get("chunks_new") != 0:
            print(f"  note: incremental push stored {incr.detail.get('chunks_new')} new chunks")
        if not self.args.skip_zstd0:
            self.measure(
                UPLOAD_RAW,
                "ferry",
                rnd,
                self.ferry_push(ckpt, raw_url, 1, ["--zstd-level", "0"]),
                None,
            )
            self.measure(DOWNLOAD_RAW, "ferry", rnd, self.ferry_pull(raw_url, raw_dest, 1), None)
            check_same(expected, raw_dest, "ferry pull (zstd 0)")
            shutil.rmtree(raw_dest)
        # keep the server's disk small: these prefixes are done with (not timed)
        for prefix in (ferry_url, raw_url, s5_prefix.rstrip("/")):
            subprocess.run(
                self.s5cmd("rm", f"{prefix}/*"),
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )


# -- reporting -----------------------------------------------------------------------


def summarize(samples: list[Sample], raw_bytes: int) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.scenario, s.tool), []).append(s)
    medians = {k: statistics.median(x.seconds for x in v) for k, v in groups.items()}
    rows: list[dict[str, Any]] = []
    for scenario in ORDER:
        for tool in ("ferry", "s5cmd"):
            group = groups.get((scenario, tool))
            if not group:
                continue
            med = medians[(scenario, tool)]
            base = medians.get((BASELINE[scenario], "s5cmd"))
            server = [x.server_cpu for x in group if x.server_cpu is not None]
            other = [x.other_cpu for x in group if x.other_cpu is not None]
            tool_s = [x.tool_seconds for x in group if x.tool_seconds is not None]
            rows.append(
                {
                    "scenario": scenario,
                    "tool": tool,
                    "runs": len(group),
                    "median_s": med,
                    "min_s": min(x.seconds for x in group),
                    "max_s": max(x.seconds for x in group),
                    "mb_per_s": raw_bytes / med / MB,
                    "bytes_moved": int(statistics.median(x.bytes_moved for x in group)),
                    "peak_rss_mb": max(x.peak_rss_mb for x in group),
                    "cpu_s": statistics.median(x.cpu for x in group),
                    "server_cpu_s": statistics.median(server) if server else None,
                    "other_cpu_s": statistics.median(other) if other else None,
                    "sync_after_s": statistics.median(x.sync_after for x in group),
                    "tool_reported_s": statistics.median(tool_s) if tool_s else None,
                    "ratio_vs_s5cmd": med / base if tool == "ferry" and base else None,
                }
            )
    return rows


def human_bytes(n: float) -> str:
    if n >= MB:
        return f"{n / MB:,.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:,.1f} kB"
    return f"{n:,.0f} B"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | tool | median s (min–max) | MB/s | bytes moved | peak RSS MB | CPU s "
        "| server CPU s | other CPU s | ferry/s5cmd |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ratio = f"{r['ratio_vs_s5cmd']:.2f}x" if r["ratio_vs_s5cmd"] is not None else ""
        server = f"{r['server_cpu_s']:.1f}" if r["server_cpu_s"] is not None else "n/a"
        other = f"{r['other_cpu_s']:.1f}" if r["other_cpu_s"] is not None else "n/a"
        lines.append(
            f"| {r['scenario']} | {r['tool']} | {r['median_s']:.2f} "
            f"({r['min_s']:.2f}–{r['max_s']:.2f}) | {r['mb_per_s']:.0f} | "
            f"{human_bytes(r['bytes_moved'])} | {r['peak_rss_mb']:.0f} | {r['cpu_s']:.1f} | "
            f"{server} | {other} | {ratio} |"
        )
    return "\n".join(lines)


def reproduce_command(args: argparse.Namespace) -> str:
    argv = ["python", "-m", "bench.s3_throughput", "--size-gb", str(args.size_gb)]
    argv += ["--runs", str(args.runs)]
    if args.no_drop_caches:
        argv.append("--no-drop-caches")
    if args.skip_zstd0:
        argv.append("--skip-zstd0")
    return env_reproduce_command(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-gb", type=float, default=1.2, help="checkpoint size (1e9 B)")
    parser.add_argument("--runs", type=int, default=3, help="alternating rounds")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new /tmp dir")
    parser.add_argument("--no-drop-caches", action="store_true", help="run with a warm cache")
    parser.add_argument("--skip-zstd0", action="store_true", help="skip the --zstd-level 0 rows")
    parser.add_argument("--keep", action="store_true", help="keep the workdir afterwards")
    parser.add_argument("--json-out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    print(f"reproduce: {reproduce_command(args)}  (from the repo root)", flush=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ferry-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "ckpt"
    server: S3Server | None = None
    started = time.monotonic()
    load_before = os.getloadavg()
    source_before = source_info(REPO)
    try:
        total = int(args.size_gb * 1e9)
        t0 = time.perf_counter()
        generate_checkpoint(ckpt, total)
        expected = tree_digest(ckpt)
        raw_bytes = sum(size for size, _ in expected.values())
        print(
            f"checkpoint: {len(expected)} files, {raw_bytes / MB:,.1f} MB in {ckpt} "
            f"(generated + hashed in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        server = start_s3_server(workdir / "s3server")
        ep = server.endpoint
        proc = getattr(server, "_proc", None)  # the local server's process, for its CPU time
        server_pid = proc.pid if proc is not None else None
        print(f"S3 server: {ep.kind} at {ep.url}, bucket {ep.bucket}", flush=True)
        bench = Bench(args, ep, server_pid)
        print(f"warm-up (untimed): {bench.warm_up(ckpt):.1f} s", flush=True)
        for rnd in range(1, args.runs + 1):
            print(f"round {rnd}/{args.runs}", flush=True)
            bench.round(rnd, ckpt, raw_bytes, expected, workdir)
        rows = summarize(bench.samples, raw_bytes)
        table = markdown_table(rows)
        now = datetime.datetime.now(datetime.UTC)
        info = machine_info()
        s5 = subprocess.run(["s5cmd", "version"], capture_output=True, text=True, check=False)
        info["s5cmd"] = s5.stdout.strip()
        source = source_info(REPO)
        cache = "dropped before every operation" if bench.drop else "warm (not dropped)"
        print()
        print(
            f"{now:%Y-%m-%d %H:%M} UTC, {info['cpus']} cores ({info['cpu_model']}), "
            f"S3 = {ep.kind} on loopback, checkpoint {raw_bytes / MB:,.0f} MB "
            f"(.metadata + {SHARDS} float32 shards), page cache {cache}, "
            f"median of {args.runs} round(s); MB/s is of the raw checkpoint size; "
            f"{describe_source(source_before, source)}, s5cmd {info['s5cmd']} (defaults)"
        )
        print()
        print(table)
        doc = {
            "command": reproduce_command(args),
            "date_utc": now.isoformat(timespec="seconds"),
            "machine": info,
            "source": source_before,
            "source_after": source,
            "server": {"kind": ep.kind, "url": ep.url},
            "checkpoint": {"files": len(expected), "bytes": raw_bytes, "seed": SEED},
            "page_cache": cache,
            "runs": args.runs,
            "total_seconds": round(time.monotonic() - started, 1),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "summary": rows,
            "samples": [{**dataclasses.asdict(s), "cpu_s": s.cpu} for s in bench.samples],
            "table_markdown": table,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json_out} (total {time.monotonic() - started:.0f} s)")
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
