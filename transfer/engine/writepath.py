"""How a restore writes its chunks: past the page cache with O_DIRECT, or into it.

What comes next decides (issue 32): the training process loads the restored checkpoint at
once. Written buffered, its bytes are still in memory then, and the load reads memory;
written with O_DIRECT, the load reads the disk again. But a buffered write fills fresh
page-cache pages, and what that costs is the machine's: on the 2-core benchmark VM,
ferry's parallel buffered writes cost ~5 ms of system time per MiB (a 272 MB restore
0.64 s direct against 2.0 s buffered; the 1.69 GB save 3.1 s against 9.6-12.6 s), while
the disk read they spare the load is ~1 ms per MiB (the load 0.81 s from disk against
0.50 s from memory). Direct is the default (``write_path = "direct"``); ``"auto"`` writes
buffered when the restore fits in what the node can spare, for machines where filling
the page cache is cheap, and ``"buffered"`` always. The figures, with the commands, are in
docs/RELIABILITY.md ("How a restore writes").

"What the node can spare": the kernel's ``MemAvailable`` less a reserve (``RESERVE_FRACTION``
of the total, at least ``RESERVE_MIN``), of which a restore may fill ``SHARE``: a restore
larger than that would only push other pages out, the training process's among them, and
be read from the disk anyway. The crash guarantee is the same either way: a restore is
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


def writes_direct(nbytes: int, chosen: str) -> bool:
    """Whether a restore writing ``nbytes`` goes with O_DIRECT, by the ``write_path``
    tunable ``chosen`` (auto, direct, buffered); only ``auto`` reads the kernel's meminfo."""
    if chosen != "auto":
        return chosen == "direct"
    spare = spare_memory()
    return spare is None or nbytes > spare


def auto_on_this_machine(direct_rate: float, buffered_rate: float) -> str:
    """What ``auto`` becomes on a node whose probes (writeprobe.py) wrote at these rates:
    "auto" (buffered when it fits) where filling the page cache is at least as fast as
    writing to the device, so the load that follows reads memory at no cost to the
    restore; "direct" where the page cache is the slower way (one VM: ~5 ms of system time
    per MiB buffered, the load's cheaper read did not pay for it)."""
    return "auto" if buffered_rate >= direct_rate else "direct"
