"""Which transports should carry the S3 store's reads? Every candidate side by side against
the same server (SeaweedFS on loopback), on the two things a restore pays for:

- **start-up**: a fresh process that imports the client, makes it and lists a prefix (the
  first S3 answer a ``ferry pull`` waits for), page cache dropped before each run;
- **ranged pack reads**: every ``--part-mib`` range of 1 GiB of objects, from ``--threads``
  threads into reused buffers, as the pull's readers do, one arm per transport:

  - ``botocore``: ``get_object`` with a Range, its body read straight into the buffer;
  - ``obstore``: the store's read path without ``s3ranges`` (``s3objects.get``: obstore's
    reply buffer, then the copy into ours);
  - ``http.client``: ``s3ranges.HttpRanges.read_into`` (our SigV4, the socket's bytes
    received into the buffer);
  - ``s3fs``: ``S3FileSystem.cat_file`` (aiobotocore on its own event loop thread), copied in.

  Each arm is built here directly (no switch in the store: the benchmark picks the
  transport). Per arm: wall seconds, this process's CPU seconds (obstore's Rust threads
  included) and the server's, per GB read.

    python -m bench.s3_clients --runs 5

prints the table (medians, and the spread min-max over the rounds; arms interleaved, their
order rotated each round) and writes bench/results/s3_clients.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import obstore  # noqa: E402

from bench._env import write_results  # noqa: E402
from bench._measure import drop_caches  # noqa: E402
from tests.s3server import S3Endpoint, S3Server  # noqa: E402
from transfer.store import s3objects  # noqa: E402
from transfer.store.retry import RetryPolicy  # noqa: E402
from transfer.store.s3client import S3Client, S3Settings  # noqa: E402
from transfer.store.s3ranges import HttpRanges  # noqa: E402
from transfer.store.sigv4 import Credentials  # noqa: E402

OBJECTS, OBJECT_BYTES = 4, 256 << 20
PREFIX = "s3-clients/"
Read = Callable[[str, int, memoryview], int]

_START = {
    "botocore": """
import sys
sys.path.insert(0, {repo!r})
from transfer.store.retry import RetryPolicy
from transfer.store.s3client import S3Client, S3Settings
c = S3Client(S3Settings({bucket!r}, {url!r}, {key!r}, {secret!r}, pool_size=8), RetryPolicy())
c.call("list_objects_v2", "list", Prefix={prefix!r})
""",
    "obstore": """
import obstore
from obstore.store import S3Store
s = S3Store({bucket!r}, endpoint={url!r}, access_key_id={key!r}, secret_access_key={secret!r},
            region="us-east-1", client_options={{"allow_http": True}})
obstore.list(s, prefix={prefix!r}).collect()
""",
    "s3fs": """
import s3fs
fs = s3fs.S3FileSystem(key={key!r}, secret={secret!r}, endpoint_url={url!r})
fs.ls({bucket!r} + "/" + {prefix!r})
""",
}


def _settings(ep: S3Endpoint) -> S3Settings:
    return S3Settings(ep.bucket, ep.url, ep.access_key, ep.secret_key, pool_size=16)


def start_up_seconds(ep: S3Endpoint, script: str) -> float:
    drop_caches()
    code = script.format(
        repo=str(REPO), bucket=ep.bucket, url=ep.url, key=ep.access_key,
        secret=ep.secret_key, prefix=PREFIX,
    )  # fmt: skip
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - began


def _server_cpu(pid: int | None) -> float:
    """CPU seconds of the server process (and its reaped children) so far; 0 if unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def ranged_reads(read: Read, threads: int, part: int, server: int | None) -> dict[str, float]:
    """Every ``part`` of the objects through ``read``: seconds and CPU seconds."""
    jobs = [(f"{PREFIX}{i}", s) for i in range(OBJECTS) for s in range(0, OBJECT_BYTES, part)]
    local = threading.local()

    def one(job: tuple[str, int]) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(part))
        return read(job[0], job[1], buf)

    before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    server_before = _server_cpu(server)
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, jobs))
    took, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
    assert total == OBJECTS * OBJECT_BYTES, total
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"seconds": took, "cpu": cpu, "server_cpu": _server_cpu(server) - server_before}


