"""Progress reporting: the engine calls ``advance``; the CLI decides how to show it."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total_bytes: int, what: str) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class NoProgress:
    def start(self, total_bytes: int, what: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass
