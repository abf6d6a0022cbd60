"""Fleet scale, peers: a node joining an N-node job prefetches a step from the peers alone;
how many peer requests that takes per chunk, as N grows.

    python -m bench.peer_routing                       # N = 8, 32, 64
    python -m bench.peer_routing --nodes 4,16 --chunks 8 --json /tmp/pr.json

Every node of the job holds its own part of the step (one rank file of ``--chunks`` chunks of
random bytes, node 0 also ``.metadata``), pushed to a real S3 server (SeaweedFS on loopback)
with the step's completion marker. N agents run in this process on loopback, agent i being
node ``n<i>`` with its part in its hot dir (``commit_marker = ""``: a part without
``.metadata`` counts as one). A new node's agent, with every one of them as its peers
(``peers``, in node order), prefetches the whole step. Its asks of the peers are counted
(every call of ``PeerSource.ask``, served or not) and the bytes it read from S3 (none, when
the peers served it all). A chunk asked of every peer in turn costs k requests when it is the
k-th peer's: N/2 a chunk on average; asked of its owner first (the step's manifests say whose
part holds it, each peer's ``/healthz`` which node it is), one
(tests/test_peer_routing_bench.py holds it to that at 3 nodes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.node.hotdir import HotDir
from agent.peers.chunks import PeerSource
from bench._env import machine_info, source_info
from bench._loopback import agent, run_main
from bench.fleet import mark_step_complete, node_list
from tests.fake_dcp import dcp_metadata
from tests.s3server import S3Endpoint
from transfer.engine import PushPlan, push
from transfer.options import TransferOptions
from transfer.store import StoreOptions, open_store

JOB = "fleet"
STEP = 100
CHUNK = 64 << 10
REPO = Path(__file__).resolve().parent.parent


def write_parts(root: Path, nodes: int, chunks: int) -> list[Path]:
    """Node i's part: ``__<i>_0.distcp`` of ``chunks`` chunks of random bytes (no two alike:
    every chunk has one holder), node 0's also ``.metadata``."""
    sizes = {f"__{i}_0.distcp": chunks * CHUNK for i in range(nodes)}
    parts = []
    for i in range(nodes):
        d = root / f"n{i}"
        d.mkdir(parents=True)
        (d / f"__{i}_0.distcp").write_bytes(random.Random(i).randbytes(chunks * CHUNK))
        if i == 0:
            (d / ".metadata").write_bytes(dcp_metadata(sizes))
        parts.append(d)
    return parts


async def push_parts(tier: str, endpoint: str, parts: list[Path]) -> None:
    options = TransferOptions(chunk_size=CHUNK, workers=1)
    store = open_store(tier, StoreOptions(endpoint_url=endpoint))
    try:
        for i, part in enumerate(parts):
            plan = PushPlan(part=True)
            await push(store, part, job=JOB, step=STEP, node=f"n{i}", options=options, plan=plan)
        await mark_step_complete(store, JOB, STEP)
    finally:
        await store.close()


async def one_fleet(nodes: int, chunks: int, ep: S3Endpoint, work: Path) -> dict[str, Any]:
    """N holders and a new node prefetching from them: its peer asks, S3 bytes, seconds."""
    tier = f"s3://{ep.bucket}/peer-routing-{os.getpid()}-{nodes}"
    parts = write_parts(work / f"parts-{nodes}", nodes, chunks)
    await push_parts(tier, ep.url, parts)
    asks: list[bool] = []  # served or not, one per request the new node made
    ask = PeerSource.ask

    async def counted(self: PeerSource, *args: Any, **kw: Any) -> Any:
        got = await ask(self, *args, **kw)
        asks.append(got is not None)
        return got

    held = {"FERRY_COMMIT_MARKER": "", "FERRY_QUIET_SECONDS": "3600"}
    PeerSource.ask = counted  # type: ignore[method-assign]
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls = []
            for i, part in enumerate(parts):
                hot = work / f"hot-{nodes}" / f"n{i}"
                shutil.copytree(part, HotDir(hot, "").step_path(JOB, STEP))
                client = await stack.enter_async_context(agent(f"n{i}", hot, tier, **held))
                urls.append(client.base_url)
            new = await stack.enter_async_context(
                agent("new", work / f"hot-{nodes}" / "new", tier, FERRY_PEERS=",".join(urls))
            )
            began = time.monotonic()
            status = await new.wait_prefetch(await new.prefetch(JOB, STEP), within_s=600)
            seconds = time.monotonic() - began
    finally:
        PeerSource.ask = ask  # type: ignore[method-assign]
    by = status["bytes_by_source"]
    total_chunks = nodes * chunks + 1  # (.metadata: one more)
    return {
        "nodes": nodes,
        "chunks": total_chunks,
        "state": status["state"],
        "peer_requests": len(asks),
        "served": sum(asks),
        "requests_per_chunk": round(len(asks) / total_chunks, 2),
        "from_peers": by.get("peer", 0),
        "from_s3": sum(v for k, v in by.items() if k.startswith("tier:")),
        "seconds": round(seconds, 2),
    }


def run(args: argparse.Namespace, ep: S3Endpoint) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ferry-peer-routing-"))
    try:
        rows = []
        for n in args.nodes:
            rows.append(asyncio.run(one_fleet(n, args.chunks, ep, work)))
            print(f"{n} nodes: {rows[-1]['peer_requests']} peer requests", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"config": {"nodes": args.nodes, "chunks": args.chunks}, "rows": rows}
    if args.json:
        extra = {"machine": machine_info(), "source": source_info(REPO)}
        Path(args.json).write_text(json.dumps(doc | extra, indent=1) + "\n")
    return doc


def report(doc: dict[str, Any]) -> str:
    lines = [
        "| nodes | chunks | ready | peer requests | served | requests / chunk "
        "| from peers MB | from S3 MB | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['nodes']} | {r['chunks']} | {r['state']} | {r['peer_requests']:,} "
            f"| {r['served']:,} | {r['requests_per_chunk']:.2f} | {r['from_peers'] / 1e6:.2f} "
            f"| {r['from_s3'] / 1e6:.2f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nodes", type=node_list, default=[8, 32, 64], help="e.g. 8,32,64")
    ap.add_argument("--chunks", type=int, default=4, help="64 KiB chunks per node's part")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    args = ap.parse_args(argv)
    if args.chunks < 1:
        ap.error("--chunks must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_main("bench.peer_routing", argv, parse_args, run, report)


if __name__ == "__main__":
    main()
