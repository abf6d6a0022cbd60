"""Retention across store tiers: decide (a plan), then act (demote, expire, collect).

For each tier, hottest first, every step is either kept (with the rule that keeps it),
demoted (this tier's policy drops it but the next tier's keeps it: it leaves this tier only
once the next tier holds it, checked, and copied there first if missing) or expired (no
tier wants it). Expiring a step deletes its completion marker, then its manifests; its
packs go later, through mark-and-sweep GC (``gc.py``), once nothing references them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace

from transfer.engine.verify import verify
from transfer.errors import FerryError
from transfer.format import layout
from transfer.format.names import Key
from transfer.retention.copy import copy_step, step_problems
from transfer.retention.gc import GcBusyError, GcResult, collect_garbage, gc_lease
from transfer.retention.inventory import Inventory, StepEntry, take_inventory
from transfer.retention.pins import drop_expired_pins
from transfer.retention.policy import (
    StepFacts,
    TierPolicy,
    fit_budget,
    format_size,
    select,
)
from transfer.retention.repack import RepackPolicy, RepackResult, repack
from transfer.retention.space import space_after
from transfer.store.base import Store

log = logging.getLogger(__name__)

KEEP, DEMOTE, EXPIRE = "keep", "demote", "expire"


@dataclass(frozen=True)
class Tier:
    store: Store
    policy: TierPolicy

    @property
    def url(self) -> str:
        return self.store.url


@dataclass
class StepAction:
    job: str
    step: int
    action: str
    reason: str
    nodes: list[str]
    complete: bool
    created: float


@dataclass
class TierPlan:
    url: str
    policy: str
    bytes_before: int
    #: what the tier holds once this run (expiries, repacking, GC) is done: ``space.py``
    bytes_after: int
    actions: list[StepAction]
    #: bytes in retained packs that no retained chunk uses (freed only with the whole pack)
    dead_bytes_after: int = 0
    #: of ``bytes_after``, what repacking writes anew (re-encoded chunks estimated)
    bytes_rewritten: int = 0
    #: over budget even after dropping everything the rules allow
    over_budget: bool = False
    #: filled in by apply_plan
    errors: list[str] = field(default_factory=list)
    gc: GcResult | None = None
    repack: RepackResult | None = None
    done: list[StepAction] = field(default_factory=list)
    #: measured once a real run is done: what the tier stores now, and how much of it is
    #: unreferenced packs waiting out the grace period (a later run deletes them); both
    #: None in a dry run (its forecast: ``bytes_after``, and the sweep's ``marked_bytes``)
    bytes_stored: int | None = None
    bytes_awaiting_gc: int | None = None
    #: steps the tier above demotes into this one (not here yet), and the bytes their copy
    #: writes (packs are copied whole: the packs they reference that this tier lacks, and
    #: their manifests); both are in ``bytes_after``
    steps_demoted_in: int = 0
    bytes_demoted_in: int = 0

    def count(self, action: str) -> int:
        return sum(a.action == action for a in self.actions)

    def to_dict(self) -> dict[str, object]:
        doc = asdict(self)
        doc["gc"] = self.gc.to_dict() if self.gc else None
        doc["repack"] = self.repack.to_dict() if self.repack else None
        return doc


@dataclass
class RetentionPlan:
    tiers: list[TierPlan]
    now: float
    inventories: list[Inventory] = field(repr=False, default_factory=list)
    #: how the run compacts and repacks after its expiries (None: whole-pack GC only)
    repacking: RepackPolicy | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "now": self.now,
            "repacking": self.repacking is not None,
            "tiers": [t.to_dict() for t in self.tiers],
        }

    def table(self) -> str:
        lines = []
        for t in self.tiers:
            steps = f"{len(t.actions)} step" + ("" if len(t.actions) == 1 else "s")
            lines.append(
                f"{t.url}  [{t.policy}]  {steps}: keep {t.count(KEEP)}, "
                f"demote {t.count(DEMOTE)}, expire {t.count(EXPIRE)}; "
                f"{format_size(t.bytes_before)} -> {format_size(t.bytes_after)} once done "
                f"({format_size(t.dead_bytes_after)} of it in packs kept for other chunks"
                + (
                    f"; {t.steps_demoted_in} step{'' if t.steps_demoted_in == 1 else 's'} "
                    f"demoted in, {format_size(t.bytes_demoted_in)})"
                    if t.steps_demoted_in
                    else ")"
                )
                + ("  (OVER BUDGET: only protected steps left)" if t.over_budget else "")
            )
            if t.bytes_stored is not None:
                waiting = ""
                if t.bytes_awaiting_gc:
                    waiting = (
                        f", {format_size(t.bytes_awaiting_gc)} of it unreferenced packs that a "
                        "run after the grace period deletes"
                    )
                lines.append(f"  stored now: {format_size(t.bytes_stored)}{waiting}")
            for a in t.actions:
                lines.append(f"  {a.job:<20} {a.step:>10}  {a.action:<7} {a.reason}")
            if t.repack is not None and (t.repack.chunks_reencoded or t.repack.chunks_moved):
                r = t.repack
                verb = "would re-encode" if r.dry_run else "re-encoded"
                lines.append(
                    f"  repack: {verb} {r.chunks_reencoded} delta chunks whose base expired, "
                    f"moved {r.chunks_moved} chunks ({format_size(r.bytes_moved)}) out of "
                    f"mostly-dead packs; {len(r.packs_vacated)} packs "
                    f"({format_size(r.bytes_vacated)}) left to GC"
                )
            if t.gc is not None:
                g = t.gc
                verb = "would delete" if g.dry_run else "deleted"
                # (a dry run's are those its expiries and demotions would leave unreferenced)
                waiting = (
                    "would wait out the grace period" if g.dry_run else "wait out the grace period"
                )
                if g.running_pushes:
                    waiting += f" ({g.running_pushes} pushes running: without grace, none goes)"
                lines.append(
                    f"  gc: {verb} {len(g.deleted_packs)} packs ({format_size(g.freed_bytes)}); "
                    f"{g.marked_packs} unreferenced packs ({format_size(g.marked_bytes)}) {waiting}"
                )
                if g.aborted_uploads or g.pending_uploads:
                    verb = "would abort" if g.dry_run else "aborted"
                    lines.append(
                        f"  gc: {verb} {g.aborted_uploads} unfinished pack uploads of pushes "
                        f"that died ({format_size(g.aborted_upload_bytes)}); "
                        f"{g.pending_uploads} younger ones left (a push may still finish them)"
                    )
                if g.lapsed_leases:
                    lines.append(f"  gc: removed {g.lapsed_leases} push leases of pushes that died")
            lines.extend(f"  error: {e}" for e in t.errors)
        return "\n".join(lines)


def kept_steps(
    inventory: Inventory,
    policy: TierPolicy,
    now: float,
    pins: Collection[Key],
    extra: dict[Key, StepEntry] | None = None,
    repacking: RepackPolicy | None = None,
) -> tuple[dict[Key, str], bool]:
    """Steps the policy keeps in this tier (with reasons), and whether the tier stays over
    budget. ``extra`` adds steps that are not there yet (to ask "would it keep them?").
    The budget is met by the tier's bytes after this run, as the plan reports them
    (space_after: with ``repacking``, a kept delta no longer holds its expired base's
    whole pack, so expiring the oldest step frees its share at once)."""
    steps = dict(extra or {})
    steps.update(inventory.steps)
    kept: dict[Key, str] = {}
    for job in sorted({job for job, _ in steps}):
        facts = [
            StepFacts(e.step, e.complete, e.created, pinned=e.key in pins)
            for e in steps.values()
            if e.job == job
        ]
        kept.update({(job, step): why for step, why in select(facts, policy, now).items()})
    over = False
    if policy.budget_bytes is not None and not extra:
        created = {k: e.created for k, e in steps.items()}

        def bytes_after(keys: frozenset[Key]) -> int:
            return space_after(inventory, keys, repacking).bytes_after

        kept = fit_budget(kept, policy.budget_bytes, bytes_after, created)
        over = bytes_after(frozenset(kept)) > policy.budget_bytes
    return kept, over


async def make_plan(
    tiers: Sequence[Tier],
    *,
    now: float,
    expected_nodes: Sequence[str] = (),
    pins: Collection[Key] = (),
    repacking: RepackPolicy | None = None,
) -> RetentionPlan:
    """Read every tier and decide. ``pins`` adds the caller's own pins (an agent's); pins in
    any tier's store protect the step in every tier, which is why one unreadable tier stops
    the whole plan (its error propagates): a pin only it holds must still protect the others.
    ``repacking``: the run compacts chains and repacks after its expiries (``repack.py``);
    each tier's ``bytes_after`` counts it."""
    inventories = [
        await take_inventory(t.store, now=now, expected_nodes=expected_nodes) for t in tiers
    ]
    all_pins = set(pins).union(*(inv.pins for inv in inventories))
    plans: list[TierPlan] = []
    incoming: list[Key] = []  # what the tier above demotes into this one
    for i, (tier, inv) in enumerate(zip(tiers, inventories, strict=True)):
        kept, over = kept_steps(inv, tier.policy, now, all_pins, repacking=repacking)
        wanted_next: dict[Key, str] = {}
        if i + 1 < len(tiers):
            wanted_next, _ = kept_steps(
                inventories[i + 1], tiers[i + 1].policy, now, all_pins, extra=inv.steps
            )
        actions = []
        for key, entry in sorted(inv.steps.items()):
            if key in kept:
                action, reason = KEEP, kept[key]
            elif key in wanted_next:
                action, reason = DEMOTE, f"the next tier keeps it ({wanted_next[key]})"
            else:
                action, reason = EXPIRE, "no tier's policy keeps it"
            actions.append(
                StepAction(*key, action, reason, sorted(entry.parts), entry.complete, entry.created)
            )
        space = space_after(inv, kept, repacking)
        bytes_in = _copied_in(inventories[i - 1], inv, incoming) if incoming else 0
        plans.append(
            TierPlan(
                tier.url,
                tier.policy.describe(),
                inv.total_bytes(),
                space.bytes_after + bytes_in,
                actions,
                dead_bytes_after=space.dead_bytes_after,
                bytes_rewritten=space.bytes_rewritten,
                over_budget=over,
                steps_demoted_in=len(incoming),
                bytes_demoted_in=bytes_in,
            )
        )
        # (a step the next tier holds already is not copied: demoting it only expires it here)
        nxt = inventories[i + 1].steps if i + 1 < len(tiers) else {}
        incoming = [(a.job, a.step) for a in actions if a.action == DEMOTE]
        incoming = [key for key in incoming if key not in nxt]
    return RetentionPlan(plans, now, inventories, repacking)