def make_readers(ep: S3Endpoint) -> tuple[dict[str, Read], Callable[[], None]]:
    """One reader per transport, each built directly, and what closes them."""
    boto = S3Client(_settings(ep), RetryPolicy())
    ob = s3objects.make_store(_settings(ep))
    ranges = HttpRanges(ep.url, ep.bucket, Credentials(ep.access_key, ep.secret_key), "us-east-1")
    try:  # the bench extra's (pip install '.[bench]'): no store path imports it
        import s3fs
    except ImportError:
        s3fs = None
    fs = None if s3fs is None else s3fs.S3FileSystem(
        key=ep.access_key, secret=ep.secret_key, endpoint_url=ep.url,
        config_kwargs={"max_pool_connections": 16},
    )  # fmt: skip

    def via_botocore(key: str, start: int, buf: memoryview) -> int:
        reply = boto.call(
            "get_object", "get", Key=key, Range=f"bytes={start}-{start + len(buf) - 1}"
        )
        got, body = 0, reply["Body"]
        while got < len(buf) and (n := body.readinto(buf[got:])):
            got += n
        return got

    def via_obstore(key: str, start: int, buf: memoryview) -> int:
        got = s3objects.get(ob, key, start, start + len(buf))
        buf[: len(got)] = memoryview(got)
        return len(got)

    def via_http_client(key: str, start: int, buf: memoryview) -> int:
        return ranges.read_into(key, start, buf)

    def via_s3fs(key: str, start: int, buf: memoryview) -> int:
        assert fs is not None
        got = fs.cat_file(f"{ep.bucket}/{key}", start=start, end=start + len(buf))
        buf[: len(got)] = got
        return len(got)

    def close() -> None:
        boto.close()
        ranges.close()

    readers = {"botocore": via_botocore, "obstore": via_obstore,
               "http.client": via_http_client, "s3fs": via_s3fs}  # fmt: skip
    if fs is None:
        del readers["s3fs"]
    return readers, close


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-" + (
        f"{format(max(values), fmt)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--part-mib", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--no-start-up", action="store_true", help="skip the start-up arms")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferry-s3clients-") as tmp:
        server = S3Server(Path(tmp))
        with server as ep:
            pid = server._proc.pid if server._proc is not None else None
            readers, close = make_readers(ep)
            writer = S3Client(_settings(ep), RetryPolicy())
            for i in range(OBJECTS):
                writer.call("put_object", "put", Key=f"{PREFIX}{i}", Body=os.urandom(OBJECT_BYTES))
            writer.close()
            for read in readers.values():  # warm the server's cache and every pool
                ranged_reads(read, args.threads, args.part_mib[0] << 20, pid)
            starts: dict[str, list[float]] = {name: [] for name in _START}
            reads: dict[tuple[str, int], list[dict[str, float]]] = {
                (name, mib): [] for mib in args.part_mib for name in readers
            }
            names = list(readers)
            for run in range(args.runs):  # interleaved, rotated: drifts land on every arm
                if not args.no_start_up:
                    for name, script in _START.items():
                        if name in readers or name != "s3fs":
                            starts[name].append(start_up_seconds(ep, script))
                order = names[run % len(names) :] + names[: run % len(names)]
                for mib in args.part_mib:
                    for name in order:
                        got = ranged_reads(readers[name], args.threads, mib << 20, pid)
                        reads[(name, mib)].append(got)
                        print(f"run {run + 1} {mib} MiB {name}: {got}", file=sys.stderr)
            close()
    gb = OBJECTS * OBJECT_BYTES / 1e9
    rows: list[dict[str, Any]] = []
    for (name, mib), got in reads.items():
        rate = [gb * 1e3 / r["seconds"] for r in got]
        cpu = [r["cpu"] / gb for r in got]
        server_cpu = [r["server_cpu"] / gb for r in got]
        rows.append({
            "client": name, "part_mib": mib,
            "mb_per_s": statistics.median(rate), "mb_per_s_range": [min(rate), max(rate)],
            "cpu_per_gb": statistics.median(cpu), "cpu_per_gb_range": [min(cpu), max(cpu)],
            "server_cpu_per_gb": statistics.median(server_cpu),
            "runs": got,
        })  # fmt: skip
    start = {k: statistics.median(v) for k, v in starts.items() if v}
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = (
        f"python -m bench.s3_clients --runs {args.runs} --threads {args.threads} "
        f"--part-mib {' '.join(map(str, args.part_mib))}"
    )
    md = [
        "# bench.s3_clients", "", f"`{command}`", "",
        f"{when}, SeaweedFS on loopback, {os.cpu_count()} cores; medians of {args.runs} "
        f"interleaved rounds (min-max); obstore {obstore.__version__}", "",
        "| client | start to first list, cold cache, s |", "|---|---|",
        *(f"| {k} | {_spread(v, '.3f')} |" for k, v in starts.items() if v), "",
        f"Ranged reads of 1 GiB from {args.threads} threads into reused buffers:", "",
        "| client | range MiB | MB/s | client CPU s per GB | server CPU s per GB |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for r, (_, got) in zip(rows, reads.items(), strict=True):
        rate = [gb * 1e3 / x["seconds"] for x in got]
        cpu = [x["cpu"] / gb for x in got]
        md.append(
            f"| {r['client']} | {r['part_mib']} | {_spread(rate, '.0f')} | "
            f"{_spread(cpu, '.2f')} | {r['server_cpu_per_gb']:.2f} |"
        )
    text = "\n".join(md) + "\n"
    print(text)
    write_results(
        REPO / "bench" / "results", "s3_clients", command, when, text, start_up=start, reads=rows
    )


if __name__ == "__main__":
    main()
