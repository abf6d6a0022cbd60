"""Which steps no retention may delete, from every place that says so; one home for them.

- ``StepHolds``: steps in use on this node right now (a prefetch writing one, or reading
  one as its base). In memory: a restart ends every use.
- ``LocalPins``: pins set on this agent through the RPC, (job, step) -> expiry. The hot
  dir's retention keeps a pinned step and the checkpoint listing shows it; each tier's
  store holds its own copy of the pin (transfer.retention.pin), so that no node's retention
  deletes it there. In memory: a restart forgets them here; the store pins expire on
  their own. Only a step that exists is pinned (``ferry pin`` and ``POST /v1/pins``
  alike): a pin of a step nobody pushed protects nothing, and a typo must not look
  protected.
- ``ProtectedSteps``: what the retention loop asks, afresh before each phase: the holds,
  the pins, and the push queue's busy steps (queued, being pushed, waiting to retry).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agent.node.hotdir import HotDir
from transfer.engine.catalog import list_parts, open_catalog
from transfer.errors import CheckpointNotFoundError
from transfer.format.names import Key
from transfer.store.base import Store


class StepHolds:
    """Steps in use on this node right now, counted (two prefetches may hold one)."""

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


class LocalPins:
    def __init__(self) -> None:
        self._expiry: dict[Key, float] = {}

    def pin(self, job: str, step: int, ttl: float) -> float:
        """Pin for ``ttl`` seconds from now; returns the expiry (epoch seconds)."""
        expiry = self._expiry[(job, step)] = time.time() + ttl
        return expiry

    def unpin(self, job: str, step: int) -> bool:
        """Remove the pin; True if (job, step) was pinned (not yet expired)."""
        expiry = self._expiry.pop((job, step), None)
        return expiry is not None and expiry > time.time()

    def pinned(self, job: str, step: int) -> bool:
        expiry = self._expiry.get((job, step))
        return expiry is not None and expiry > time.time()

    def active(self) -> set[Key]:
        now = time.time()
        return {key for key, expiry in self._expiry.items() if expiry > now}


@dataclass(frozen=True)
class ProtectedSteps:
    """Where this agent learns which steps no retention run may delete (the store's own
    pins the plan reads itself): ``holds``, steps in use on this node right now; ``pins``,
    this agent's RPC pins; ``busy``, steps queued, being pushed or waiting to
    retry."""

    holds: StepHolds
    pins: Callable[[], Collection[Key]]
    busy: Callable[[], Collection[Key]]

    def now(self) -> set[Key]:
        """Asked afresh before each phase: a step may be pinned or held meanwhile."""
        return set(self.pins()) | self.holds.held() | set(self.busy())


async def store_holds(store: Store, job: str, step: int) -> bool:
    """True when ``store`` holds a committed part of (job, step): one listing of the step."""
    return await open_catalog(store, create=False) and bool(await list_parts(store, job, step))


async def check_pinnable(hot: HotDir, tiers: list[tuple[str, Store]], job: str, step: int) -> None:
    """Raise CheckpointNotFoundError unless this node's hot dir or one of ``tiers`` holds
    (job, step) committed."""
    held = await asyncio.to_thread(hot.checkpoints, job)
    if any(c.step == step for c in held):
        return
    for _, store in tiers:
        if await store_holds(store, job, step):
            return
    names = ", ".join(name for name, _ in tiers) or "none"
    raise CheckpointNotFoundError(
        f"no committed checkpoint {job} step {step} on this node or in any tier ({names}): "
        "only a step that exists can be pinned"
    )
