"""Tiered retention: which checkpoints each tier keeps, demotion to colder tiers, expiry,
and mark-and-sweep garbage collection of packs (docs/FORMAT.md, "Retention and GC")."""

from transfer.retention.gc import GcBusyError, GcResult, collect_garbage, gc_lease
from transfer.retention.inventory import Inventory, RetentionError, take_inventory
from transfer.retention.pins import MAX_PIN_SECONDS, pin, unpin
from transfer.retention.plan import (
    DEMOTE,
    EXPIRE,
    KEEP,
    RetentionPlan,
    Tier,
    apply_plan,
    make_plan,
)
from transfer.retention.policy import TierPolicy, parse_duration, parse_size

__all__ = [
    "DEMOTE",
    "EXPIRE",
    "KEEP",
    "MAX_PIN_SECONDS",
    "GcBusyError",
    "GcResult",
    "Inventory",
    "RetentionError",
    "RetentionPlan",
    "Tier",
    "TierPolicy",
    "apply_plan",
    "collect_garbage",
    "gc_lease",
    "make_plan",
    "parse_duration",
    "parse_size",
    "pin",
    "take_inventory",
    "unpin",
]
