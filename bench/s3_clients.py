"""Should the S3 read path move from botocore to obstore? Both clients side by side against
the same server (SeaweedFS on loopback), on the two things a restore pays for:

- **start-up**: a fresh process that imports the client, makes it and lists a prefix (the
  first S3 answer a ``ferry pull`` waits for), page cache dropped before each run;
- **ranged reads**: every 8 MiB range (the pull's ``part_size``) of 1 GiB of objects, from
  ``--threads`` threads into reused buffers, as the pull's readers do: botocore's body read
  straight into the buffer; obstore's ``get_range`` plus the
  copy into the buffer (its bytes live in a Rust buffer) and without that copy.

The measurement behind moving the reads to obstore (transfer/store/s3objects.py)::

    python -m bench.s3_clients --runs 3

prints the table and writes bench/results/s3_clients.{json,md}.
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
from transfer.store.retry import RetryPolicy  # noqa: E402
from transfer.store.s3client import S3Client, S3Settings  # noqa: E402

PART = 8 << 20
OBJECTS, OBJECT_BYTES = 4, 256 << 20
PREFIX = "s3-clients/"

_START_BOTOCORE = """
import sys
sys.path.insert(0, {repo!r})
from transfer.store.retry import RetryPolicy
from transfer.store.s3client import S3Client, S3Settings
c = S3Client(S3Settings({bucket!r}, {url!r}, {key!r}, {secret!r}, pool_size=8), RetryPolicy())
c.call("list_objects_v2", "list", Prefix={prefix!r})
"""
_START_OBSTORE = """
import obstore
from obstore.store import S3Store
s = S3Store({bucket!r}, endpoint={url!r}, access_key_id={key!r}, secret_access_key={secret!r},
            region="us-east-1", client_options={{"allow_http": True}})
obstore.list(s, prefix={prefix!r}).collect()
"""


def _botocore(ep: S3Endpoint) -> S3Client:
    settings = S3Settings(ep.bucket, ep.url, ep.access_key, ep.secret_key, pool_size=16)
    return S3Client(settings, RetryPolicy())


def _obstore(ep: S3Endpoint) -> Any:
    from obstore.store import S3Store

    return S3Store(
        ep.bucket, endpoint=ep.url, access_key_id=ep.access_key, secret_access_key=ep.secret_key,
        region="us-east-1", client_options={"allow_http": True},
    )  # fmt: skip


def start_up_seconds(ep: S3Endpoint, script: str) -> float:
    drop_caches()
    code = script.format(
        repo=str(REPO), bucket=ep.bucket, url=ep.url, key=ep.access_key,
        secret=ep.secret_key, prefix=PREFIX,
    )  # fmt: skip
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - began


def ranged_reads(read: Callable[[str, int, memoryview], int], threads: int) -> dict[str, float]:
    """Every ``PART`` of the objects through ``read``: seconds and CPU seconds."""
    jobs = [(f"{PREFIX}{i}", s) for i in range(OBJECTS) for s in range(0, OBJECT_BYTES, PART)]
    local = threading.local()

    def one(job: tuple[str, int]) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(PART))
        return read(job[0], job[1], buf)

    before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, jobs))
    took, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
    assert total == OBJECTS * OBJECT_BYTES, total
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"seconds": took, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferry-s3clients-") as tmp, S3Server(Path(tmp)) as ep:
        boto, ob = _botocore(ep), _obstore(ep)
        for i in range(OBJECTS):
            boto.call("put_object", "put", Key=f"{PREFIX}{i}", Body=os.urandom(OBJECT_BYTES))

        def via_botocore(key: str, start: int, buf: memoryview) -> int:
            reply = boto.call(
                "get_object", "get", Key=key, Range=f"bytes={start}-{start + len(buf) - 1}"
            )
            got, body = 0, reply["Body"]
            while got < len(buf) and (n := body.readinto(buf[got:])):
                got += n
            return got

        def via_obstore(key: str, start: int, buf: memoryview) -> int:
            got = obstore.get_range(ob, key, start=start, length=len(buf))
            buf[: len(got)] = memoryview(got)
            return len(got)

        def via_obstore_no_copy(key: str, start: int, buf: memoryview) -> int:
            return len(obstore.get_range(ob, key, start=start, length=len(buf)))

        readers = {"botocore": via_botocore, "obstore": via_obstore,
                   "obstore, no copy": via_obstore_no_copy}  # fmt: skip
        ranged_reads(via_botocore, args.threads)  # warm the server's cache and both pools
        ranged_reads(via_obstore, args.threads)
        starts: dict[str, list[float]] = {"botocore": [], "obstore": []}
        reads: dict[str, list[dict[str, float]]] = {name: [] for name in readers}
        for _ in range(args.runs):  # interleaved: drifts land on both
            starts["botocore"].append(start_up_seconds(ep, _START_BOTOCORE))
            starts["obstore"].append(start_up_seconds(ep, _START_OBSTORE))
            for name, read in readers.items():
                reads[name].append(ranged_reads(read, args.threads))
        boto.close()
    gb = OBJECTS * OBJECT_BYTES / 1e9
    rows: list[dict[str, Any]] = []
    for name, got in reads.items():
        secs = statistics.median(r["seconds"] for r in got)
        cpu = statistics.median(r["cpu"] for r in got)
        rows.append({"client": name, "mb_per_s": gb * 1e3 / secs, "cpu_per_gb": cpu / gb})
    start = {k: statistics.median(v) for k, v in starts.items()}
    base = rows[0]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = f"python -m bench.s3_clients --runs {args.runs} --threads {args.threads}"
    md = [
        "# bench.s3_clients", "", f"`{command}`", "",
        f"{when}, SeaweedFS on loopback, medians of {args.runs} interleaved runs; obstore "
        f"{obstore.__version__}", "",
        "| client | start to first list, cold cache, s | ranged reads MB/s | CPU s per GB "
        "| CPU / botocore |", "|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        s = start.get(str(r["client"]))
        md.append(
            f"| {r['client']} | {'' if s is None else f'{s:.3f}'} | {r['mb_per_s']:.0f} "
            f"| {r['cpu_per_gb']:.2f} | {r['cpu_per_gb'] / base['cpu_per_gb']:.2f}x |"
        )
    text = "\n".join(md) + "\n"
    print(text)
    write_results(
        REPO / "bench" / "results", "s3_clients", command, when, text, start_up=start, reads=rows
    )


if __name__ == "__main__":
    main()
