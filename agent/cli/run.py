"""``ferry``: push, pull, ls and verify checkpoints against a store URL (and a demo).

Exit codes: 0 success, 1 failure (one-line reason on stderr), 2 usage error.
With ``--json`` exactly one JSON object is printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from transfer.errors import CheckpointNotFoundError, FerryError, FormatError
from transfer.format.names import check_name, step_from_dirname
from transfer.options import StoreSettings, TransferOptions, TransferSettings, knobs
from transfer.units import format_size

if TYPE_CHECKING:  # the commands import what they need when they run: `ferry --help` is fast
    from transfer.engine.progress import Progress
    from transfer.store import StoreOptions
    from transfer.store.base import Store

    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


S = TypeVar("S")


def _default_node() -> str:
    import socket

    return os.environ.get("FERRY_NODE") or socket.gethostname().split(".")[0] or "node"


def _add_store_args(p: argparse.ArgumentParser, *, writes: bool = True) -> None:
    p.add_argument("--endpoint-url", help="S3 endpoint (default: $AWS_ENDPOINT_URL)")
    _add_knobs(p, StoreSettings, writes)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _add_transfer_args(p: argparse.ArgumentParser, *, writes: bool = True) -> None:
    _add_knobs(p, TransferSettings, writes)


def _add_knobs(p: argparse.ArgumentParser, settings: type, writes: bool) -> None:
    """A flag per tunable the settings class declares (transfer/options.py). A command
    that only reads (``writes`` false) does not list the knobs only writing uses; it still
    accepts them, so one set of flags serves a script's push and pull alike."""
    for knob in knobs(settings):
        flag = "--" + knob.name.replace("_", "-")
        listed = writes or not knob.writes
        if knob.kind is bool:  # a switch: --delta / --no-delta
            on = f"{knob.help} (default {'on' if knob.default else 'off'})"
            p.add_argument(
                flag,
                action="store_true",
                default=knob.default,
                help=on if listed else argparse.SUPPRESS,
            )
            p.add_argument(
                "--no-" + flag[2:],
                dest=knob.name,
                action="store_false",
                help=f"{flag} off" if listed else argparse.SUPPRESS,
            )
        else:
            p.add_argument(
                flag,
                type=knob.kind,
                choices=knob.choices or None,
                default=knob.default,
                help=f"{knob.help} {knob.default_help()}" if listed else argparse.SUPPRESS,
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_init, _add_push, _add_pull, _add_listings, _add_agent, _add_estimate,
                _add_plan, _add_demo, _add_retention, _add_pins, _add_verify):  # fmt: skip
        add(sub)
    return parser


def _add_init(sub: _Commands) -> None:
    p = sub.add_parser(
        "init",
        help="make a store: an empty (or missing) directory or prefix gets ferry-store.json; "
        "an existing store is left as it is",
    )
    p.add_argument("store_url")
    _add_store_args(p)


def _add_push(sub: _Commands) -> None:
    p = sub.add_parser("push", help="push a checkpoint directory to a store")
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("store_url")
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, help="default: the number in the directory name")
    p.add_argument("--node", default=None, help="default: $FERRY_NODE or the host name")
    p.add_argument("--base-step", type=int, help="delta base (default: the previous step)")
    p.add_argument(
        "--base-dir",
        type=Path,
        help="local copy of the base checkpoint (default: a sibling step dir)",
    )
    p.add_argument(
        "--full",
        dest="delta",
        action="store_false",
        help="store a keyframe: no delta base (as --no-delta)",
    )
    p.add_argument(
        "--part",
        action="store_true",
        help="CKPT_DIR is this node's part of a multi-node save (rank 0's node holds "
        ".metadata): files it names may be on other nodes; those here must be whole",
    )
    p.add_argument(
        "--init",
        action="store_true",
        help="make STORE_URL a store first if it is not one yet (as `ferry init`; for scripts)",
    )
    _add_store_args(p)
    _add_transfer_args(p)


