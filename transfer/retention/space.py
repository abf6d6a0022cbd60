"""How many bytes a tier holds once a retention run is done with it: one accounting for the
plan (``ferry retention``, dry run or not, and the agent's runs) and ``ferry du``'s policy
lines, so the three never disagree.

A run expires steps, then (by default) repacks: delta chunks whose base expired are stored
again whole and the live chunks of mostly-dead packs are copied out, so the packs an old
step kept alive can go; then GC deletes what nobody references. Without repacking, a kept
delta step keeps its base's whole packs, and the forecast says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from transfer.format.names import Key
from transfer.retention.inventory import Inventory
from transfer.retention.repack import RepackPolicy, forecast


@dataclass(frozen=True)
class Space:
    #: bytes the tier holds once the run and its GC are done (packs and manifests)
    bytes_after: int
    #: of those, bytes inside kept packs that no kept chunk uses
    dead_bytes_after: int
    #: of those, bytes the run writes anew (moved chunks, and re-encoded deltas: estimated)
    bytes_rewritten: int
    #: packs repacking empties (GC deletes them with the expired steps' packs)
    packs_vacated: frozenset[str]


def space_after(inv: Inventory, kept: Iterable[Key], repacking: RepackPolicy | None) -> Space:
    """The tier's footprint with only ``kept`` retained, after repacking if ``repacking``."""
    keys = list(kept)
    if repacking is None:
        return Space(inv.bytes_of(keys), inv.dead_bytes(keys), 0, frozenset())
    f = forecast(inv, keys, repacking)
    manifests = sum(sum(inv.steps[k].manifest_bytes.values()) for k in keys)
    in_place = {p: inv.pack_sizes.get(p, 0) for p in f.live_in_kept_packs}
    rewritten = f.bytes_moved + f.bytes_reencoded_estimate
    return Space(
        bytes_after=sum(in_place.values()) + rewritten + manifests,
        dead_bytes_after=sum(
            max(size - f.live_in_kept_packs[p], 0) for p, size in in_place.items()
        ),
        bytes_rewritten=rewritten,
        packs_vacated=f.packs_vacated,
    )
