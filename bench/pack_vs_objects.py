"""Small chunks must not each cost a request round trip: pack them, or batch them? Measure.

Against a real S3 server (SeaweedFS on loopback, or ``FERRY_TEST_S3_ENDPOINT``), through the
library's own ``S3Store``, the same bytes split into chunks are written and read back as

* ``objects``: one object per chunk, ``put()`` / ``get()`` with ``window`` requests in flight
  (the "batch them" answer: hide each round trip behind concurrency);
* ``packed``: chunks concatenated into 8 MiB multipart parts of pack objects
  (``begin_upload`` / ``write_part`` / ``complete``), ``window`` parts in flight; read back
  as 8 MiB ranged GETs, split into chunks again (the "pack them" answer);
* ``packed (engine)``: the same through the engine's own ``PackWriter``.

Two cases: 1 MiB chunks (default 256 MiB) and 64 KiB chunks, the many-small-files case
(default 32 MiB). Every read-back is compared with what was written. Run from the repo root::

    python -m bench.pack_vs_objects

Results: a markdown table on stdout and ``bench/results/pack_vs_objects.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # also runnable as `python bench/pack_vs_objects.py`
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench._env import describe_source, machine_info, source_info  # noqa: E402
from bench._env import reproduce_command as env_reproduce_command  # noqa: E402
from tests.s3server import S3Endpoint, S3Server, start_s3_server  # noqa: E402
from transfer.engine.packer import PackWriter  # noqa: E402
from transfer.format.layout import pack_key  # noqa: E402
from transfer.store.s3 import S3Store  # noqa: E402
from transfer.store.s3config import S3Settings  # noqa: E402

RESULTS = REPO / "bench" / "results" / "pack_vs_objects.json"
MiB = 1 << 20
KiB = 1 << 10
MB = 1e6
PART_SIZE = 8 * MiB
PACK_SIZE = 256 * MiB
SEED = 7


class CountingS3Store(S3Store):
    """S3Store that counts the S3 API calls it makes, by operation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter[str] = Counter()

    async def call(self, method: str, what: str, **kwargs: Any) -> Any:
        self.requests[method] += 1
        return await super().call(method, what, **kwargs)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.requests["get_object"] += 1  # get() reads the body inside its own retry loop
        return await super().get(key, start, end)


@dataclass
class Measurement:
    case: str
    layout: str
    window: int
    run: int
    write_s: float
    write_requests: dict[str, int]
    read_s: float
    read_requests: dict[str, int]


@dataclass
class Layout:
    """Where each chunk went: objects keys, or (pack key, offset, length) per chunk."""

    object_keys: list[str] | None = None
    pack_slots: list[tuple[str, int, int]] | None = None


# -- the variants ----------------------------------------------------------------------


async def write_objects(store: S3Store, chunks: list[bytes], window: int) -> Layout:
    slots = asyncio.Semaphore(window)
    keys = [f"objects/{i:08d}" for i in range(len(chunks))]

    async def one(key: str, data: bytes) -> None:
        async with slots:
            await store.put(key, data)

    async with asyncio.TaskGroup() as tasks:
        for key, data in zip(keys, chunks, strict=True):
            tasks.create_task(one(key, data))
    return Layout(object_keys=keys)


async def write_packed(store: S3Store, chunks: list[bytes], window: int) -> Layout:
    """Chunks -> 8 MiB parts -> pack objects of up to 256 MiB; ``window`` parts in flight."""
    slots = asyncio.Semaphore(window)
    placed: list[tuple[str, int, int]] = []
    packs: list[tuple[str, list[bytes]]] = []  # pack key, its parts
    buf = bytearray()
    parts: list[bytes] = []
    pack_bytes = 0
    key = f"packs/{secrets.token_hex(8)}"
    for data in chunks:
        placed.append((key, pack_bytes, len(data)))
        buf += data
        pack_bytes += len(data)
        if len(buf) >= PART_SIZE:
            parts.append(bytes(buf))
            buf = bytearray()
        if pack_bytes >= PACK_SIZE:
            if buf:
                parts.append(bytes(buf))
                buf = bytearray()
            packs.append((key, parts))
            parts, pack_bytes, key = [], 0, f"packs/{secrets.token_hex(8)}"
    if buf:
        parts.append(bytes(buf))
    if parts:
        packs.append((key, parts))

    async def send(upload: Any, number: int, offset: int, data: bytes) -> None:
        async with slots:
            await upload.write_part(number, offset, data)

    async def one_pack(pack_key: str, pack_parts: list[bytes]) -> None:
        if len(pack_parts) == 1:  # what the engine does too: a single PUT beats 3 requests
            async with slots:
                await store.put(pack_key, pack_parts[0])
            return
        upload = await store.begin_upload(pack_key)
        async with asyncio.TaskGroup() as tasks:
            offset = 0
            for number, data in enumerate(pack_parts, start=1):
                tasks.create_task(send(upload, number, offset, data))
                offset += len(data)
        await upload.complete()

    async with asyncio.TaskGroup() as tasks:
        for pack_key, pack_parts in packs:
            tasks.create_task(one_pack(pack_key, pack_parts))
    return Layout(pack_slots=placed)


