"""Where a transfer's time goes: thread-seconds per stage, summed over the threads.

A pull reports receive, base_read, decode, hash and write; set next to each stage's limit
on the machine (bench/limits.py: S3 GET, disk, the codec, BLAKE3) they say which stage to
work on next. Adding up is cheap: a few hundred calls per GB.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class StageClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: defaultdict[str, float] = defaultdict(float)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:  # called from every worker thread
            self._seconds[stage] += seconds

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - began)

    def seconds(self, *stages: str) -> float:
        with self._lock:
            return sum(self._seconds[s] for s in stages)

    def to_dict(self) -> dict[str, float]:
        # microseconds: a small local pull spends well under a millisecond in some stages
        with self._lock:
            return {stage: round(s, 6) for stage, s in sorted(self._seconds.items())}
