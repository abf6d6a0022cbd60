"""How a restore writes its chunks: past the page cache with O_DIRECT, or into it, and
whether it is left in the page cache for the load that follows.

What comes next decides (issue 32): the training process loads the restored checkpoint at
once. The four ways (the ``write_path`` tunable):

- ``"auto"`` (the default): on an agent, which probes both ways of writing at its start
  (a few rounds, the best of each: agent/node/prefetch.py ``measure_disk``),
  buffered where the page cache took the bytes at least as fast as warm's disk work, a
  write and a read back (a slow disk, cheap memory, or a fast disk whose page cache is
  faster still: ``page_cache_first``), else warm. The one-shot
  CLI does not probe (64 MiB written a few times each way per command would cost more
  than it saves): it takes what an agent of its user and XDG_STATE_HOME chose for that disk this
  boot (agent/node/writechoice.py), else warm. Either way, plain direct for a restore too
  big for spare memory.
- ``"warm"``: O_DIRECT, and each chunk read back into the page cache by the kernel as soon
  as its write returns (warmcache.py), when the restore fits in what the node can spare;
  the load then reads memory, and no CPU copied the bytes into fresh pages. A restore too
  big for spare memory goes plain direct. On a slow disk the read-back doubles the disk's
  work (1.04-1.22x direct's wait at 280 MB/s), which is why ``auto`` buffers there.
- ``"direct"``: O_DIRECT only; the load reads the disk again.
- ``"buffered"``: into the page cache; the load reads memory, but every byte is copied into
  fresh page-cache pages, which on a VM whose free memory goes back to its host costs
  ~2.3 ms of system time per MiB (warmcache.py), and the dirty pages are written back
  while the load runs.

From the scheduler's decision to every tensor loaded (bench/decision_to_loaded.py), the
figures with their commands are in docs/RELIABILITY.md ("How a restore writes").

"What the node can spare": the kernel's ``MemAvailable`` less a reserve (``RESERVE_FRACTION``
of the total, at least ``RESERVE_MIN``), and under a memory cgroup's limit (a container) at
most what the limit leaves of its working set (as kubelet counts it) less a margin for the
process's own memory (``CGROUP_MARGIN_*``), of which a restore may fill ``SHARE``: a restore
larger than that would only push other pages out, the training process's among them, and
be read from the disk anyway. The crash guarantee is the same every way: a restore is
renamed into place behind a durable ``.ferry-unsynced`` marker and removed after a reboot
that came before its flush (settle.py)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
RESERVE_FRACTION = 0.10
RESERVE_MIN = 1 << 30
SHARE = 0.5
#: of a memory cgroup's limit, what is left for the process's own memory (a restore's
#: buffers: TransferOptions.memory_estimate) before the page cache or a replica may use it
CGROUP_MARGIN_FRACTION = 0.25
CGROUP_MARGIN_MIN = 256 << 20


def spare_memory(meminfo: Path | None = None) -> int | None:
    """Bytes a restore may leave in the page cache now, or None when the kernel does not
    say (no /proc/meminfo, a field missing)."""
    try:
        lines = (meminfo or MEMINFO).read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    spare = available - max(int(total * RESERVE_FRACTION), RESERVE_MIN)
    room = cgroup_room()
    if room is not None:  # in a container: what its limit leaves, less the agent's own room
        limit, left = room
        spare = min(spare, left - max(int(limit * CGROUP_MARGIN_FRACTION), CGROUP_MARGIN_MIN))
    return max(0, int(spare * SHARE))


#: a cgroup v1 "no limit" (the largest page-aligned int64)
_NO_LIMIT = 1 << 62


def cgroup_room(root: Path | None = None, cgroup: Path | None = None) -> tuple[int, int] | None:
    """(limit, what it leaves) of this process's memory cgroup, v2 or v1 (what it leaves:
    the limit less the usage that the kernel cannot simply drop: usage less inactive
    file pages), or None when no limit applies or none can be read."""
    root = root or CGROUP_ROOT
    try:
        lines = (cgroup or Path("/proc/self/cgroup")).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, where = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            names, base = ("memory.max", "memory.current", "inactive_file"), root
        elif "memory" in controllers.split(","):
            names, base = (
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                root / "memory",
            )
        else:
            continue
        # (inside a container its own cgroup is often mounted at the root)
        for directory in (base / where.strip("/"), base):
            found = _cgroup_numbers(directory, *names)
            if found is not None:
                return found
    return None


def _cgroup_numbers(
    directory: Path, limit_name: str, usage_name: str, inactive_name: str
) -> tuple[int, int] | None:
    try:
        limit_text = (directory / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        limit, usage = int(limit_text), int((directory / usage_name).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
        inactive = int(stat.get(inactive_name, 0))
    except (OSError, ValueError):
        return None
    return limit, max(0, limit - max(0, usage - inactive))


def restore_path(nbytes: int, chosen: str, page_cache_first: bool = False) -> str:
    """How a restore writing ``nbytes`` goes, by the ``write_path`` tunable ``chosen``:
    "warm", "direct" or "buffered" (only ``warm`` and ``auto`` read the kernel's meminfo;
    ``auto`` buffers where ``page_cache_first``, else goes warm)."""
    if chosen in ("direct", "buffered"):
        return chosen
    spare = spare_memory()
    if spare is None or nbytes > spare:
        return "direct"
    return "buffered" if chosen == "auto" and page_cache_first else "warm"


def fits_in_spare_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` may be left in the page cache now (a held step warmed for its
    load: warmcache.py)."""
    spare = spare_memory()
    return spare is not None and nbytes <= spare


def page_cache_first(
    direct_rate: float, buffered_rate: float, read_rate: float | None = None
) -> bool:
    """Whether ``auto`` buffers on a node whose probes (writeprobe.py) wrote at these
    rates: where filling the page cache is at least as fast as the way it would go
    instead, warm, which writes each byte to the device and has the kernel read it back
    (``read_rate``: the device's, past the page cache; None: not known, the write alone
    counts). So: a slow disk beside memory (0.67-0.74x direct's wait to loaded tensors at
    280 MB/s, where warm's read-back doubled the disk's work), and a fast one whose page
    cache is faster still (2026-12-07, 1.4 GB/s direct, 1.3 GB/s buffered, 1.75 GB/s read:
    from a pull's start to the load's end, buffered 0.72x direct, warm 1.03x); not where
    the page cache is the slower way (one VM: ~5 ms of system time per MiB buffered, into
    pages its host had taken back)."""
    return buffered_rate >= warm_rate(direct_rate, read_rate)


def warm_rate(direct_rate: float, read_rate: float | None) -> float:
    """The rate a warm restore's disk takes bytes at: written, then read back."""
    if not read_rate:
        return direct_rate
    return 1.0 / (1.0 / direct_rate + 1.0 / read_rate)
