"""A dependency-free progress line on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time

from transfer.units import format_rate, format_size


class TerminalProgress:
    def __init__(self) -> None:
        self._total = 0
        self._done = 0
        self._what = ""
        self._started = 0.0
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def start(self, total_bytes: int, what: str) -> None:
        self._total, self._done, self._what = total_bytes, 0, what
        self._started = time.monotonic()

    def started_ago(self, seconds: float) -> None:
        """The transfer began ``seconds`` ago (an agent's pull, told late: its rate)."""
        self._started = time.monotonic() - seconds

    def advance(self, nbytes: int) -> None:
        with self._lock:  # called from worker threads too
            self._done += nbytes
            now = time.monotonic()
            if now - self._last_draw >= 0.2:
                self._last_draw = now
                self._draw(now)

    def finish(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    def _draw(self, now: float) -> None:
        frac = self._done / self._total if self._total else 1.0
        rate = format_rate(self._done, now - self._started)
        bar = "#" * int(frac * 30)
        sys.stderr.write(
            f"\r\033[K{self._what} [{bar:<30}] {frac:6.1%} {format_size(self._done)}/"
            f"{format_size(self._total)} {rate}"
        )
        sys.stderr.flush()