def _add_pull(sub: _Commands) -> None:
    p = sub.add_parser("pull", help="pull a checkpoint from a store into a new directory")
    p.add_argument("store_url")
    p.add_argument("dest_dir", type=Path)
    p.add_argument("--job", required=True)
    p.add_argument("--step", default="latest", help="a step number or 'latest' (default)")
    p.add_argument("--node", default=None, help="only this node's part (default: all parts)")
    p.add_argument(
        "--base-dir",
        type=Path,
        help="a local checkpoint of the job: chunks it holds are not downloaded",
    )
    p.add_argument(
        "--fsync",
        action="store_true",
        help="flush every file to disk before returning (default: return once renamed into "
        "place; a marker beside it lets a later pull or agent remove it if the machine went "
        "down before the kernel wrote it back)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="with --ranks: pull only the share of a DCP step those ranks of a world of this "
        "size read (Shard(0) split; .metadata whole); the copy is marked partial",
    )
    p.add_argument("--ranks", help="the ranks this node will run: A,B or A-B (with --world-size)")
    p.add_argument(
        "--items",
        type=Path,
        help="pull only the storage items this JSON list names ([{path, offset, length}], "
        "as written by transfer.engine.dcpplan_torch for layouts the rule does not cover)",
    )
    _add_store_args(p, writes=False)
    _add_transfer_args(p, writes=False)


def _add_listings(sub: _Commands) -> None:
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("store_url")
    p.add_argument("--job")
    _add_store_args(p, writes=False)

    p = sub.add_parser(
        "du", help="what a store's bytes are for: per step own/shared, dead, what expiring frees"
    )
    p.add_argument("store_url")
    p.add_argument("--job", help="only this job's steps (totals stay store-wide)")
    _add_store_args(p, writes=False)


def _add_agent(sub: _Commands) -> None:
    p = sub.add_parser("agent", help="run the node agent (RPC; prefetch, estimates, pins)")
    p.add_argument("--config", type=Path, help="TOML file; every key also FERRY_<KEY>")
    p.add_argument("--print-example-config", action="store_true")


def _add_estimate(sub: _Commands) -> None:
    p = sub.add_parser("estimate", help="ask an agent what moving a checkpoint there costs")
    p.add_argument("agent_url", help="e.g. http://node-b:7070 (https:// for a TLS agent)")
    p.add_argument("--token-file", type=Path, required=True)
    _add_tls_args(p)
    p.add_argument("--job", required=True)
    p.add_argument("--step", default="latest")
    p.add_argument("--gpus", type=int, default=1, help="GPUs idle while the job migrates")
    p.add_argument("--gpu-hour-price", type=float, default=0.0)
    p.add_argument("--json", action="store_true")


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", type=Path, help="verify an https agent against this CA bundle "
                   "(the agents' tls_ca_file; default: the system store)")  # fmt: skip
    p.add_argument("--cert-file", type=Path, help="client certificate, for an agent with "
                   "tls_client_auth (PEM; the key in it, or --key-file)")  # fmt: skip
    p.add_argument("--key-file", type=Path, help="the client certificate's key (PEM)")


def _add_plan(sub: _Commands) -> None:
    p = sub.add_parser("plan", help="badput and the checkpoint interval that minimises it")
    p.add_argument("--save-seconds", type=float, required=True, help="training stall per save")
    p.add_argument("--step-seconds", type=float, required=True, help="one training step")
    p.add_argument(
        "--mtbi-hours", type=float, required=True, help="mean time between interruptions"
    )
    p.add_argument("--interval-steps", type=int, help="the interval in use now, to compare")
    p.add_argument("--restart-seconds", type=float, default=0.0)
    p.add_argument("--json", action="store_true")


def _add_demo(sub: _Commands) -> None:
    p = sub.add_parser("demo", help="run the whole flow on generated checkpoints")
    p.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")


def _add_retention(sub: _Commands) -> None:
    p = sub.add_parser(
        "retention", help="apply a retention policy to a store: expire, demote, collect garbage"
    )
    p.add_argument("store_url")
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
    _add_store_args(p)


