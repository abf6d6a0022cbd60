"""Which checkpoints a tier keeps: a pure function of the steps it holds and its policy.

Rules, per job (restic's ``forget`` works the same way: the keep rules are a union):

* ``keep_last`` N: the newest N complete steps;
* ``keep_every`` K: every step that is a multiple of K (long-term milestones);
* ``max_age``: a step older than this is expired even if a keep rule selected it;
* ``budget_bytes``: then the oldest kept steps are dropped until the tier fits;
* with no count rule set, every step is kept by count (age and budget still apply).

Whatever the rules say, these are never dropped (``Protection``): the newest complete step
of each job, pinned steps, and steps newer than the newest complete one (another node may
still be uploading its part). Delta chains need no rule here: a retained manifest keeps
every pack its chunks and bases live in (docs/FORMAT.md, "Concurrency and garbage").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from transfer.format.names import Key

# re-exported: plans print sizes as every command does (decimal units)
from transfer.units import format_size as format_size

# Reasons a step is kept, as printed in plans.
NEWEST = "newest complete"
PINNED = "pinned"
IN_PROGRESS = "newer than the newest complete step"
#: no step of the job is known whole (several nodes' parts and no completion markers: a
#: multi-node job pushed by hand), so none may go until its nodes are named
NONE_COMPLETE = "no step of the job known complete (its nodes unnamed? --expected-nodes)"
KEEP_LAST = "keep_last"
KEEP_EVERY = "keep_every"
NO_LIMIT = "no count limit"
PROTECTED = frozenset({NEWEST, PINNED, IN_PROGRESS, NONE_COMPLETE})


@dataclass(frozen=True)
class TierPolicy:
    keep_last: int | None = None
    keep_every: int | None = None
    max_age_s: float | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_age_s is not None and not 0 < self.max_age_s < float("inf"):
            raise ValueError(f"max_age must be a positive duration, got {self.max_age_s!r}")

    @property
    def keeps_everything(self) -> bool:
        return (
            self.keep_last is None
            and self.keep_every is None
            and self.max_age_s is None
            and (self.budget_bytes is None)
        )

    def describe(self) -> str:
        parts = [
            f"keep_last={self.keep_last}" if self.keep_last else "",
            f"keep_every={self.keep_every}" if self.keep_every else "",
            f"max_age={format_duration(self.max_age_s)}" if self.max_age_s else "",
            f"budget={format_size(self.budget_bytes)}" if self.budget_bytes else "",
        ]
        return " ".join(p for p in parts if p) or "keep everything"


@dataclass(frozen=True)
class StepFacts:
    """What the policy needs to know about one step of one job in one tier."""

    step: int
    complete: bool
    #: unix time of the step's newest manifest
    created: float
    pinned: bool = False


def select(steps: Iterable[StepFacts], policy: TierPolicy, now: float) -> dict[int, str]:
    """The steps of one job to keep by count and age, each with the reason; every other step
    may go. The byte budget is tier-wide: ``fit_budget`` applies it across jobs afterwards."""
    facts = sorted(steps, key=lambda s: s.step, reverse=True)
    complete = [s.step for s in facts if s.complete]
    newest_complete = complete[0] if complete else None
    protected: dict[int, str] = {}
    for s in facts:
        if newest_complete is None:
            protected[s.step] = NONE_COMPLETE
        elif s.step > newest_complete:
            protected[s.step] = IN_PROGRESS
        elif s.step == newest_complete:
            protected[s.step] = NEWEST
        elif s.pinned:
            protected[s.step] = PINNED

    kept: dict[int, str] = {}
    if policy.keep_last is None and policy.keep_every is None:
        kept = {s.step: NO_LIMIT for s in facts}
    else:
        if policy.keep_last is not None:
            kept.update({step: KEEP_LAST for step in complete[: policy.keep_last]})
        if policy.keep_every is not None:
            for s in facts:
                if s.complete and s.step % policy.keep_every == 0:
                    kept.setdefault(s.step, KEEP_EVERY)
    if policy.max_age_s is not None:
        created = {s.step: s.created for s in facts}
        kept = {st: why for st, why in kept.items() if now - created[st] <= policy.max_age_s}
    kept.update(protected)
    return kept


def fit_budget(
    kept: dict[Key, str],
    budget_bytes: int,
    bytes_of: Callable[[frozenset[Key]], int],
    created: Mapping[Key, float],
) -> dict[Key, str]:
    """Drop the oldest kept steps that are not protected until ``bytes_of(kept)`` (the tier's
    bytes if only those steps stayed; shared packs count once) fits the budget, or until
    only protected steps are left (then the tier stays over budget, and says so)."""
    kept = dict(kept)
    for key in sorted(kept, key=lambda k: (created[k], k)):
        if bytes_of(frozenset(kept)) <= budget_bytes:
            break
        if kept[key] not in PROTECTED:
            del kept[key]
    return kept


_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNITS_B = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*\Z")


def parse_duration(value: object, *, allow_zero: bool = False) -> float:
    """Seconds from a number or a string like ``90s``, ``30m``, ``12h``, ``30d``, ``2w``."""
    return _parse(value, _UNITS_S, "duration", "s", allow_zero)


def parse_size(value: object) -> int:
    """Bytes from a number or a string like ``500MB``, ``2TiB`` (1 KB = 1000, 1 KiB = 1024)."""
    return int(_parse(value, _UNITS_B, "size", "", False))


def _parse(
    value: object, units: Mapping[str, float], what: str, default: str, allow_zero: bool
) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), default
    else:
        match = _QUANTITY.match(str(value))
        if not match:
            raise ValueError(f"invalid {what} {value!r}")
        number, unit = float(match[1]), match[2].lower() or default
    if unit not in units:
        raise ValueError(f"invalid {what} {value!r}: unknown unit {unit!r}")
    result = number * units[unit]
    if not (result >= 0 if allow_zero else result > 0) or result == float("inf"):
        raise ValueError(f"{what} must be {'finite' if allow_zero else 'positive'}, got {value!r}")
    return result


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNITS_S[unit] and seconds % _UNITS_S[unit] == 0:
            return f"{int(seconds // _UNITS_S[unit])}{unit}"
    return f"{seconds:g}s"