def _copied_in(above: Inventory, here: Inventory, keys: list[Key]) -> int:
    """What demoting ``keys`` from ``above`` writes ``here``: the packs they reference that
    this tier does not hold yet (copy.py skips those it has: an earlier demotion of a step
    they share chunks with copied them), each once, and their manifests."""
    packs = above.referenced(keys) - set(here.pack_sizes)
    manifests = sum(sum(above.steps[k].manifest_bytes.values()) for k in keys)
    return sum(above.pack_sizes.get(p, 0) for p in packs) + manifests


async def apply_plan(
    plan: RetentionPlan,
    tiers: Sequence[Tier],
    *,
    grace_s: float,
    holder: str,
    expected_nodes: Sequence[str] = (),
    deep_verify: bool = False,
    dry_run: bool = False,
) -> RetentionPlan:
    """Carry the plan out, tier by tier under each store's lease; errors are collected per
    tier (a failed demotion keeps its step) rather than stopping the other tiers. After the
    expiries, the plan's ``repacking`` compacts chains and repacks (``repack.py``)."""
    repacking = plan.repacking
    for i, (tier, tplan, inv) in enumerate(zip(tiers, plan.tiers, plan.inventories, strict=True)):
        released = frozenset(inv.referenced())  # before this run's expiries
        if dry_run:
            after = _without(inv, tplan)
            if repacking is not None:
                tplan.repack = await repack(tier.store, after, repacking, dry_run=True)
                after = _without_packs(after, frozenset(tplan.repack.packs_vacated))
            tplan.gc = await collect_garbage(
                tier.store,
                after,
                grace_s=grace_s,
                now=plan.now,
                released=released,
                dry_run=True,
            )
            continue
        try:
            async with gc_lease(tier.store, holder, now=plan.now):
                for action in tplan.actions:
                    if action.action == KEEP:
                        continue
                    if action.action == DEMOTE:
                        problem = await _demote_ready(tier, tiers[i + 1], inv, action, deep_verify)
                        if problem:
                            tplan.errors.append(problem)
                            continue
                    await delete_step(tier.store, inv, action.job, action.step)
                    tplan.done.append(action)
                await drop_expired_pins(tier.store, plan.now)
                if repacking is not None:
                    tplan.repack = await repack(tier.store, inv, repacking)
                tplan.gc = await collect_garbage(
                    tier.store,
                    inv,
                    grace_s=grace_s,
                    now=plan.now,
                    released=released,
                    expected_nodes=tuple(expected_nodes),
                )
                tplan.bytes_stored = tplan.gc.bytes_stored
                tplan.bytes_awaiting_gc = tplan.gc.marked_bytes
        except GcBusyError as exc:
            tplan.errors.append(str(exc))
        except FerryError as exc:
            tplan.errors.append(f"{tier.url}: {exc}")
    return plan


