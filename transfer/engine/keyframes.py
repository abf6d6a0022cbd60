"""The writer's keyframe policy: when a changed chunk is stored as a delta against the
chunk at its offset in the base checkpoint, and when on its own (a keyframe).

A delta saves bytes on a *warm* restore (the node holds the base: only the delta moves) and
costs them on a *cold* one (the node must fetch the base's chain too). On a real full
fine-tune the two are far apart (``python -m bench.keyframe_policy``): a delta saves 0-20%
on about two thirds of the chunks and 30-40% on the rest, while a cold restore of a delta
fetches its base as well, 1.6-2.3x the chunk's keyframe, and more with every link. So a
delta is kept only when

- it is at least ``delta_min_saving`` smaller than the keyframe would be (under it the warm
  saving is small and the chunk is tied to its base for retention), and
- a cold restore of it stays within ``max_cold_cost`` keyframes (bounds what a fresh node
  pays), and
- its chain stays within ``max_chain`` decode steps (bounds decode work).

Sizes are estimated from the codec's samples, before the chunk is encoded whole.
"""

from __future__ import annotations

from transfer.codec import DeltaPolicy
from transfer.engine.chunkindex import ChunkIndex
from transfer.options import TransferOptions


def may_delta(index: ChunkIndex, base_id: str, options: TransferOptions) -> bool:
    """Whether a delta against ``base_id`` is allowed at all (before reading the base)."""
    return index.depth(base_id) + 1 <= options.max_chain


def delta_policy(index: ChunkIndex, base_id: str, options: TransferOptions) -> DeltaPolicy:
    """What the codec asks once a delta against ``base_id`` beats the keyframe on samples."""
    base_cost = index.cold_cost(base_id)
    keep_at_most = 1.0 - options.delta_min_saving

    def pays(delta: int, keyframe: int) -> bool:
        return (
            delta <= keep_at_most * keyframe
            and delta + base_cost <= options.max_cold_cost * keyframe
        )

    return pays
