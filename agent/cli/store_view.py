"""``ferry ls``, ``ferry du`` and ``ferry verify``: what a store holds, what its bytes are for,
and whether every stored chunk still hashes to its name. They read; they never write."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from agent.cli.args import (
    STORE_URL_HELP,
    UsageError,
    add_store_args,
    add_transfer_args,
    transfer_options,
)
from agent.cli.shared import VerifyFailed, human, require_store, step_named
from transfer.errors import FormatError
from transfer.format.names import check_name

if TYPE_CHECKING:
    from agent.cli.args import Commands
    from transfer.store.base import Store


def add_listings(sub: Commands) -> None:
    p = sub.add_parser(
        "ls",
        help="list committed checkpoints",
        description="List committed checkpoints. CODED says how a step is stored: "
        "'keyframe' (every chunk on its own), or 'N/M delta, depth D': N of its M chunks "
        "are XOR deltas against an earlier step, and a pull onto a node holding none of "
        "them decodes a chain of up to D (it fetches the bases too).",
    )
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("--job", help="only this job's steps (default: every job)")
    add_store_args(p, writes=False)

    p = sub.add_parser(
        "du", help="what a store's bytes are for: per step own/shared, dead, what expiring frees"
    )
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("--job", help="only this job's steps (totals stay store-wide)")
    add_store_args(p, writes=False)


def add_verify(sub: Commands) -> None:
    p = sub.add_parser("verify", help="re-hash every stored chunk; exit 1 naming bad ones")
    p.add_argument("store_url", help=STORE_URL_HELP)
    p.add_argument("--job", help="only this job's steps (default: every job)")
    p.add_argument("--step", help="only this step of --job: a step number, or 'latest'")
    add_store_args(p, writes=False)
    add_transfer_args(p, writes=False)


async def cmd_ls(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine.catalog import list_checkpoints, load_manifest, nothing_matches
    from transfer.format.manifest import chain_depths

    if args.job:
        check_name("job", args.job)
    rows: list[dict[str, Any]] = []
    await require_store(store)
    found = await list_checkpoints(store, args.job)
    if args.job and not found:
        raise await nothing_matches(store, args.job, None)
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
        f"{'JOB':<24} {'STEP':>10} {'NODE':<16} {'FILES':>6} {'SIZE':>12}  {'CODED':<24} CREATED"
    ]
    table += [
        f"{r['job']:<24} {r['step']:>10} {r['node']:<16} "
        + (
            f"UNREADABLE: {r['error']}"
            if "error" in r
            else f"{r['files']:>6} {human(r['bytes_raw']):>12}  {_coded(r):<24} {r['created_at']}"
        )
        for r in rows
    ]
    return {"store": store.url, "checkpoints": rows}, "\n".join(table)


def _coded(row: dict[str, Any]) -> str:
    if not row["delta_chunks"]:
        return "keyframe"
    # (counted, not a percentage: "delta 23%" read as a saving of bytes)
    return f"{row['delta_chunks']}/{row['chunks']} delta, depth {row['chain_depth']}"


async def cmd_du(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import time

    from transfer.engine.catalog import list_checkpoints, nothing_matches
    from transfer.retention import take_inventory
    from transfer.retention.policy import format_size as size
    from transfer.retention.usage import store_usage

    if args.job:
        check_name("job", args.job)
    await require_store(store)
    if args.job and not await list_checkpoints(store, args.job):
        raise await nothing_matches(store, args.job, None)
    now = time.time()
    u = store_usage(await take_inventory(store, now=now), now=now, job=args.job)
    lines = [
        f"{u.url}: {size(u.total_bytes)} stored: {size(u.live_bytes)} live, "
        f"{size(u.dead_bytes)} dead inside kept packs, {size(u.unreferenced_bytes)} in "
        f"{u.unreferenced_packs} unreferenced packs, {size(u.manifest_bytes)} of manifests"
        + (
            f"; and {size(u.unfinished_upload_bytes)} in {u.unfinished_uploads} unfinished "
            "pack uploads (a running push's, or a stopped one's: its rerun completes an S3 "
            "upload with the parts that landed and removes a directory's temp file; retention "
            "aborts those no push finishes)"
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
    # (store-wide, also under --job: a policy applies to every job, and packs are shared)
    scope = " in every job: the store" if args.job else ":"
    lines += [
        f"retention {e.policy}{scope} {size(e.bytes_after)} left, frees {size(e.frees_bytes)}"
        for e in u.policies
    ]
    return u.to_dict(), "\n".join(lines)


async def cmd_verify(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.engine import verify

    if args.job:
        check_name("job", args.job)
    step = None
    if args.step is not None:
        if not args.job:
            raise UsageError("--step needs --job")
        if args.step == "latest":
            await require_store(store)
        step = await step_named(store, args.job, args.step)
    r = await verify(store, job=args.job, step=step, options=transfer_options(args))
    lines = [f"BAD manifest {why}" for why in r.bad_manifests]
    lines += [f"BAD chunk {b.chunk}: {b.reason}; needed by {', '.join(b.used_by)}" for b in r.bad]
    lines += [f"BAD index {why}" for why in r.bad_indexes]
    verdict = f"{len(r.bad)} BAD chunk(s)"
    if r.bad_manifests:
        verdict = f"{len(r.bad_manifests)} unreadable manifest(s), " + verdict
    if r.bad_indexes:
        verdict += (f", {len(r.bad_indexes)} BAD common index(es) (a share read through one "
                    'gets other items: remove the "common" key from that marker)')  # fmt: skip
    bases = f" ({r.base_chunks} of them earlier steps' bases)" if r.base_chunks else ""
    lines.append(
        f"verified {r.checkpoints} checkpoint part(s), {r.chunks} chunks{bases}, "
        f"{human(r.bytes_read)} read in {r.seconds:.2f}s: " + ("all good" if r.ok else verdict)
    )
    if not r.ok:
        raise VerifyFailed(r.to_dict(), "\n".join(lines))
    return r.to_dict(), "\n".join(lines)
