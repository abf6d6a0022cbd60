"""The physical limits next to which the tools are judged, measured on this machine now.

- disk: ``dd`` of ``size`` bytes with O_DIRECT (write, then read), so the page cache is out
  of the way either side (GNU dd's oflag/iflag=direct), then a buffered read of them beside
  a direct write of as many (a pull onto a node holding k reads k and writes k+1);
- the S3 server: one PUT of a ``size``-byte object and one GET of it, through a plain
  botocore client (unsigned payload, no checksums), the body read into a reused buffer;
- memory: numpy ``copyto`` of a 256 MiB array (best of 3);
- ferry's codec on the benchmark's own data: encode (choose + transform + zstd-1, deltas
  against the previous save) and decode + BLAKE3 verify, on as many threads as cores;
  BLAKE3 alone.
Results in MB/s (1e6 bytes per second).
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench._measure import drop_caches
from tests.s3server import S3Endpoint

MB = 1e6


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args], check=True)
    return time.perf_counter() - t0


def disk(scratch: Path, size: int) -> dict[str, float]:
    """Direct write, direct read, and a buffered read beside a direct write of as many
    bytes: what a pull onto a node holding k asks of the disk (read k, write k+1), rated as
    the bytes of either side per second of the pair."""
    path, other = scratch / "dd.bin", scratch / "dd2.bin"
    count = max(1, size // (8 << 20))
    nbytes = count * (8 << 20)
    write = ["if=/dev/zero", "bs=8M", f"count={count}", "oflag=direct", "status=none"]
    try:
        w = _dd([*write, f"of={path}"])
        drop_caches()
        r = _dd([f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct", "status=none"])
        drop_caches()
        t0 = time.perf_counter()
        both = [
            subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=8M", "status=none"]),
            subprocess.Popen(["dd", *write, f"of={other}"]),
        ]
        if any(p.wait() for p in both):
            raise RuntimeError("dd failed")
        rw = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
    return {
        "disk_write_direct": nbytes / w / MB,
        "disk_read_direct": nbytes / r / MB,
        "disk_read_beside_direct_write": nbytes / rw / MB,
    }


def s3_raw(ep: S3Endpoint, scratch: Path, size: int) -> dict[str, float]:
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=ep.url,
        aws_access_key_id=ep.access_key,
        aws_secret_access_key=ep.secret_key,
        region_name="us-east-1",
        config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"payload_signing_enabled": False},
        ),
    )
    path = scratch / "s3raw.bin"
    with path.open("wb") as fh:  # incompressible is irrelevant here: nobody compresses
        fh.truncate(size)
    key = "limits/one-big-object"
    try:
        with path.open("rb") as body:
            t0 = time.perf_counter()
            client.put_object(Bucket=ep.bucket, Key=key, Body=body, ContentLength=size)
            put = time.perf_counter() - t0
        buf = memoryview(bytearray(8 << 20))
        t0 = time.perf_counter()
        raw = client.get_object(Bucket=ep.bucket, Key=key)["Body"]._raw_stream
        while raw.readinto(buf):
            pass
        get = time.perf_counter() - t0
        client.delete_object(Bucket=ep.bucket, Key=key)
    finally:
        path.unlink(missing_ok=True)
        client.close()
    return {"s3_put_one_object": size / put / MB, "s3_get_one_object": size / get / MB}


def memcpy() -> dict[str, float]:
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
    return {"memcpy": a.nbytes / best / MB}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def codec(k: Path, k1: Path, limit: int, chunk: int = 4 << 20) -> dict[str, float]:
    """Encode save k+1 chunk by chunk against save k (as a push does), then decode + verify."""
    from transfer.codec import decode, encode
    from transfer.format.chunkid import chunk_id

    pairs: list[tuple[bytes, bytes]] = []
    for name in sorted(p.name for p in k1.iterdir() if p.is_file()):
        new, old = (k1 / name).read_bytes(), (k / name).read_bytes()
        for lo in range(0, len(new), chunk):
            pairs.append((new[lo : lo + chunk], old[lo : lo + chunk]))
            if sum(len(n) for n, _ in pairs) >= limit:
                break
    raw = sum(len(n) for n, _ in pairs)
    workers = os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        coded = list(pool.map(lambda p: encode(p[0], 1, p[1]), pairs))
        enc_s = time.perf_counter() - t0

        def dec(i: int) -> None:
            enc, payload = coded[i]
            data = decode(enc, payload, len(pairs[i][0]), pairs[i][1])
            chunk_id(data)

        t0 = time.perf_counter()
        list(pool.map(dec, range(len(pairs))))
        dec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(lambda p: chunk_id(p[0]), pairs))
        hash_s = time.perf_counter() - t0
    stored = sum(len(p) for _, p in coded)
    return {
        "codec_encode": raw / enc_s / MB,
        "codec_decode_verify": raw / dec_s / MB,
        "blake3": raw / hash_s / MB,
        "codec_ratio": raw / stored,
    }
