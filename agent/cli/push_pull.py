"""``ferry init``, ``ferry push`` and ``ferry pull``: making a store, and moving a checkpoint
directory into it and out of it (a whole step, one node's part, or a share of a DCP step)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.args import (
    JOB_HELP,
    STORE_URL_HELP,
    UsageError,
    add_store_args,
    add_transfer_args,
    parse_step,
    transfer_options,
)
from agent.cli.shared import default_node, human, require_store
from transfer.format.layout import STORE_DESCRIPTOR_KEY
from transfer.format.names import check_name, step_from_dirname
from transfer.units import format_rate

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.cli.args import Commands
    from transfer.engine.progress import Progress
    from transfer.options import TransferOptions
    from transfer.store.base import Store


def add_init(sub: Commands) -> None:
    p = sub.add_parser(
        "init",
        help="make a store: an empty (or missing) directory or prefix gets ferry-store.json; "
        "an existing store is left as it is",
    )
    p.add_argument("store_url", help=STORE_URL_HELP)
    add_store_args(p)


def add_push(sub: Commands) -> None:
    p = sub.add_parser("push", help="push a checkpoint directory to a store")
    p.add_argument("ckpt_dir", type=Path, help="the checkpoint's directory (one step)")
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("--job", required=True, help=JOB_HELP)
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
    add_store_args(p)
    add_transfer_args(p)


def add_pull(sub: Commands) -> None:
    p = sub.add_parser(
        "pull",
        help="pull a checkpoint from a store into a new directory",
        epilog="With FERRY_LOCAL_SOCKET naming the local_socket of this node's agent (of your "
        "user), a pull of one of its tiers is done by the agent (its connections and buffers "
        "warm); a transfer or store flag given, or anything the agent does not serve, pulls "
        "here, after a line saying why.",
    )
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("dest_dir", type=Path, help="a new or empty directory to restore into")
    p.add_argument("--job", required=True, help=JOB_HELP)
    p.add_argument("--step", default="latest", help="a step number or 'latest' (default)")
    p.add_argument("--node", default=None, help="only this node's part (default: all parts)")
    p.add_argument(
        "--expected-nodes",
        default="",
        help="the job's nodes, A,B,...: a step is whole once each has its part in, even "
        "without its completion marker (the node that writes it died); by default a step "
        "of a job that writes markers is whole by its marker",
    )
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
    add_store_args(p, writes=False)
    add_transfer_args(p, writes=False)


async def cmd_init(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine.catalog import init_store

    created = await init_store(store)  # idempotent: an existing store is left as it is
    return {"store": store.url, "created": created}, (
        f"created a ckpt-ferry store at {store.url}"
        if created
        else f"{store.url} is already a ckpt-ferry store (nothing changed)"
    )


async def cmd_push(
    store: Store, args: argparse.Namespace, progress: Progress
) -> tuple[dict[str, Any], str]:
    """``progress``: what main shows while the push runs (run.py chooses it)."""
    from agent.node.journal import cli_push_journal
    from agent.node.statedir import default_state_dir
    from transfer.engine import PushPlan, push
    from transfer.engine.catalog import init_store
    from transfer.engine.dcp import metadata_trouble
    from transfer.engine.scan import check_checkpoint_dir

    check_checkpoint_dir(args.ckpt_dir)
    if (args.ckpt_dir / STORE_DESCRIPTOR_KEY).is_file():  # (the arguments swapped, most likely)
        raise UsageError(
            f"{args.ckpt_dir} is a ckpt-ferry store, not a checkpoint: "
            "ferry push CHECKPOINT_DIR STORE_URL"
        )
    own = step_from_dirname(args.ckpt_dir.name, strict=True)
    steps = [] if own is not None else _step_dirs(args.ckpt_dir)
    if steps:  # (a job's directory: pushed as one step, its steps would nest inside it)
        raise UsageError(
            f"{args.ckpt_dir} holds step directories ({', '.join(steps[:3])}"
            f"{', ...' if len(steps) > 3 else ''}): push one of them"
        )
    step = args.step if args.step is not None else own
    if step is None:
        raise UsageError(
            f"cannot tell the step from {args.ckpt_dir.name!r}: name the directory after its "
            "step (step_000120, checkpoint-500) or pass --step"
        )
    node = default_node() if args.node is None else args.node  # (--node "" is refused)
    check_name("job", args.job)
    check_name("node", node)
    trouble = metadata_trouble(args.ckpt_dir)
    if trouble == "missing" and not args.part:
        # pushed, it would be the job's newest step, which `latest` and retention's
        # keep-last count, though no DCP load of it can succeed (a newcomer's trial: retention
        # then expired the step before it, the last loadable one)
        raise UsageError(
            f"{args.ckpt_dir} holds DCP shards but no .metadata (DCP writes it last: an "
            "unfinished save?): wait for the save to finish, or push one node's part of a "
            "multi-node save with --part"
        )
    # before anything is written anywhere: a directory that is no store stays untouched
    await (init_store(store) if args.init else require_store(store, hint=" (or pass --init)"))
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
            options=transfer_options(args),
            progress=progress,
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
    if trouble == "unreadable":
        print(
            f"ferry push: note: {args.ckpt_dir}/.metadata is not DCP metadata ferry can "
            "read (torn, empty or foreign?): the step was pushed as it is, but a share of "
            "it cannot be planned and a DCP load of it will likely fail",
            file=sys.stderr,
        )
    note = " (already committed, identical)" if r.already_committed else ""
    line = (
        f"pushed {r.job} step {r.step} node {r.node}: {r.files} files, {human(r.bytes_raw)}, "
        f"wrote {human(r.bytes_transferred)} ({r.chunks_deduped}/{r.chunks_total} chunks "
        f"deduplicated, {r.chunks_delta} delta-coded"
        + (f" against step {r.base_step}" if r.base_step is not None else "")
        + (f", {r.chunks_resumed} sent by the interrupted attempt" if r.chunks_resumed else "")
        + f") in {r.seconds:.2f}s ({format_rate(r.bytes_raw, r.seconds)} of checkpoint){note}"
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


def _step_dirs(root: Path) -> list[str]:
    """The subdirectories of ``root`` named like a checkpoint of a step (``step_000120``)."""
    return sorted(d.name for d in root.iterdir() if d.is_dir() and _STEP_DIR.fullmatch(d.name))


_STEP_DIR = re.compile(r"(global_)?step[_-]?[0-9]+|checkpoint[_-][0-9]+")


def _pull_options(args: argparse.Namespace) -> TransferOptions:
    """The flags' transfer options; under ``auto``, the way this node's agent chose for the
    disk the restore writes to (the destination's nearest existing parent: its staging
    directory's) when it probed it (agent/node/writechoice.py), else warm."""
    import dataclasses

    from agent.cli.viaagent import nearest_dir
    from agent.node.writechoice import recorded_choice

    options = transfer_options(args)
    if options.write_path != "auto":
        return options
    try:
        device = nearest_dir(str(args.dest_dir.absolute()))[1]
    except OSError:  # (a link that leads nowhere: the pull says what is wrong)
        return options
    if (first := recorded_choice(device)) is not None:
        options = dataclasses.replace(options, page_cache_first=first)
    return options


async def cmd_pull(
    store: Store,
    args: argparse.Namespace,
    progress: Progress,
    *,
    options: TransferOptions | None = None,
    say: Callable[[str], None] | None = None,
    implicit_base: Callable[[int], contextlib.AbstractContextManager[Path | None]] | None = None,
) -> tuple[dict[str, Any], str]:
    """``progress``: what main shows while the pull runs (run.py chooses it); ``options``:
    the transfer's, else the flags'; ``say``: where its notes go, else stderr (an agent
    pulling for a caller on its local socket passes its own: agent/rpc/routes/pull.py);
    ``implicit_base``: without ``--base-dir``, the base for the step once it is resolved
    (held while the pull runs: the agent's own copy of an earlier step)."""
    say = say or _to_stderr
    from transfer.engine import PullEvents, PullPlan, Sources, pull
    from transfer.engine.pull import resolve_plan
    from transfer.engine.settle import settle

    step = None if args.step == "latest" else parse_step(args.step)
    options = options or _pull_options(args)
    # restores an earlier run left unconfirmed: confirm them, or drop them after a reboot
    import asyncio

    def checking(dest: Path) -> None:
        say(f"ferry: {dest}: restored before the last reboot; reading it back to check it...")

    parent = args.dest_dir.absolute().parent
    for found in await asyncio.to_thread(settle, parent, True, checking):
        if found.whole:
            say(f"ferry: {found.dest}: restored before the last reboot; {found.why}: whole, kept")
        else:
            say(f"ferry: {found.dest}: restored before the last reboot and not whole on the "
                f"disk ({found.why}): moved to {found.moved_to}; pull it again")  # fmt: skip
    expected = tuple(check_name("node", n) for n in args.expected_nodes.split(",") if n)

    def waiting(lock: Path, holder: str, waited: float) -> None:
        who = f"{holder}, " if holder else ""
        still = f"still waiting ({waited:.0f} s)" if waited else "waiting for it"
        say(f"ferry pull: another pull into {args.dest_dir} is running ({who}holding {lock}): "
            f"{still}, then taking up what it leaves")  # fmt: skip

    from transfer.engine.catalog import missing
    from transfer.engine.parts import drop_common_index
    from transfer.engine.share import base_dir_parts
    from transfer.engine.stepparts import index_chunks
    from transfer.errors import CheckpointNotFoundError, FerryError, IntegrityError

    stale: IntegrityError | None = None  # what a chunk the common index supplied did
    try:
        for use_index in (True, False):  # (no index: a chunk it supplied failed)
            manifests, share = await _share_of(store, args, step, expected, use_index)
            with contextlib.ExitStack() as held:
                base_dir = args.base_dir
                if base_dir is None and implicit_base is not None:
                    if manifests is None:  # (the step first: the base is the one before it)
                        manifests = await resolve_plan(store, PullPlan(
                            args.job, step, args.node, expected_nodes=expected))  # fmt: skip
                    base_dir = held.enter_context(implicit_base(manifests[0].step))
                base_manifests = None
                if share is not None:  # of the base step too, only the parts with its files
                    base_manifests = await base_dir_parts(
                        store, args.job, manifests, base_dir, use_index
                    )
                indexed = index_chunks(manifests or ())
                plan = PullPlan(args.job, step, args.node, manifests, share=share,
                                fsync=args.fsync, expected_nodes=expected)  # fmt: skip
                sources = Sources(base_dir=base_dir, base_manifests=base_manifests)
                try:
                    r = await pull(
                        store, args.dest_dir, plan, sources,
                        PullEvents(progress=progress, waiting=waiting),
                        options,
                    )  # fmt: skip
                    break
                except IntegrityError as exc:  # (a pack gone, or not what it names)
                    if not set(exc.bad_chunks) & indexed:
                        raise
                    stale = exc  # the parts then say: the chunk lost, or the index stale
    except CheckpointNotFoundError:
        # a job or step the store lacks: what it holds instead, as ferry verify says it (a
        # listing, on this path only); a step there but not whole keeps its own reason
        await require_store(store)  # (not a store at all: say so, not "no checkpoints")
        if args.node is not None or (lacking := await missing(store, args.job, step)) is None:
            raise
        raise lacking from None
    if stale is not None and manifests:  # (the parts held what the index did not)
        say(
            f"ferry pull: {stale}, where the step's common index put it, but not where its "
            "part does: the index was stale (a repack by an older agent?); dropped"
        )
        with contextlib.suppress(FerryError):  # (so that no later reader tries it first)
            await drop_common_index(store, args.job, manifests[0].step)
    if r.already_there:  # (a pull run again after one killed once its restore was in place)
        line = (
            f"{r.dest} already holds {r.job} step {r.step} ({len(r.nodes)} part(s)): "
            f"{r.files} files, {human(r.bytes_raw)}, every chunk read back and verified; "
            "nothing fetched"
        )
        return r.to_dict(), line
    what = f"{human(r.bytes_raw)}"
    if share is not None:
        of = f"ranks {args.ranks} of {args.world_size}" if share.layout else "the items listed"
        what = f"the share of {of}: {human(share.nbytes)} of storage items, {what} of files"
    line = (
        f"pulled {r.job} step {r.step} ({len(r.nodes)} part(s)) into {r.dest}: {r.files} files, "
        f"{what}, read {human(r.bytes_transferred)}"
        + (
            f" (with {r.base_dir}: {r.chunks_local} chunks reused, {r.bases_local} decoded"
            " against its bytes)"
            if r.base_dir
            else ""
        )
        + (
            f", {r.chunks_resumed} chunks found written by an interrupted pull"
            if r.chunks_resumed
            else ""
        )
        + f" in {r.seconds:.2f}s ({format_rate(r.bytes_raw, r.seconds)} of checkpoint), "
        "every chunk verified"
    )
    return r.to_dict(), line


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _share_of(
    store: Store,
    args: argparse.Namespace,
    step: int | None,
    expected: tuple[str, ...],
    use_index: bool,
) -> tuple[Any, Any]:
    """(manifests, share) of a share pull (--world-size/--ranks or --items), else (None, None);
    ``expected``: the job's nodes (--expected-nodes), whose parts make a step whole;
    ``use_index``: the step's common index may stand in for the parts it covers."""
    if args.world_size is None and args.ranks is None and args.items is None:
        return None, None
    if args.items is not None and (args.world_size is not None or args.ranks is not None):
        raise UsageError("--items names the share itself: leave out --world-size and --ranks")
    if args.items is None and (args.world_size is None or args.ranks is None):
        raise UsageError("a share needs both --world-size W and --ranks A,B (or --items FILE)")
    if args.node is not None:
        raise UsageError("a share is read from every node's part: leave out --node")
    import json

    from transfer.engine.dcpshare import Layout, parse_ranks
    from transfer.engine.share import resolve_shares
    from transfer.errors import FerryError

    items = layout = None
    if args.items is not None:
        try:
            items = json.loads(args.items.read_bytes())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--items {args.items}: {exc}") from None
    else:
        try:  # (a usage error, as the other flags' are: it exited 1, without "see --help")
            layout = Layout(args.world_size, parse_ranks(args.ranks))
        except FerryError as exc:
            raise UsageError(
                f"--world-size {args.world_size} --ranks {args.ranks}: {exc}"
            ) from None
    manifests, shares = await resolve_shares(
        store, args.job, step, expected, {None: (layout, items)}, None, use_index
    )
    return manifests, shares[None]
