"""Steps in use on this node right now (a prefetch writing one, or reading one as its base):
the hot dir's retention never evicts them. In memory: a restart ends every use."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from transfer.format.names import Key


class StepHolds:
    def __init__(self) -> None:
        self._count: Counter[Key] = Counter()

    @contextmanager
    def hold(self, *keys: Key | None) -> Iterator[None]:
        held = [k for k in keys if k is not None]
        self._count.update(held)
        try:
            yield
        finally:
            self._count.subtract(held)
            self._count += Counter()  # drop zero counts

    def held(self) -> set[Key]:
        return set(self._count)
