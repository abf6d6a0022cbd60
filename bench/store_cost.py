"""What a store costs over a real fine-tune series, and what retention gives back (issue 14).

    python -m bench.store_cost SERIES_DIR [SERIES_DIR ...] [--stores local,s3]

SERIES_DIR holds step_*/ saves from ``bench.gen_checkpoints --mode torch`` (or a variant
of ``bench.corpus``). For each series and store, the saves are pushed one after another,
each as deltas of the one before (base bytes from the sibling directory, as on a training
node). Then, each on a fresh copy of that store, ``--grace 0``:

- keep-last 1 without repacking (whole-pack GC only, the old behaviour) and with it,
  against a fresh ``--full`` push of the kept step;
- keep-last 2 with repacking, against a fresh ``--full`` push of the older kept step plus
  the delta push of the newer;
- keep-last 1 with the second save pinned: what the pinned step adds, against its own
  fresh push.

Targets (issue 14): <= 1.1x on every row; bytes per save over the series (mean after the
first, keyframes included) <= 40% of raw on a full fine-tune, <= 25% frozen. Every figure
is pack bytes listed in the store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from transfer.engine import PushPlan, push
from transfer.format import layout
from transfer.format.names import step_from_dirname
from transfer.retention import Tier, TierPolicy, apply_plan, make_plan, pin
from transfer.retention.repack import RepackPolicy
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store

JOB, NODE = "bench", "n0"


def saves(series: Path) -> list[Path]:
    found = sorted(
        (step_from_dirname(d.name), d)
        for d in series.iterdir()
        if d.is_dir() and step_from_dirname(d.name) is not None
    )
    return [d for _, d in found]


async def pack_bytes(store: Store) -> int:
    return sum(o.size for o in await store.list(layout.PACKS_PREFIX))


class Stores:
    """Fresh, empty stores of one kind, one per call."""

    def __init__(self, kind: str, work: Path, endpoint: dict[str, str] | None) -> None:
        self.kind, self.work, self.endpoint, self.n = kind, work, endpoint, 0

    def new(self) -> Store:
        self.n += 1
        if self.kind == "local":
            root = self.work / f"store-{self.n}"
            root.mkdir()
            return open_store(str(root), StoreOptions())
        assert self.endpoint is not None
        url = f"s3://{self.endpoint['bucket']}/store-cost-{time.time_ns()}-{self.n}"
        return open_store(url, StoreOptions(endpoint_url=self.endpoint["url"]))


async def push_series(store: Store, dirs: list[Path], *, first_full: bool = True) -> list[int]:
    """Push ``dirs`` in order; the pack bytes each push added."""
    added = []
    for i, d in enumerate(dirs):
        before = await pack_bytes(store)
        step = step_from_dirname(d.name)
        assert step is not None
        plan = PushPlan(full=first_full and i == 0)
        await push(store, d, job=JOB, step=step, node=NODE, plan=plan)
        added.append(await pack_bytes(store) - before)
    return added


async def retain(store: Store, keep_last: int, repacking: RepackPolicy | None) -> tuple[int, float]:
    tiers = [Tier(store, TierPolicy(keep_last=keep_last))]
    began = time.monotonic()
    plan = await make_plan(tiers, now=time.time(), repacking=repacking)
    await apply_plan(plan, tiers, grace_s=0.0, holder="bench")
    errors = [e for t in plan.tiers for e in t.errors]
    if errors:
        raise SystemExit(f"retention failed: {errors}")
    return await pack_bytes(store), time.monotonic() - began


async def scenario(
    stores: Stores, dirs: list[Path], act: Callable[[Store], Awaitable[tuple[int, float]]]
) -> tuple[int, float]:
    store = stores.new()
    try:
        await push_series(store, dirs)
        return await act(store)
    finally:
        await store.close()


async def fresh(stores: Stores, dirs: list[Path]) -> int:
    """Pack bytes of pushing ``dirs`` to an empty store, the first as a keyframe."""
    store = stores.new()
    try:
        return sum(await push_series(store, dirs))
    finally:
        await store.close()


async def measure(series: Path, stores: Stores) -> dict[str, Any]:
    dirs = saves(series)
    if len(dirs) < 3:
        raise SystemExit(f"{series}: needs at least 3 saves, found {len(dirs)}")
    raw = sum(f.stat().st_size for f in dirs[-1].rglob("*") if f.is_file())
    store = stores.new()
    began = time.monotonic()
    try:
        added = await push_series(store, dirs)
    finally:
        await store.close()
    push_seconds = time.monotonic() - began
    repack = RepackPolicy()
    keep1_old, _ = await scenario(stores, dirs, lambda s: retain(s, 1, None))
    keep1, keep1_s = await scenario(stores, dirs, lambda s: retain(s, 1, repack))
    keep2, keep2_s = await scenario(stores, dirs, lambda s: retain(s, 2, repack))
    pinned_step = step_from_dirname(dirs[1].name)
    assert pinned_step is not None

    async def pinned(s: Store) -> tuple[int, float]:
        await pin(s, JOB, pinned_step, "bench", 3600.0)
        return await retain(s, 1, repack)

    keep1_pin, _ = await scenario(stores, dirs, pinned)
    fresh_last = await fresh(stores, dirs[-1:])
    fresh_pair = await fresh(stores, dirs[-2:])
    fresh_pinned = await fresh(stores, dirs[1:2])
    return {
        "series": str(series),
        "store": stores.kind,
        "saves": len(dirs),
        "raw_bytes_per_save": raw,
        "added_per_save": added,
        "mean_after_first_ratio": sum(added[1:]) / (len(added) - 1) / raw,
        "push_mb_per_s": len(dirs) * raw / push_seconds / 1e6,
        "keep1_no_repack_ratio": keep1_old / fresh_last,
        "keep1_ratio": keep1 / fresh_last,
        "keep1_seconds": keep1_s,
        "keep2_ratio": keep2 / fresh_pair,
        "keep2_seconds": keep2_s,
        "pinned_extra_ratio": (keep1_pin - keep1) / fresh_pinned,
        "bytes": {
            "keep1_no_repack": keep1_old,
            "keep1": keep1,
            "keep2": keep2,
            "keep1_pinned": keep1_pin,
            "fresh_last": fresh_last,
            "fresh_pair": fresh_pair,
            "fresh_pinned": fresh_pinned,
        },
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| series | store | saves | stored per save (after the first) | keep-last 1, no repack"
        " | keep-last 1 | keep-last 2 | pinned step adds | repack (keep-last 1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {Path(r['series']).name} | {r['store']} | {r['saves']} | "
            f"{100 * r['mean_after_first_ratio']:.1f}% of raw | "
            f"{r['keep1_no_repack_ratio']:.2f}x | {r['keep1_ratio']:.2f}x | "
            f"{r['keep2_ratio']:.2f}x | {r['pinned_extra_ratio']:.2f}x | "
            f"{r['keep1_seconds']:.1f} s |"
        )
    out.append(
        "\n(x: pack bytes left / a fresh push of what is kept: the oldest kept step as a "
        "keyframe, the next as its delta; target <= 1.10x)"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("series", nargs="+", type=Path)
    ap.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    kinds = [k for k in args.stores.split(",") if k]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-store-cost-") as tmp:
        work = Path(tmp)
        server = None
        endpoint = None
        if "s3" in kinds:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.s3server import start_s3_server

            server = start_s3_server(work / "s3server")
            ep = server.endpoint
            endpoint = {"url": ep.url, "bucket": ep.bucket}
            import os

            os.environ.update(AWS_ACCESS_KEY_ID=ep.access_key, AWS_SECRET_ACCESS_KEY=ep.secret_key)
        try:
            for series in args.series:
                for kind in kinds:
                    stores = Stores(kind, work / f"{series.name}-{kind}", endpoint)
                    stores.work.mkdir()
                    rows.append(asyncio.run(measure(series, stores)))
                    print(json.dumps(rows[-1]), file=sys.stderr)
                    shutil.rmtree(stores.work, ignore_errors=True)
        finally:
            if server is not None:
                server.stop()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
