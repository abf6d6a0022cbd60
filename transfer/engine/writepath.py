"""How a restore writes its chunks: into the page cache, or past it with O_DIRECT.

What comes next decides (issue 32). The next reader of a restored checkpoint is the
training process loading it, at once. Written buffered, the bytes are still in memory when
it reads them: the load reads memory, and the kernel writes the pages back meanwhile
(settle.py flushes what is left once the scheduler has its answer). Written with O_DIRECT,
the restore itself is a little cheaper (no page-cache copy, no first touches of fresh
pages) but the load pays the disk again. So: buffered when the step fits in what the node
can spare, O_DIRECT when it does not (a restore larger than free memory would only push
other pages out, the training process's among them, and be read from the disk anyway).

"What the node can spare": the kernel's ``MemAvailable`` less a reserve (``RESERVE_FRACTION``
of the total, at least ``RESERVE_MIN``), of which a restore may fill ``SHARE``. Measured in
docs/RELIABILITY.md ("How a restore writes"). The crash guarantee is the same either way:
a restore is renamed into place behind a durable ``.ferry-unsynced`` marker and removed
after a reboot that came before its flush (settle.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
RESERVE_FRACTION = 0.10
RESERVE_MIN = 1 << 30
SHARE = 0.5


@dataclass(frozen=True)
class WritePath:
    direct: bool
    why: str  # one line, for the pull's result and the log

    @property
    def name(self) -> str:
        return "direct" if self.direct else "buffered"


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


def choose_write_path(nbytes: int, direct_allowed: bool, spare: int | None) -> WritePath:
    """``nbytes``: what the restore writes; ``direct_allowed``: the ``direct_writes``
    tunable; ``spare``: ``spare_memory()``."""
    if not direct_allowed:
        return WritePath(False, "direct_writes is off")
    if spare is None:
        return WritePath(True, "free memory unknown")
    if nbytes <= spare:
        return WritePath(False, f"{nbytes} bytes fit in the {spare} the page cache can spare")
    return WritePath(True, f"{nbytes} bytes exceed the {spare} the page cache can spare")