async def write_engine(store: S3Store, chunks: list[bytes], window: int) -> Layout:
    """The same through transfer.engine.packer.PackWriter (what `ferry push` runs)."""
    placed: list[tuple[str, int, int]] = []
    async with asyncio.TaskGroup() as tasks:
        writer = PackWriter(
            store,
            tasks,
            part_size=PART_SIZE,
            pack_size=PACK_SIZE,
            window=window,
            on_bytes_stored=lambda n: None,
        )
        for data in chunks:
            where = await writer.add(data)
            placed.append((pack_key(where.pack_id), where.offset, where.stored))
        await writer.finish()
    return Layout(pack_slots=placed)


async def read_back(store: S3Store, layout: Layout, window: int) -> list[bytes]:
    slots = asyncio.Semaphore(window)
    if layout.object_keys is not None:
        keys = layout.object_keys

        async def get(key: str) -> bytes:
            async with slots:
                return await store.get(key)

        async with asyncio.TaskGroup() as tasks:
            futures = [tasks.create_task(get(k)) for k in keys]
        return [f.result() for f in futures]

    assert layout.pack_slots is not None
    # group consecutive chunks of one pack into ranged GETs of up to PART_SIZE bytes
    ranges: list[tuple[str, int, int, list[int]]] = []  # key, start, end, chunk indexes
    for i, (key, offset, length) in enumerate(layout.pack_slots):
        if ranges:
            rkey, start, end, members = ranges[-1]
            if rkey == key and offset == end and offset + length - start <= PART_SIZE:
                ranges[-1] = (rkey, start, offset + length, [*members, i])
                continue
        ranges.append((key, offset, offset + length, [i]))
    out: list[bytes] = [b""] * len(layout.pack_slots)

    async def get_range(key: str, start: int, end: int, members: list[int]) -> None:
        async with slots:
            blob = await store.get(key, start, end)
        view = memoryview(blob)
        for i in members:
            _, offset, length = layout.pack_slots[i]  # type: ignore[index]
            out[i] = bytes(view[offset - start : offset - start + length])

    async with asyncio.TaskGroup() as tasks:
        for r in ranges:
            tasks.create_task(get_range(*r))
    return out


WRITERS: dict[str, Callable[[S3Store, list[bytes], int], Awaitable[Layout]]] = {
    "objects": write_objects,
    "packed": write_packed,
    "packed (engine PackWriter)": write_engine,
}


# -- driver ----------------------------------------------------------------------------


def open_store(ep: S3Endpoint, prefix: str, window: int) -> CountingS3Store:
    settings = S3Settings(
        ep.bucket,
        endpoint_url=ep.url,
        key=ep.access_key,
        secret=ep.secret_key,
        pool_size=window + 4,
    )
    return CountingS3Store(settings, prefix)


async def measure(
    ep: S3Endpoint, case: str, layout_name: str, chunks: list[bytes], window: int, run: int
) -> Measurement:
    store = open_store(ep, f"pvo-{secrets.token_hex(4)}", window)
    try:
        await store.check()  # session set up and one connection open before the clock starts
        store.requests.clear()
        t0 = time.perf_counter()
        layout = await WRITERS[layout_name](store, chunks, window)
        write_s = time.perf_counter() - t0
        write_requests = dict(store.requests)
        store.requests.clear()
        t0 = time.perf_counter()
        got = await read_back(store, layout, window)
        read_s = time.perf_counter() - t0
        read_requests = dict(store.requests)
        if got != chunks:
            bad = sum(a != b for a, b in zip(got, chunks, strict=True))
            raise SystemExit(f"WRONG RESULT: {case} {layout_name}: {bad} chunks differ")
        # delete what we wrote (untimed) so the server's disk stays small
        listing = await store.list("")
        sem = asyncio.Semaphore(32)

        async def delete(key: str) -> None:
            async with sem:
                await store.delete(key)

        async with asyncio.TaskGroup() as tasks:
            for obj in listing:
                tasks.create_task(delete(obj.key))
    finally:
        await store.close()
    return Measurement(
        case, layout_name, window, run, write_s, write_requests, read_s, read_requests
    )


def make_chunks(total: int, chunk_size: int, seed: int) -> list[bytes]:
    blob = np.random.default_rng(seed).bytes(total)
    return [blob[i : i + chunk_size] for i in range(0, total, chunk_size)]