def _add_pins(sub: _Commands) -> None:
    for name, text in (
        ("pin", "keep a step in a store: no retention deletes it until the pin expires"),
        ("unpin", "remove a pin set with `ferry pin` (or by an agent, with its --holder)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("store_url")
        p.add_argument("--job", required=True)
        p.add_argument("--step", type=int, required=True)
        p.add_argument(
            "--holder",
            default=None,
            help="whose pin (default: cli-<host name>); each holder's pin is its own",
        )
        if name == "pin":
            p.add_argument(
                "--ttl", type=_duration, default=7 * 86400.0, help="how long (default and most: 7d)"
            )
        _add_store_args(p)


def _add_verify(sub: _Commands) -> None:
    p = sub.add_parser("verify", help="re-hash every stored chunk; exit 1 naming bad ones")
    p.add_argument("store_url")
    p.add_argument("--job")
    p.add_argument("--step", type=int)
    _add_store_args(p, writes=False)
    _add_transfer_args(p, writes=False)


def _transfer_options(args: argparse.Namespace) -> TransferOptions:
    return _chosen(args, TransferSettings).to_options()


def _store_options(args: argparse.Namespace) -> StoreOptions:
    """The store options the command line chose, its pool sized to the window the command
    runs with (``--memory-mib`` may shrink ``--window``; the default window where a command
    has no transfer flags)."""
    from transfer.store import StoreOptions

    window = _transfer_options(args).window if hasattr(args, "window") else TransferOptions.window
    settings = _chosen(args, StoreSettings)
    return StoreOptions.for_window(window, endpoint_url=args.endpoint_url, settings=settings)


def _chosen(args: argparse.Namespace, settings: type[S]) -> S:
    """The settings the command line chose (each flag has its declared default)."""
    return settings(**{k.name: getattr(args, k.name) for k in knobs(settings)})


def _progress(args: argparse.Namespace) -> Progress:
    from agent.cli.progress import TerminalProgress
    from transfer.engine.progress import NoProgress

    return TerminalProgress() if not args.json and sys.stderr.isatty() else NoProgress()


async def _require_store(store: Store, *, hint: str = "") -> None:
    """The one check that a URL given to a command is a ckpt-ferry store, before the
    command reads or writes anything there (a typo'd URL must not look like an empty store,
    nor a directory in use for something else become one): NotAStoreError naming
    ``ferry init`` (``hint`` appended), from ``require_store``."""
    from transfer.engine.catalog import require_store

    await require_store(store, hint=hint)


#: every size the CLI prints: decimal MB/GB (transfer/units.py; retention's tables too)
_human = format_size


async def _cmd_init(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine.catalog import init_store

    created = await init_store(store)  # idempotent: an existing store is left as it is
    return {"store": store.url, "created": created}, (
        f"created a ckpt-ferry store at {store.url}"
        if created
        else f"{store.url} is already a ckpt-ferry store (nothing changed)"
    )


async def _cmd_push(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from agent.node.journal import cli_push_journal, default_state_dir
    from transfer.engine import PushPlan, push
    from transfer.engine.catalog import init_store

    step = args.step if args.step is not None else step_from_dirname(args.ckpt_dir.name)
    if step is None:
        raise _UsageError(f"cannot tell the step from {args.ckpt_dir.name!r}: pass --step")
    node = args.node or _default_node()
    check_name("job", args.job)
    check_name("node", node)
    # before anything is written anywhere: a directory that is no store stays untouched
    await (init_store(store) if args.init else _require_store(store, hint=" (or pass --init)"))
    if not args.node and not os.environ.get("FERRY_NODE"):
        await _warn_if_new_part(store, args.job, step, node)
    # a push killed half way and run again reuses the packs it had made durable
    journal = cli_push_journal(default_state_dir(), store.url, args.job, step, node, args.ckpt_dir)
    try:
        r = await push(
            store,
            args.ckpt_dir,
            job=args.job,
            step=step,
            node=node,
            options=_transfer_options(args),
            progress=_progress(args),
            plan=PushPlan(
                base_step=args.base_step,
                base_dir=args.base_dir,
                resume=journal.resume(args.job, step, store.url),
                part=args.part,
                create_store=False,
            ),
        )
        journal.remove()  # committed: its manifest references every pack
    finally:
        journal.close()
    rate = r.bytes_raw / r.seconds / 1e6 if r.seconds else 0.0
    note = " (already committed, identical)" if r.already_committed else ""
    line = (
        f"pushed {r.job} step {r.step} node {r.node}: {r.files} files, {_human(r.bytes_raw)}, "
        f"wrote {_human(r.bytes_transferred)} ({r.chunks_deduped}/{r.chunks_total} chunks "
        f"deduplicated, {r.chunks_delta} delta-coded"
        + (f" against step {r.base_step}" if r.base_step is not None else "")
        + f") in {r.seconds:.2f}s, {rate:,.0f} MB/s{note}"
    )
    return r.to_dict(), line


async def _warn_if_new_part(store: Store, job: str, step: int, node: str) -> None:
    """The node name defaulted to the host name, and the step already has other nodes'
    parts: in a container every run is a new host, so say what is about to happen."""
    from transfer.engine.catalog import list_parts

    nodes = [c.node for c in await list_parts(store, job, step)]
    if nodes and node not in nodes:
        print(
            f"ferry push: note: {job} step {step} already has parts from node(s) "
            f"{', '.join(nodes)}; this push adds one as node {node!r} (the host name, used "
            "when neither --node nor FERRY_NODE is set)",
            file=sys.stderr,
        )


async def _cmd_pull(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine import PullEvents, PullPlan, Sources, pull
    from transfer.engine.settle import settle

    step = None if args.step == "latest" else _parse_step(args.step)
    # restores an earlier run left unconfirmed: confirm them, or drop them after a reboot
    import asyncio

    await asyncio.to_thread(settle, args.dest_dir.absolute().parent)
    manifests, share = await _share_of(store, args, step)
    r = await pull(
        store,
        args.dest_dir,
        PullPlan(args.job, step, args.node, manifests, share=share, fsync=args.fsync),
        Sources(base_dir=args.base_dir),
        PullEvents(progress=_progress(args)),
        _transfer_options(args),
    )
    rate = r.bytes_raw / r.seconds / 1e6 if r.seconds else 0.0
    what = f"{_human(r.bytes_raw)}"
    if share is not None:
        of = f"ranks {args.ranks} of {args.world_size}" if share.layout else "the items listed"
        what = f"the share of {of}: {_human(share.nbytes)} of storage items, {what} of files"
    line = (
        f"pulled {r.job} step {r.step} ({len(r.nodes)} part(s)) into {r.dest}: {r.files} files, "
        f"{what}, read {_human(r.bytes_transferred)}"
        + (
            f" (with {r.base_dir}: {r.chunks_local} chunks reused, {r.bases_local} decoded"
            " against its bytes)"
            if r.base_dir
            else ""
        )
        + f" in {r.seconds:.2f}s, "
        f"{rate:,.0f} MB/s, every chunk verified"
    )
    return r.to_dict(), line


async def _share_of(store: Store, args: argparse.Namespace, step: int | None) -> tuple[Any, Any]:
    """(manifests, share) of a share pull (--world-size/--ranks or --items), else (None, None)."""
    if args.world_size is None and args.ranks is None and args.items is None:
        return None, None
    if args.items is not None and (args.world_size is not None or args.ranks is not None):
        raise _UsageError("--items names the share itself: leave out --world-size and --ranks")
    if args.items is None and (args.world_size is None or args.ranks is None):
        raise _UsageError("a share needs both --world-size W and --ranks A,B (or --items FILE)")
    if args.node is not None:
        raise _UsageError("a share is read from every node's part: leave out --node")
    import json

    from transfer.engine.catalog import Catalog, resolve_manifests
    from transfer.engine.dcpshare import Layout, parse_ranks
    from transfer.engine.share import plan_share

    items = layout = None
    if args.items is not None:
        try:
            items = json.loads(args.items.read_bytes())
        except (OSError, ValueError) as exc:
            raise _UsageError(f"--items {args.items}: {exc}") from None
    else:
        layout = Layout(args.world_size, parse_ranks(args.ranks))
    manifests = await resolve_manifests(store, args.job, step)
    return manifests, await plan_share(Catalog(store), manifests, layout, items)


async def _cmd_ls(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine.catalog import list_checkpoints, load_manifest
    from transfer.format.manifest import chain_depths

    if args.job:
        check_name("job", args.job)
    rows: list[dict[str, Any]] = []
    await _require_store(store)
    found = await list_checkpoints(store, args.job)
    if args.job and not found:
        jobs = sorted({c.job for c in await list_checkpoints(store)})
        raise CheckpointNotFoundError(
            f"no checkpoint of job {args.job!r} in {store.url} (jobs there: "
            f"{', '.join(jobs) or 'none'})"
        )
    for c in found:
        try:
            m = await load_manifest(store, c.job, c.step, c.node)
        except FormatError as exc:  # listed as what it is; the others still are
            rows.append({"job": c.job, "step": c.step, "node": c.node, "error": str(exc)})
            continue
        depths = chain_depths(m)
        content = [ch for f in m.files for ch in f.chunks]
        rows.append(
            {
                "job": c.job,
                "step": c.step,
                "node": c.node,
                "files": len(m.files),
                "bytes_raw": m.bytes_raw,
                "created_at": m.created_at,
                # how it is coded: 0 is a keyframe; N: some chunk needs N decodes (a cold
                # pull of it also fetches the bases)
                "chain_depth": max((depths[ch.id] for ch in content), default=0),
                "delta_chunks": sum(ch.base is not None for ch in content),
                "chunks": len(content),
            }
        )
    table = [
        f"{'JOB':<24} {'STEP':>10} {'NODE':<16} {'FILES':>6} {'SIZE':>12}  {'CODED':<18} CREATED"
    ]
    table += [
        f"{r['job']:<24} {r['step']:>10} {r['node']:<16} "
        + (
            f"UNREADABLE: {r['error']}"
            if "error" in r
            else f"{r['files']:>6} {_human(r['bytes_raw']):>12}  {_coded(r):<18} {r['created_at']}"
        )
        for r in rows
    ]
    return {"store": store.url, "checkpoints": rows}, "\n".join(table)


def _coded(row: dict[str, Any]) -> str:
    if not row["delta_chunks"]:
        return "keyframe"
    share = 100 * row["delta_chunks"] // max(row["chunks"], 1)
    return f"delta {share}%, depth {row['chain_depth']}"


async def _cmd_du(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import time

    from transfer.engine.catalog import list_checkpoints
    from transfer.retention import take_inventory
    from transfer.retention.policy import format_size as size
    from transfer.retention.usage import store_usage

    if args.job:
        check_name("job", args.job)
    await _require_store(store)
    if args.job and not await list_checkpoints(store, args.job):
        raise CheckpointNotFoundError(f"no checkpoint of job {args.job!r} in {store.url}")
    now = time.time()
    u = store_usage(await take_inventory(store, now=now), now=now, job=args.job)
    lines = [
        f"{u.url}: {size(u.total_bytes)} stored: {size(u.live_bytes)} live, "
        f"{size(u.dead_bytes)} dead inside kept packs, {size(u.unreferenced_bytes)} in "
        f"{u.unreferenced_packs} unreferenced packs, {size(u.manifest_bytes)} of manifests"
        + (
            f"; and {size(u.unfinished_upload_bytes)} in {u.unfinished_uploads} unfinished "
            "pack uploads (a running push's, or a killed one's: retention aborts those)"
            if u.unfinished_uploads
            else ""
        ),
        f"{'JOB':<24} {'STEP':>10} {'NODES':>5} {'RAW':>10} {'OWN':>10} {'SHARED':>10} "
        f"{'FREES':>10}  NOTE",
    ]
    for r in u.steps:
        note = ", ".join(
            n for n, on in (("pinned", r.pinned), ("incomplete", not r.complete)) if on
        )
        lines.append(
            f"{r.job:<24} {r.step:>10} {len(r.nodes):>5} {size(r.bytes_raw):>10} "
            f"{size(r.own_bytes):>10} {size(r.shared_bytes):>10} {size(r.frees_bytes):>10}  "
            f"{note}".rstrip()
        )
    lines += [
        f"retention {e.policy}: {size(e.bytes_after)} left, frees {size(e.frees_bytes)}"
        for e in u.policies
    ]
    return u.to_dict(), "\n".join(lines)


async def _cmd_pin(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``ferry pin`` / ``ferry unpin``: the same pins agents and retention use. Unpinning
    what that holder never pinned exits 0 (it is not pinned, as asked) and says so: "was
    not pinned", ``"removed": false``."""
    from datetime import UTC, datetime

    from transfer.engine.catalog import list_parts
    from transfer.errors import CheckpointNotFoundError
    from transfer.retention.pins import pin, unpin

    check_name("job", args.job)
    holder = check_name("holder", args.holder or f"cli-{_default_node()}")
    what = f"{args.job} step {args.step}"
    if args.command == "unpin":
        removed = await unpin(store, args.job, args.step, holder)
        doc = {"job": args.job, "step": args.step, "holder": holder, "pinned": False}
        line = (
            f"unpinned {what} in {store.url} (holder {holder})"
            if removed
            else f"{what} in {store.url} was not pinned (holder {holder}): nothing to unpin"
        )
        return doc | {"removed": removed}, line
    await _require_store(store)
    if not await list_parts(store, args.job, args.step):
        raise CheckpointNotFoundError(f"no committed checkpoint {what} in {store.url}")
    expires = await pin(store, args.job, args.step, holder, args.ttl)
    until = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
    doc = {"job": args.job, "step": args.step, "holder": holder, "pinned": True}
    return doc | {"expires_at": expires}, f"pinned {what} in {store.url} until {until} ({holder})"


async def _cmd_verify(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine import verify

    if args.job:
        check_name("job", args.job)
    r = await verify(store, job=args.job, step=args.step, options=_transfer_options(args))
    lines = [f"BAD manifest {why}" for why in r.bad_manifests]
    lines += [f"BAD chunk {b.chunk}: {b.reason}; needed by {', '.join(b.used_by)}" for b in r.bad]
    verdict = f"{len(r.bad)} BAD chunk(s)"
    if r.bad_manifests:
        verdict = f"{len(r.bad_manifests)} unreadable manifest(s), " + verdict
    lines.append(
        f"verified {r.checkpoints} checkpoint part(s), {r.chunks} chunks, "
        f"{_human(r.bytes_read)} read in {r.seconds:.2f}s: " + ("all good" if r.ok else verdict)
    )
    if not r.ok:
        raise _VerifyFailed(r.to_dict(), "\n".join(lines))
    return r.to_dict(), "\n".join(lines)


async def _cmd_retention(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import time

    from transfer.retention import Tier, TierPolicy, apply_plan, make_plan
    from transfer.retention.repack import RepackPolicy
    from transfer.store import open_store

    policy = TierPolicy(args.keep_last, args.keep_every, args.max_age, args.budget)
    tiers = [Tier(store, policy)]
    colder = None
    if args.demote_to:
        colder = open_store(args.demote_to, _store_options(args))
        tiers.append(Tier(colder, TierPolicy()))
    nodes = tuple(check_name("node", n) for n in args.expected_nodes.split(",") if n)
    try:
        for tier in tiers:  # the colder store too: a store is made on purpose
            await _require_store(tier.store)
        repacking = None if args.no_repack else RepackPolicy(args.repack_min_dead)
        plan = await make_plan(tiers, now=time.time(), expected_nodes=nodes, repacking=repacking)
        await apply_plan(
            plan,
            tiers,
            grace_s=args.grace,
            holder=f"cli-{_default_node()}",
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
        raise _VerifyFailed(doc, plan.table())
    return doc, plan.table()


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _duration(text: str) -> float:
    from transfer.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _grace(text: str) -> float:
    from transfer.retention import parse_duration

    try:
        return parse_duration(text, allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from transfer.retention import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _UsageError(Exception):
    pass


class _VerifyFailed(Exception):
    def __init__(self, doc: dict[str, Any], text: str) -> None:
        super().__init__(text)
        self.doc, self.text = doc, text


def _parse_step(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise _UsageError(f"--step must be a number or 'latest', not {value!r}") from None


_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], Awaitable[tuple[dict[str, Any], str]]]]
_COMMANDS = {
    "init": _cmd_init,
    "pin": _cmd_pin,
    "unpin": _cmd_pin,
    "push": _cmd_push,
    "pull": _cmd_pull,
    "ls": _cmd_ls,
    "du": _cmd_du,
    "verify": _cmd_verify,
    "retention": _cmd_retention,
}


async def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.store import open_store

    if args.store_url.startswith("memory://"):
        # an in-process store ends with this process: a push would "succeed" into nothing
        raise _UsageError(
            f"{args.store_url}: an in-process (memory://) store lives only as long as one "
            "command; use a path, file:// or s3:// (memory:// is for code and tests)"
        )
    store = open_store(args.store_url, _store_options(args))
    try:
        return await _COMMANDS[args.command](store, args)
    finally:
        await store.close()


async def _cmd_estimate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import aiohttp

    from agent.rpc.client import FerryClient, RpcError

    token = args.token_file.read_text().strip()
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
    async with FerryClient(args.agent_url, token, **tls) as client:
        try:
            doc: dict[str, Any] = await client.estimate(
                args.job, args.step, gpus=args.gpus, gpu_hour_price=args.gpu_hour_price
            )
        except (RpcError, aiohttp.ClientError, TimeoutError) as exc:
            raise FerryError(f"{client.base_url}: {str(exc) or type(exc).__name__}") from None
    line = (
        f"{doc['node']}: {args.job} step {doc['step']}: {_human(doc['bytes_missing'])} missing "
        f"of {_human(doc['bytes_total'])}, ~{doc['seconds']:.1f}s, cost {doc['cost']:.2f} "
        f"({args.gpus} GPUs); recommended scale-down cooldown {doc['cooldown_seconds']:.0f}s"
    )
    return doc, line


def _plan(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from agent.node.estimate import badput_fraction, optimal_interval_steps

    mtbi = args.mtbi_hours * 3600
    best = optimal_interval_steps(args.save_seconds, args.step_seconds, mtbi)
    doc: dict[str, Any] = {
        "optimal_interval_steps": best,
        "optimal_badput": badput_fraction(
            args.save_seconds, best * args.step_seconds, mtbi, args.restart_seconds
        ),
    }
    line = (
        f"save every {best} steps ({best * args.step_seconds:.0f}s): badput "
        f"{doc['optimal_badput']:.2%} of training time"
    )
    if args.interval_steps:
        now = badput_fraction(
            args.save_seconds, args.interval_steps * args.step_seconds, mtbi, args.restart_seconds
        )
        doc["current_interval_steps"], doc["current_badput"] = args.interval_steps, now
        line += f"; every {args.interval_steps} steps (now): {now:.2%}"
    return doc, line


def main(argv: list[str] | None = None) -> int:
    """The ``ferry`` command. Its one broken-pipe rule: output cut short by its reader
    (``ferry ls | head -1``) ends the command quietly, as a tool killed by SIGPIPE does."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # what is still buffered would fail again at exit: send it nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13  # SIGPIPE


class _Terminated(Exception):
    """SIGTERM arrived: the command was cancelled and its cleanups ran."""


def _run_terminable(command: Coroutine[Any, Any, S]) -> S:
    """``asyncio.run``, with SIGTERM cancelling the command the way Ctrl-C does, so its
    cleanups run (a push releases its lease and aborts its unfinished uploads) instead of
    the process vanishing mid-write and leaving them behind."""
    import asyncio
    import signal

    terminated = False

    async def run() -> S:
        nonlocal terminated
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def on_term() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_term)
        try:
            return await command
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(run())
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated() from None
        raise


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import asyncio  # only now: `ferry --help` never needs it (~0.1 s of start-up)

    if args.command == "agent":
        from agent.daemon.run import run_agent  # the agent's config is the daemon's, not the CLI's

        return run_agent(args.config, print_example_config=args.print_example_config)
    if args.command in ("estimate", "plan"):
        try:
            doc, line = (
                asyncio.run(_cmd_estimate(args)) if args.command == "estimate" else _plan(args)
            )
        except (FerryError, ValueError, OSError) as exc:
            print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(doc) if args.json else line)
        return 0
    if args.command == "demo":
        from agent.cli.demo import main as demo

        return demo(args.workdir, keep=args.workdir is not None)
    try:
        doc, line = _run_terminable(_run(args))
    except _UsageError as exc:
        parser.error(str(exc))  # exits 2
    except _VerifyFailed as exc:
        if args.json:
            print(json.dumps(exc.doc))
        print(exc.text, file=sys.stderr)
        return 1
    except (FerryError, ValueError, OSError) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        if args.json:
            print(json.dumps({"ok": False, "error": msg, "error_type": type(exc).__name__}))
        print(f"ferry {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ferry {args.command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"ferry {args.command}: terminated (SIGTERM); stopped cleanly", file=sys.stderr)
        return 128 + 15
    if args.json:
        print(json.dumps(doc))
    else:
        print(line)
    return 0
