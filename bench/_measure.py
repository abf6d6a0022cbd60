"""Measuring one command: wall clock, its own CPU and peak RSS, the S3 server's CPU, noise.

Shared by the benchmark scripts. Also: dropping the page cache, and checking a restored
tree byte for byte against its source.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import blake3


def local_corpus_args(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of a benchmark on one variant of the real-training corpus, on a local
    disk (bench.local_push, bench.local_restore)."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="python -m bench.corpus DIR")
    ap.add_argument("--variant", default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    results = Path(__file__).resolve().parent / "results"
    ap.add_argument("--out-dir", type=Path, default=results)
    return ap.parse_args(argv)


def tree_digest(root: Path) -> dict[str, tuple[int, str]]:
    """relative path -> (size, BLAKE3) of every regular file under ``root``."""
    out: dict[str, tuple[int, str]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            h.update_mmap(path)
            out[path.relative_to(root).as_posix()] = (path.stat().st_size, h.hexdigest())
    return out


def check_same(expected: dict[str, tuple[int, str]], got_root: Path, what: str) -> None:
    got = tree_digest(got_root)
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        differ = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise SystemExit(
            f"WRONG RESULT from {what}: missing {missing}, extra {extra}, differing {differ}"
        )


def drop_caches() -> bool:
    """Write back and drop the page cache (needs root); False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


BLKIO = Path("/sys/fs/cgroup/blkio")


def whole_disk(path: Path) -> str:
    """``MAJ:MIN`` of the disk (not the partition) holding ``path``: what a blkio throttle
    rule names."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (sys_dev / "partition").exists():
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


@contextlib.contextmanager
def throttled_disk(path: Path, bytes_per_second: float | None) -> Iterator[None]:
    """This process (and every process it starts from now on) reads and writes the disk
    holding ``path`` at most ``bytes_per_second`` each way: a second, slower disk for a
    benchmark, made of this one (a cgroup-v1 blkio throttle, which holds direct I/O; needs
    root). Processes started before (the S3 server) are not throttled. None: as it is."""
    if not bytes_per_second:
        yield
        return
    group = BLKIO / f"ferry-bench-{os.getpid()}"
    if not BLKIO.is_dir():
        raise SystemExit(f"--disk-mbps needs the cgroup-v1 blkio controller at {BLKIO}")
    group.mkdir(exist_ok=True)
    rule = f"{whole_disk(path)} {int(bytes_per_second)}\n"
    for way in ("read", "write"):
        (group / f"blkio.throttle.{way}_bps_device").write_text(rule)
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")
        for pid in (group / "cgroup.procs").read_text().split():  # children left in it
            with contextlib.suppress(OSError):
                (BLKIO / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            group.rmdir()


def _device_counters(path: Path) -> tuple[int, ...] | None:
    """(I/Os in flight, writes completed, discards completed) of the block device holding
    ``path``, from /sys/dev/block (Linux); None where it cannot be read."""
    dev = os.stat(path).st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    in_flight, writes = int(fields[8]), int(fields[4])
    discards = int(fields[11]) if len(fields) > 11 else 0
    return in_flight, writes, discards


def device_bytes(path: Path) -> tuple[int, int] | None:
    """(bytes read, bytes written) since boot by the block device holding ``path``, from
    /sys/dev/block (Linux; sectors of 512 bytes); None where it cannot be read."""
    dev = os.stat(path).st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    return int(fields[2]) * 512, int(fields[6]) * 512


def settle(path: Path, quiet: float = 1.0, limit: float = 120.0) -> float:
    """Write back, then wait until the machine has been quiet for ``quiet`` seconds, at most
    ``limit``: the disk holding ``path`` idle (nothing in flight, no write or discard
    completed) and the cores under a tenth busy; the seconds waited. On a
    ``discard``-mounted ext4 a deleted work dir is trimmed in the background for seconds
    after ``rm``, and an S3 server may still be settling the objects it took: a case timed
    then runs on a machine doing other work."""
    os.sync()
    began = time.monotonic()
    last, busy = _device_counters(path), system_busy_seconds()
    still_since = began
    while last is not None and busy is not None and time.monotonic() - began < limit:
        time.sleep(0.1)
        now, busy_now = _device_counters(path), system_busy_seconds()
        cpu_busy = (busy_now or 0.0) - busy > 0.1 * 0.1 * (os.cpu_count() or 1)
        if now != last or (now is not None and now[0]) or cpu_busy:
            still_since = time.monotonic()
        elif time.monotonic() - still_since >= quiet:
            break
        last, busy = now, busy_now
    return time.monotonic() - began


def proc_cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a running process from /proc (Linux), None if unavailable."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # fields 14 and 15 of stat(5)


def system_busy_seconds() -> float | None:
    """CPU seconds every core has spent busy since boot (/proc/stat), None if unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: everything but idle and iowait
    busy = sum(int(x) for i, x in enumerate(fields[1:9]) if i not in (3, 4))
    return busy / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    cpu_user: float
    cpu_sys: float
    peak_rss_mb: float
    server_cpu: float | None
    other_cpu: float | None  # busy CPU seconds of everything else on the machine meanwhile


# Measuring a child's peak RSS needs care: Linux keeps ``maxrss`` across exec, and Python
# spawns through vfork, so a child's ru_maxrss starts at *this* process's high-water mark
# (hundreds of MB after generating and hashing the checkpoint). A tiny launcher (python -S,
# ~10 MB) forks the real command, waits for it and reports its rusage and wall clock, so
# the numbers belong to the command alone (floor: the launcher's ~10 MB).
_LAUNCHER = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
seconds = time.perf_counter() - t0
with open(sys.argv[1], "w") as f:
    json.dump({"seconds": seconds, "utime": ru.ru_utime, "stime": ru.ru_stime,
               "maxrss_kib": ru.ru_maxrss}, f)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_timed(argv: Sequence[str], env: dict[str, str], server_pid: int | None) -> Ran:
    """Run ``argv`` to completion: wall clock and the command's own rusage (via wait4)."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".json") as usage_file,
    ):
        launcher = [sys.executable, "-S", "-c", _LAUNCHER, usage_file.name, *argv]
        srv0 = proc_cpu_seconds(server_pid)
        busy0 = system_busy_seconds()
        proc = subprocess.run(
            launcher, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, check=False
        )
        srv1 = proc_cpu_seconds(server_pid)
        busy1 = system_busy_seconds()
        usage = json.loads(Path(usage_file.name).read_text() or "{}")
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        if not usage:
            raise SystemExit(f"launcher failed for {shlex.join(argv)}: {stderr[-2000:]}")
        return Ran(
            returncode=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=stderr,
            seconds=usage["seconds"],
            cpu_user=usage["utime"],
            cpu_sys=usage["stime"],
            peak_rss_mb=usage["maxrss_kib"] / 1024,  # KiB on Linux
            server_cpu=None if srv0 is None or srv1 is None else srv1 - srv0,
            other_cpu=None
            if busy0 is None or busy1 is None
            else max(
                0.0,
                busy1
                - busy0
                - usage["utime"]
                - usage["stime"]
                - (0.0 if srv0 is None or srv1 is None else srv1 - srv0),
            ),
        )