def summarize(measurements: list[Measurement], totals: dict[str, int]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, int], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.case, m.layout, m.window), []).append(m)
    rows: list[dict[str, Any]] = []
    for (case, layout, window), ms in groups.items():
        w = statistics.median(m.write_s for m in ms)
        r = statistics.median(m.read_s for m in ms)
        rows.append(
            {
                "case": case,
                "layout": layout,
                "window": window,
                "runs": len(ms),
                "bytes": totals[case],
                "write_s": w,
                "write_mb_s": totals[case] / w / MB,
                "write_requests": sum(ms[0].write_requests.values()),
                "write_requests_by_op": ms[0].write_requests,
                "read_s": r,
                "read_mb_s": totals[case] / r / MB,
                "read_requests": sum(ms[0].read_requests.values()),
            }
        )
    for row in rows:
        packed = next(
            x
            for x in rows
            if x["case"] == row["case"] and x["layout"] == "packed" and x["window"] == 16
        )
        row["write_vs_packed"] = row["write_s"] / packed["write_s"]
        row["read_vs_packed"] = row["read_s"] / packed["read_s"]
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | layout | window | write s | write MB/s | write requests | write time "
        "vs packed | read s | read MB/s | read requests | read time vs packed |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['window']} | {r['write_s']:.2f} | "
            f"{r['write_mb_s']:.0f} | {r['write_requests']} | {r['write_vs_packed']:.2f}x | "
            f"{r['read_s']:.2f} | {r['read_mb_s']:.0f} | {r['read_requests']} | "
            f"{r['read_vs_packed']:.2f}x |"
        )
    return "\n".join(lines)


def reproduce_command(args: argparse.Namespace) -> str:
    argv = ["python", "-m", "bench.pack_vs_objects", "--mb", str(args.mb)]
    argv += ["--small-mb", str(args.small_mb), "--runs", str(args.runs)]
    argv += ["--big-window", str(args.big_window)]
    return env_reproduce_command(argv)


async def run_all(ep: S3Endpoint, args: argparse.Namespace) -> list[Measurement]:
    cases = [
        (f"1 MiB chunks, {args.mb} MiB", make_chunks(args.mb * MiB, MiB, SEED)),
        (f"64 KiB chunks, {args.small_mb} MiB", make_chunks(args.small_mb * MiB, 64 * KiB, SEED)),
    ]
    variants = [("objects", 16), ("packed", 16), ("packed (engine PackWriter)", 16)]
    if args.big_window:
        variants.append(("objects", args.big_window))
    # untimed warm-up: a fresh server allocates volumes on its first writes
    await measure(ep, "warm-up", "objects", cases[0][1][:64], 16, 0)
    await measure(ep, "warm-up", "packed", cases[0][1], 16, 0)
    out: list[Measurement] = []
    for run in range(1, args.runs + 1):
        order = variants if run % 2 else variants[::-1]  # alternate who goes first
        for case, chunks in cases:
            for layout_name, window in order:
                m = await measure(ep, case, layout_name, chunks, window, run)
                out.append(m)
                print(
                    f"  run {run} {case:<24} {layout_name:<27} w{window:<3} "
                    f"write {m.write_s:6.2f} s ({sum(m.write_requests.values()):5} req)  "
                    f"read {m.read_s:6.2f} s ({sum(m.read_requests.values()):5} req)",
                    flush=True,
                )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, default=256, help="MiB in 1 MiB chunks")
    parser.add_argument("--small-mb", type=int, default=32, help="MiB in 64 KiB chunks")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--big-window", type=int, default=64, help="extra objects row with this window (0: off)"
    )
    parser.add_argument("--json-out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(f"reproduce: {reproduce_command(args)}  (from the repo root)", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="ferry-pvo-"))
    server: S3Server | None = None
    started = time.monotonic()
    load_before = os.getloadavg()
    source_before = source_info(REPO)
    try:
        server = start_s3_server(workdir / "s3server")
        ep = server.endpoint
        print(f"S3 server: {ep.kind} at {ep.url}, bucket {ep.bucket}", flush=True)
        measurements = asyncio.run(run_all(ep, args))
        totals = {
            f"1 MiB chunks, {args.mb} MiB": args.mb * MiB,
            f"64 KiB chunks, {args.small_mb} MiB": args.small_mb * MiB,
        }
        rows = summarize(measurements, totals)
        table = markdown_table(rows)
        now = datetime.datetime.now(datetime.UTC)
        print()
        print(
            f"{now:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, S3 = {ep.kind} on loopback, "
            f"S3Store with crc32 checksums, median of {args.runs} run(s); "
            "'vs packed' = time / time of 'packed' at window 16 (>1 = slower); "
            f"{describe_source(source_before, source_info(REPO))}"
        )
        print()
        print(table)
        doc = {
            "command": reproduce_command(args),
            "date_utc": now.isoformat(timespec="seconds"),
            "machine": machine_info(),
            "source": source_before,
            "source_after": source_info(REPO),
            "server": {"kind": ep.kind, "url": ep.url},
            "part_size": PART_SIZE,
            "pack_size": PACK_SIZE,
            "summary": rows,
            "measurements": [asdict(m) for m in measurements],
            "table_markdown": table,
            "total_seconds": round(time.monotonic() - started, 1),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json_out} (total {time.monotonic() - started:.0f} s)")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
