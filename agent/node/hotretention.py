"""Retention of the hot dir (node-local NVMe): keep the newest ``keep_last`` committed steps
of each job, evict older ones only once a colder tier holds them, and evict further (down
to the newest two) while the directory is over its byte budget or its filesystem has less
than ``min_free`` bytes free.

A step is evictable when a colder tier holds it (this node's part, or every part of a
checkpoint restored here, checked structurally), or when it expired there: this node pushed
or restored it once and no tier has it any more, so the tiers' policies let it go. Steps
in use (a prefetch writes or reads them, a push is pending or reads one as its delta base),
pinned steps and uncommitted directories are never touched. How a directory is evicted
(atomically, crash-safe) is the hot dir's: ``HotDir.evict`` and ``HotDir.sweep_evictions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from agent.daemon.logs import event
from agent.node.hotdir import HotDir, LocalCheckpoint
from agent.node.journal import Journal
from transfer.engine import list_checkpoints
from transfer.engine.catalog import load_manifest
from transfer.engine.scan import scan_checkpoint
from transfer.errors import FerryError
from transfer.format.manifest import Manifest
from transfer.format.names import Key
from transfer.retention.copy import step_problems
from transfer.store.base import Store

log = logging.getLogger(__name__)

MIN_KEEP_LAST = 2


@dataclass
class HotStep:
    job: str
    step: int
    path: str
    bytes: int
    action: str  # "keep" or "evict"
    reason: str


@dataclass
class HotPlan:
    bytes_before: int = 0
    bytes_after: int = 0
    budget_bytes: int | None = None
    min_free_bytes: int | None = None
    #: over the budget, or short of min_free, even after evicting all it may
    over_budget: bool = False
    steps: list[HotStep] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


async def plan_hot(
    hot: HotDir,
    *,
    node: str,
    keep_last: int,
    budget_bytes: int | None,
    tiers: Sequence[tuple[str, Store]],
    journal: Journal,
    protected: Collection[Key],
    min_free_bytes: int | None = None,
) -> HotPlan:
    keep_last = max(keep_last, MIN_KEEP_LAST)
    plan = HotPlan(budget_bytes=budget_bytes)
    held = hot.all_checkpoints()
    sizes = {(c.job, c.step): await asyncio.to_thread(_tree_bytes, c.path) for c in held}
    plan.bytes_before = sum(sizes.values())
    durable = _DurabilityCheck(tiers, journal, node)

    decisions, evictable = await _by_rank(held, _with_bases(protected, held), keep_last, durable)
    for key, paths in _twins(held).items():  # (one decision per step: it would go for both)
        names = ", ".join(p.name for p in paths)
        why = f"{len(paths)} directories name step {key[1]} ({names}): kept until one is renamed"
        log.warning("hot retention keeps %s %s: %s", key[0], names, why)
        decisions[key] = ("keep", why)
        evictable = [c for c in evictable if (c.job, c.step) != key]
    remaining = sum(sizes[k] for k, (a, _) in decisions.items() if a == "keep")
    # bytes to free on the filesystem, counting what keep_last already evicts
    shortfall = 0
    if min_free_bytes is not None:
        evicting = sum(sizes[k] for k, (a, _) in decisions.items() if a == "evict")
        shortfall = min_free_bytes - _free_bytes(hot.root) - evicting
    plan.min_free_bytes = min_free_bytes

    def short() -> bool:
        return (budget_bytes is not None and remaining > budget_bytes) or shortfall > 0

    for c in sorted(evictable, key=lambda c: c.step):  # oldest first
        if not short():
            break
        key = (c.job, c.step)
        why = "over budget" if shortfall <= 0 else "disk short of min_free"
        decisions[key] = ("evict", f"{why}; " + durable.where[key])
        remaining -= sizes[key]
        shortfall -= sizes[key]
    plan.over_budget = short()
    plan.bytes_after = remaining
    plan.steps = [
        HotStep(c.job, c.step, str(c.path), sizes[(c.job, c.step)], *decisions[(c.job, c.step)])
        for c in held
    ]
    plan.steps += await _partial_copies(hot, held, {*protected, *durable.pending})
    return plan


async def _partial_copies(
    hot: HotDir, held: list[LocalCheckpoint], protected: Collection[Key]
) -> list[HotStep]:
    """Partial copies (shares a prefetch made for some ranks): each came from a tier, so
    none is ever the only copy, but for this node's own part added to before it was pushed
    everywhere (kept while that push is pending, with what ``protected`` names); the newest
    of a job is kept (a survivor's ranks restart from it), an older one goes once a newer
    step of its job is here, whole or a share."""
    out = []
    shares = hot.shares()
    for c in shares:
        newer = [o.step for o in [*held, *shares] if o.job == c.job and o.step > c.step]
        size = await asyncio.to_thread(_tree_bytes, c.path, True)  # holes cost nothing
        if (c.job, c.step) in protected or not newer:
            out.append(HotStep(c.job, c.step, str(c.path), size, "keep", "a partial copy"))
        else:
            why = f"a partial copy; step {max(newer)} is here"
            out.append(HotStep(c.job, c.step, str(c.path), size, "evict", why))
    return out


def _twins(held: list[LocalCheckpoint]) -> dict[Key, list[Path]]:
    """Steps two directories of a job name (``step_000010`` and ``checkpoint-10``): the
    push took one of them for the step, the other was never pushed, and a decision made
    per step would evict both (a newcomer's trial lost the unpushed one)."""
    paths: dict[Key, list[Path]] = {}
    for c in held:
        paths.setdefault((c.job, c.step), []).append(c.path)
    return {key: sorted(found) for key, found in paths.items() if len(found) > 1}


def _with_bases(protected: Collection[Key], held: list[LocalCheckpoint]) -> set[Key]:
    """A step in use protects the newest step below it too: a push or prefetch of a step
    reads that one as its delta base."""
    found = set(protected)
    for job, step in protected:
        below = [c.step for c in held if c.job == job and c.step < step]
        if below:
            found.add((job, max(below)))
    return found


async def _by_rank(
    held: list[LocalCheckpoint],
    protected: set[Key],
    keep_last: int,
    durable: _DurabilityCheck,
) -> tuple[dict[Key, tuple[str, str]], list[LocalCheckpoint]]:
    """Each step's decision by its rank within its job (0: the newest), and the steps kept
    only by keep_last (what a budget or min_free may still evict, oldest first)."""
    rank = {}
    for job in {c.job for c in held}:  # local_checkpoints lists newest first
        for i, c in enumerate(c for c in held if c.job == job):
            rank[(c.job, c.step)] = i
    decisions: dict[Key, tuple[str, str]] = {}
    evictable: list[LocalCheckpoint] = []
    for c in held:
        key = (c.job, c.step)
        if rank[key] < MIN_KEEP_LAST:
            decisions[key] = ("keep", "newest two")
        elif key in protected:
            decisions[key] = ("keep", "in use or pinned")
        elif why_not := await durable.why_not_evictable(c):
            decisions[key] = ("keep", why_not)
        elif rank[key] < keep_last:
            decisions[key] = ("keep", "keep_last")
            evictable.append(c)
        else:
            decisions[key] = ("evict", "beyond keep_last; " + durable.where[key])
    return decisions, evictable


async def apply_hot(
    hot: HotDir, plan: HotPlan, journal: Journal, protected: Callable[[], Collection[Key]]
) -> HotPlan:
    """Evict what the plan says, re-checking just before each step goes that nothing took
    a hold on it (or on a step it is the base of) since the plan: ``protected`` is asked
    each time, and the step is renamed away on the event loop right after, so a prefetch
    (which takes its holds on the loop as it lists the hot dir) either never sees it or
    keeps it; only the deletion of the renamed directory runs in a thread."""
    for s in plan.steps:
        if s.action != "evict":
            continue
        if (s.job, s.step) in _with_bases(protected(), hot.all_checkpoints()):
            plan.errors.append(f"{s.job} step {s.step} came into use; kept")
            continue
        try:
            hidden = hot.hide(Path(s.path))  # (one rename: no await between check and act)
        except OSError as exc:
            plan.errors.append(f"could not evict {s.path}: {exc}")
            continue
        # forgotten before the await: a prefetch may restore the step again meanwhile, and
        # its "restored here" record must outlive this eviction (else hot retention keeps
        # the restore for good and the watcher takes it for this node's own save)
        journal.forget(s.job, s.step)
        plan.evicted.append(s.path)
        try:
            await asyncio.to_thread(shutil.rmtree, hidden)
        except OSError as exc:  # hidden already: sweep_evictions removes it at the next start
            plan.errors.append(f"could not remove evicted {hidden}: {exc}")
        event(log, "hot_evicted", job=s.job, step=s.step, path=s.path, bytes=s.bytes,
              reason=s.reason)  # fmt: skip
    return plan


class _DurabilityCheck:
    """Is a hot step safe to evict? Caches each tier's listing per job for one run."""

    def __init__(
        self,
        tiers: Sequence[tuple[str, Store]],
        journal: Journal,
        node: str,
    ) -> None:
        self.tiers, self.journal, self.node = tiers, journal, node
        self.pending = {(job, step) for job, step, _ in journal.pending()}
        self._nodes: dict[tuple[str, str], dict[int, set[str]]] = {}
        self.where: dict[Key, str] = {}

    async def _parts(self, name: str, store: Store, job: str) -> dict[int, set[str]]:
        if (name, job) not in self._nodes:
            parts: dict[int, set[str]] = {}
            for c in await list_checkpoints(store, job):
                parts.setdefault(c.step, set()).add(c.node)
            self._nodes[(name, job)] = parts
        return self._nodes[(name, job)]

    async def why_not_evictable(self, c: LocalCheckpoint) -> str | None:
        restored = self.journal.is_restored(c.job, c.step)
        if (c.job, c.step) in self.pending:  # (a restore into this node's own part too)
            return "push pending"
        unreachable = False
        for name, store in self.tiers:
            try:
                nodes = (await self._parts(name, store, c.job)).get(c.step, set())
                if not nodes or (not restored and self.node not in nodes):
                    continue
                wanted = sorted(nodes) if restored else [self.node]
                problems = await step_problems(store, c.job, c.step, wanted, need_marker=False)
            except FerryError as exc:
                log.warning("hot retention: %s unreadable: %s", name, exc)
                unreachable = True
                continue
            if not problems and not restored:
                # what the tier holds must be this copy: a file written to after its push
                # (or a torn copy pushed by an older agent) would be lost with the eviction
                try:
                    manifest = await load_manifest(store, c.job, c.step, self.node)
                except FerryError as exc:
                    log.warning("hot retention: %s unreadable: %s", name, exc)
                    unreachable = True
                    continue
                differs = await asyncio.to_thread(_differs_from_pushed, c.path, manifest)
                if differs is not None:
                    log.warning("hot retention keeps %s: %s", c.path, differs)
                    return f"differs from the copy pushed to {name}: {differs}"
            if not problems:
                self.where[(c.job, c.step)] = f"held by {name}"
                return None
        if unreachable:
            return "a colder tier could not be checked"
        if self.journal.was_durable(c.job, c.step):
            self.where[(c.job, c.step)] = "expired from every tier"
            return None
        return "not in any colder tier yet"


def _differs_from_pushed(path: Path, manifest: Manifest) -> str | None:
    """Why the hot copy at ``path`` is not the copy ``manifest`` committed, or None."""
    pushed = {f.path: f.size for f in manifest.files}
    try:
        here = {f.path: f for f in scan_checkpoint(path)}
    except (FerryError, OSError) as exc:
        return str(exc)
    if set(here) != set(pushed):
        extra = sorted(set(here) ^ set(pushed))
        return f"{extra[0]} is in one copy only"
    committed_at = datetime.fromisoformat(manifest.created_at).timestamp()
    for name, f in sorted(here.items()):
        if f.size != pushed[name]:
            return f"{name} is {f.size} bytes here, {pushed[name]} in the pushed copy"
        if f.mtime_ns / 1e9 > committed_at + 1:  # created_at has whole seconds
            return f"{name} was written to after the push"
    return None


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _tree_bytes(root: Path, allocated: bool = False) -> int:
    """Bytes of the files under ``root``: their sizes, or (``allocated``) the disk they
    take (a partial copy is mostly holes)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_blocks * 512 if allocated else st.st_size
    return total