async def _demote_ready(
    tier: Tier, nxt: Tier, inv: Inventory, action: StepAction, deep_verify: bool
) -> str | None:
    """None when the step is safely in the next tier (copied there first if it was not);
    otherwise why it must stay here."""
    entry = inv.steps[(action.job, action.step)]
    nodes = sorted(entry.parts)
    try:
        problems = await step_problems(nxt.store, action.job, action.step, nodes, entry.has_marker)
        if problems:
            log.info("demoting %s step %d: copying to %s", action.job, action.step, nxt.url)
            await copy_step(tier.store, nxt.store, action.job, action.step)
            problems = await step_problems(
                nxt.store, action.job, action.step, nodes, entry.has_marker
            )
        if not problems and deep_verify:
            result = await verify(nxt.store, job=action.job, step=action.step)
            problems = [f"chunk {b.chunk}: {b.reason}" for b in result.bad]
    except FerryError as exc:
        problems = [str(exc)]
    if problems:
        return (
            f"kept {action.job} step {action.step}: not safely in {nxt.url} yet "
            f"({'; '.join(problems[:3])})"
        )
    return None


async def delete_step(store: Store, inv: Inventory, job: str, step: int) -> None:
    """Marker first (an incomplete step is never anyone's "latest"), then the manifests."""
    await store.delete(layout.completion_key(job, step))
    entry = inv.steps.pop((job, step))
    for node in sorted(entry.parts):
        await store.delete(layout.manifest_key(job, step, node))


def _without(inv: Inventory, tplan: TierPlan) -> Inventory:
    gone = {(a.job, a.step) for a in tplan.actions if a.action != KEEP}
    steps = {k: e for k, e in inv.steps.items() if k not in gone}
    return Inventory(inv.url, steps, inv.pack_sizes, inv.pins, inv.uploads)


def _without_packs(inv: Inventory, vacated: frozenset[str]) -> Inventory:
    """``inv`` as a dry run's GC sees it once repacking emptied ``vacated``: no kept part
    references them any more (their chunks live on in new packs a dry run does not write)."""
    steps = {
        key: replace(e, parts={node: packs - vacated for node, packs in e.parts.items()})
        for key, e in inv.steps.items()
    }
    return Inventory(inv.url, steps, inv.pack_sizes, inv.pins, inv.uploads)
