"""What a store's bytes are for (``ferry du``): per step, the stored bytes only it uses and
those it shares (dedupe, delta bases), what expiring it alone would free, the dead bytes
inside packs that are kept for other chunks, the packs nobody references, and what the
common keep-last policies would free.

Space comes back per pack (FORMAT.md, "Concurrency and garbage"): a step's own bytes are
freed only where whole packs become unreferenced, so "frees" is counted in packs, and a
step whose packs a newer delta step decodes from frees nothing however old it is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from transfer.retention.inventory import Inventory
from transfer.retention.plan import kept_steps
from transfer.retention.policy import TierPolicy
from transfer.retention.repack import RepackPolicy
from transfer.retention.space import space_after

#: how the policy lines assume a run repacks: ``ferry retention``'s default
DEFAULT_REPACKING = RepackPolicy()

#: keep-last values whose effect ``ferry du`` reports
KEEP_LAST_CHOICES = (1, 2, 3)

Extent = tuple[str, int]  # (pack, offset): one stored chunk


@dataclass
class StepUsage:
    job: str
    step: int
    nodes: list[str]
    complete: bool
    pinned: bool
    bytes_raw: int
    #: stored bytes of chunks no other step uses
    own_bytes: int
    #: stored bytes of chunks other steps use too (deduplicated, or a delta base)
    shared_bytes: int
    #: what expiring this step alone would free: packs only it references
    frees_bytes: int


@dataclass
class PolicyEffect:
    policy: str
    bytes_after: int
    frees_bytes: int


@dataclass
class StoreUsage:
    url: str
    total_bytes: int
    pack_bytes: int
    manifest_bytes: int
    #: bytes of stored chunks some step uses
    live_bytes: int
    #: bytes inside referenced packs that no step uses (repacking would free them)
    dead_bytes: int
    #: packs no step references: garbage a retention run collects
    unreferenced_packs: int
    unreferenced_bytes: int
    #: pack uploads begun and never finished (a killed push's: retention aborts them) and
    #: their bytes (a local store's ``.tmp`` files, an S3 upload's parts)
    unfinished_uploads: int = 0
    unfinished_upload_bytes: int = 0
    steps: list[StepUsage] = field(default_factory=list)
    policies: list[PolicyEffect] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def store_usage(
    inv: Inventory,
    *,
    now: float,
    job: str | None = None,
    repacking: RepackPolicy | None = DEFAULT_REPACKING,
) -> StoreUsage:
    """Account for every byte of ``inv``; ``job`` limits the per-step rows (the totals and
    the policies stay store-wide: packs are shared across jobs). The policy lines say what a
    retention run with ``repacking`` (the CLI's default) would leave: the plan's own figure."""
    users: Counter[Extent] = Counter()
    sizes: dict[Extent, int] = {}
    for entry in inv.steps.values():
        for pack_id, extents in entry.extents.items():
            for offset, stored in extents.items():
                users[(pack_id, offset)] += 1
                sizes[(pack_id, offset)] = stored
    live_by_pack: Counter[str] = Counter()
    for (pack_id, _), stored in sizes.items():
        live_by_pack[pack_id] += stored
    referenced = inv.referenced()
    unreferenced = set(inv.pack_sizes) - referenced
    pack_users = Counter(p for entry in inv.steps.values() for p in entry.packs)

    steps = []
    for key, entry in sorted(inv.steps.items()):
        if job is not None and key[0] != job:
            continue
        mine = [(ext, sizes[ext]) for p, exts in entry.extents.items() for ext in _keys(p, exts)]
        steps.append(
            StepUsage(
                job=entry.job,
                step=entry.step,
                nodes=sorted(entry.parts),
                complete=entry.complete,
                pinned=key in inv.pins,
                bytes_raw=entry.bytes_raw,
                own_bytes=sum(size for ext, size in mine if users[ext] == 1),
                shared_bytes=sum(size for ext, size in mine if users[ext] > 1),
                frees_bytes=sum(
                    inv.pack_sizes.get(p, 0) for p in entry.packs if pack_users[p] == 1
                ),
            )
        )
    total = inv.total_bytes()
    return StoreUsage(
        url=inv.url,
        total_bytes=total,
        pack_bytes=sum(inv.pack_sizes.values()),
        manifest_bytes=total - sum(inv.pack_sizes.values()),
        live_bytes=sum(live_by_pack[p] for p in referenced if p in inv.pack_sizes),
        dead_bytes=sum(
            max(inv.pack_sizes[p] - live_by_pack[p], 0) for p in referenced if p in inv.pack_sizes
        ),
        unreferenced_packs=len(unreferenced),
        unreferenced_bytes=sum(inv.pack_sizes[p] for p in unreferenced),
        unfinished_uploads=len(inv.uploads),
        unfinished_upload_bytes=sum(u.size or 0 for u in inv.uploads),
        steps=steps,
        policies=[_effect(inv, TierPolicy(keep_last=n), now, repacking) for n in KEEP_LAST_CHOICES],
    )


def _keys(pack_id: str, extents: dict[int, int]) -> list[Extent]:
    return [(pack_id, offset) for offset in extents]


def _effect(
    inv: Inventory, policy: TierPolicy, now: float, repacking: RepackPolicy | None
) -> PolicyEffect:
    kept, _ = kept_steps(inv, policy, now, inv.pins)
    after = space_after(inv, kept, repacking).bytes_after
    return PolicyEffect(policy.describe(), after, max(inv.total_bytes() - after, 0))
