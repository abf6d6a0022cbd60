"""``ferry retention``, ``ferry pin`` and ``ferry unpin``: applying a retention policy to a
store (expire, demote to a colder store, collect garbage, repack), and the pins that keep a
step from it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from agent.cli.args import (
    JOB_HELP,
    STORE_URL_HELP,
    _duration,
    _fraction,
    _grace,
    _positive_int,
    _size,
    add_store_args,
    store_options,
)
from agent.cli.shared import VerifyFailed, default_node, require_store, step_named
from transfer.format.names import check_name

if TYPE_CHECKING:
    from agent.cli.args import Commands
    from transfer.store.base import Store


def _pin_ttl(text: str) -> float:
    """--ttl: a duration of at most a pin's longest (a usage error, as a zero one is)."""
    from transfer.retention.pins import MAX_PIN_SECONDS

    ttl = _duration(text)
    if ttl > MAX_PIN_SECONDS:
        raise argparse.ArgumentTypeError(
            f"a pin lasts at most {MAX_PIN_SECONDS / 86400:.0f} days, got {text!r}"
        )
    return ttl


def add_retention(sub: Commands) -> None:
    p = sub.add_parser(
        "retention", help="apply a retention policy to a store: expire, demote, collect garbage"
    )
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("--keep-last", type=_positive_int, help="keep the newest N complete steps")
    p.add_argument("--keep-every", type=_positive_int, help="keep every step divisible by K")
    p.add_argument("--max-age", type=_duration, help="expire steps older than this (e.g. 30d)")
    p.add_argument("--budget", type=_size, help="drop the oldest steps above this (e.g. 2TiB)")
    p.add_argument(
        "--demote-to",
        metavar="STORE_URL",
        help="a colder store that keeps what this one drops (copied there first if missing)",
    )
    p.add_argument(
        "--grace",
        type=_grace,
        default=3600.0,
        help="unreferenced packs are deleted after this long (default 1h; must exceed a push)",
    )
    p.add_argument("--expected-nodes", default="", help="nodes whose parts make a step complete")
    p.add_argument("--deep-verify", action="store_true", help="re-hash demoted steps first")
    p.add_argument(
        "--repack-min-dead",
        type=_fraction,
        default=0.2,
        help="copy the live chunks out of packs with at least this fraction dead (default "
        "0.2); delta chunks whose base expired are stored whole either way",
    )
    p.add_argument(
        "--no-repack",
        action="store_true",
        help="free whole packs only: no re-encoding, no copying (space stays in kept packs)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    add_store_args(p)


def add_pins(sub: Commands) -> None:
    for name, text in (
        ("pin", "keep a step in a store: no retention deletes it until the pin expires"),
        ("unpin", "remove a pin set with `ferry pin` (or by an agent, with its --holder)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("store_url", help=STORE_URL_HELP)
        p.add_argument("--job", required=True, help=JOB_HELP)
        p.add_argument("--step", required=True, help="a step number, or 'latest'")
        p.add_argument(
            "--holder",
            default=None,
            help="whose pin (default: cli-<host name>); each holder's pin is its own",
        )
        if name == "pin":
            p.add_argument(
                "--ttl", type=_pin_ttl, default=7 * 86400.0, help="how long (default and most: 7d)"
            )
        add_store_args(p)


async def cmd_retention(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import time

    from transfer.retention import Tier, TierPolicy, apply_plan, make_plan
    from transfer.retention.repack import RepackPolicy
    from transfer.store import open_store

    policy = TierPolicy(args.keep_last, args.keep_every, args.max_age, args.budget)
    tiers = [Tier(store, policy)]
    colder = None
    if args.demote_to:
        colder = open_store(args.demote_to, store_options(args))
        tiers.append(Tier(colder, TierPolicy()))
    nodes = tuple(check_name("node", n) for n in args.expected_nodes.split(",") if n)
    try:
        for tier in tiers:  # the colder store too: a store is made on purpose
            await require_store(tier.store)
        repacking = None if args.no_repack else RepackPolicy(args.repack_min_dead)
        plan = await make_plan(tiers, now=time.time(), expected_nodes=nodes, repacking=repacking)
        await apply_plan(
            plan,
            tiers,
            grace_s=args.grace,
            holder=f"cli-{default_node()}",
            expected_nodes=nodes,
            deep_verify=args.deep_verify,
            dry_run=args.dry_run,
        )
    finally:
        if colder is not None:
            await colder.close()
    doc = plan.to_dict() | {"dry_run": args.dry_run}
    errors = [e for t in plan.tiers for e in t.errors]
    if errors:
        raise VerifyFailed(doc, plan.table())
    return doc, plan.table()


async def cmd_pin(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``ferry pin`` / ``ferry unpin``: the same pins agents and retention use. Unpinning
    what that holder never pinned exits 0 (it is not pinned, as asked) and says so: "was
    not pinned", ``"removed": false``."""
    from datetime import UTC, datetime

    from transfer.engine.catalog import list_parts
    from transfer.errors import CheckpointNotFoundError
    from transfer.retention.pins import pin, unpin

    check_name("job", args.job)
    holder = check_name("holder", args.holder or f"cli-{default_node()}")
    if args.step == "latest":
        await require_store(store)
    step = await step_named(store, args.job, args.step)
    what = f"{args.job} step {step}"
    if args.command == "unpin":
        removed = await unpin(store, args.job, step, holder)
        doc = {"job": args.job, "step": step, "holder": holder, "pinned": False}
        line = (
            f"unpinned {what} in {store.url} (holder {holder})"
            if removed
            else f"{what} in {store.url} was not pinned (holder {holder}): nothing to unpin"
        )
        return doc | {"removed": removed}, line
    await require_store(store)
    if not await list_parts(store, args.job, step):
        raise CheckpointNotFoundError(f"no committed checkpoint {what} in {store.url}")
    expires = await pin(store, args.job, step, holder, args.ttl)
    until = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
    doc = {"job": args.job, "step": step, "holder": holder, "pinned": True}
    return doc | {"expires_at": expires}, f"pinned {what} in {store.url} until {until} ({holder})"
