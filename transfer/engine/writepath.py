"""How a restore writes its chunks: past the page cache with O_DIRECT, or into it, and
whether it is left in the page cache for the load that follows.

What comes next decides (issue 32): the training process loads the restored checkpoint at
once. The four ways (the ``write_path`` tunable):

- ``"warm"`` (the default): O_DIRECT, and each chunk read back into the page cache by the
  kernel as soon as its write returns (warmcache.py), when the restore fits in what the
  node can spare; the load then reads memory, and no CPU copied the bytes into fresh pages.
  Where the disk falls behind, the rest goes buffered (it would read every chunk back
  beside writing it: staging.py ``WARM_MIN_DIRECT_RATE``). A restore too big for spare
  memory goes plain direct.
- ``"direct"``: O_DIRECT only; the load reads the disk again.
- ``"buffered"``: into the page cache; the load reads memory, but every byte is copied into
  fresh page-cache pages, which on a VM whose free memory goes back to its host costs
  ~2.3 ms of system time per MiB (warmcache.py), and the dirty pages are written back
  while the load runs.
- ``"auto"``: buffered when it fits, else direct; on an agent, which probes both ways of
  writing at its start, buffered only where the page cache took the bytes at least as
  fast as the device (a slow disk beside cheap memory), else warm.

From the scheduler's decision to every tensor loaded (bench/decision_to_loaded.py), the
figures with their commands are in docs/RELIABILITY.md ("How a restore writes").

"What the node can spare": the kernel's ``MemAvailable`` less a reserve (``RESERVE_FRACTION``
of the total, at least ``RESERVE_MIN``), of which a restore may fill ``SHARE``: a restore
larger than that would only push other pages out, the training process's among them, and
be read from the disk anyway. The crash guarantee is the same every way: a restore is
renamed into place behind a durable ``.ferry-unsynced`` marker and removed after a reboot
that came before its flush (settle.py)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
RESERVE_FRACTION = 0.10
RESERVE_MIN = 1 << 30
SHARE = 0.5


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
    reserve = max(int(total * RESERVE_FRACTION), RESERVE_MIN)
    return max(0, int((available - reserve) * SHARE))


def restore_path(nbytes: int, chosen: str) -> str:
    """How a restore writing ``nbytes`` goes, by the ``write_path`` tunable ``chosen``:
    "warm", "direct" or "buffered" (only ``warm`` and ``auto`` read the kernel's meminfo)."""
    if chosen in ("direct", "buffered"):
        return chosen
    spare = spare_memory()
    if spare is None or nbytes > spare:
        return "direct"
    return "warm" if chosen == "warm" else "buffered"


def fits_in_spare_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` may be left in the page cache now (a held step warmed for its
    load: warmcache.py)."""
    spare = spare_memory()
    return spare is not None and nbytes <= spare


def auto_on_this_machine(direct_rate: float, buffered_rate: float) -> str:
    """What ``auto`` becomes on a node whose probes (writeprobe.py) wrote at these rates:
    "auto" (buffered when it fits) where filling the page cache is at least as fast as
    writing to the device (a slow disk beside cheap memory: the bytes reach the load
    sooner through memory), "warm" where the page cache is the slower way (one VM: ~5 ms
    of system time per MiB buffered, into pages its host had taken back)."""
    return "auto" if buffered_rate >= direct_rate else "warm"
