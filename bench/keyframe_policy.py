"""What the writer's keyframe policy costs and saves, per save of a real training series.

    python -m bench.keyframe_policy SERIES_DIR [SERIES_DIR ...] [--policy MIN_SAVING:MAX_COLD ...]

Each series (step_*/ saves: a variant of ``bench.corpus`` or ``bench.gen_checkpoints --mode
torch``) is pushed save after save into a fresh local store under each policy, each save as
deltas of the one before, as the agent does. Then, from the manifests (exact stored bytes,
no timing), per save:

- stored: what the push added to the store;
- warm: what a restore moves onto a node holding the save before (what the node cannot
  rebuild from its copy: new chunks, or the delta of a chunk whose base it holds);
- cold: what a restore moves onto an empty node (every chunk and every base it needs).

A policy is ``delta_min_saving:max_cold_cost`` (``0:inf`` is the writer before the policy:
any saving, chains bounded by ``max_chain`` only). Prints a markdown table per series and
writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.store_cost import saves
from transfer.engine import PushPlan, TransferOptions, push
from transfer.engine.catalog import load_manifest
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.format.manifest import Manifest
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB, NODE = "bench", "n0"
DEFAULT_POLICIES = ("0:inf", "0.25:inf", "0.25:2", "0.25:1.5")


def _chunks(manifest: Manifest) -> dict[str, StoredChunk]:
    return {
        c.id: StoredChunk(c.id, c.size, c.enc, manifest.packs[c.pack], c.offset, c.stored, c.base)
        for f in manifest.files
        for c in f.chunks
    }


def restore_bytes(index: ChunkIndex, wanted: dict[str, StoredChunk], held: set[str]) -> int:
    """Stored bytes a restore of ``wanted`` fetches when the node holds the raw chunks
    ``held``: a held chunk costs nothing, a delta whose base is held costs its payload, any
    other chunk its payload and its bases' (each base once)."""
    fetched: set[str] = set()
    total = 0
    for chunk in wanted.values():
        cur: StoredChunk | None = chunk
        while cur is not None and cur.id not in held and cur.id not in fetched:
            fetched.add(cur.id)
            total += cur.stored
            cur = index.get(cur.base) if cur.base else None
    return total


async def measure(series: Path, policy: str, work: Path) -> list[dict[str, Any]]:
    min_saving, max_cold = (float(x) for x in policy.split(":"))
    options = TransferOptions(delta_min_saving=min_saving, max_cold_cost=max_cold)
    root = work / f"store-{policy.replace(':', '_')}"
    root.mkdir()
    store = open_store(str(root), StoreOptions())
    rows: list[dict[str, Any]] = []
    index = ChunkIndex()
    held: set[str] = set()
    try:
        for i, save in enumerate(saves(series)):
            step = step_from_dirname(save.name)
            assert step is not None
            result = await push(
                store, save, job=JOB, step=step, node=NODE, options=options,
                plan=PushPlan(full=i == 0),
            )  # fmt: skip
            manifest = await load_manifest(store, JOB, step, NODE)
            index.add_manifest(manifest)
            wanted = _chunks(manifest)
            raw = sum(c.size for f in manifest.files for c in f.chunks)
            rows.append(
                {
                    "step": step,
                    "raw": raw,
                    "stored": result.bytes_transferred,
                    "warm": restore_bytes(index, wanted, held) if i else None,
                    "cold": restore_bytes(index, wanted, set()),
                    "delta_chunks": result.chunks_delta,
                    "max_depth": max(index.depth(c) for c in wanted),
                }
            )
            held = set(wanted)
    finally:
        await store.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _share(n: int | None, raw: int) -> str:
    return "" if n is None else f"{n / raw:.3f}"


def table(series: Path, results: dict[str, list[dict[str, Any]]]) -> str:
    out = [
        f"### {series}",
        "",
        "| policy (min saving : max cold) | step | delta chunks | depth | stored / raw "
        "| warm / raw | cold / raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, rows in results.items():
        for r in rows:
            out.append(
                f"| {policy} | {r['step']} | {r['delta_chunks']} | {r['max_depth']} "
                f"| {_share(r['stored'], r['raw'])} | {_share(r['warm'], r['raw'])} "
                f"| {_share(r['cold'], r['raw'])} |"
            )
        later = rows[1:]
        if later:
            raw = sum(r["raw"] for r in later)
            mean = {k: sum(r[k] for r in later) / raw for k in ("stored", "warm", "cold")}
            out.append(
                f"| {policy} | **mean after the first** | | | {mean['stored']:.3f} "
                f"| {mean['warm']:.3f} | {mean['cold']:.3f} |"
            )
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ferry-keyframes-"))
    report: dict[str, Any] = {}
    try:
        for series in args.series:
            results = {p: await measure(series, p, work) for p in args.policy}
            report[str(series)] = results
            print(table(series, results), "\n", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("series", type=Path, nargs="+")
    parser.add_argument("--policy", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    for p in args.policy:
        parts = p.split(":")
        if len(parts) != 2 or any(math.isnan(float(x)) for x in parts):
            parser.error(f"--policy {p}: expected MIN_SAVING:MAX_COLD, e.g. 0.25:2")
    report = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
