"""What a FerryReader load's coordinator pays to plan every rank's chunks (issue 32).

In a process group one rank reads the step's manifests and plans each rank's share
(transfer/engine/memrestore.py ``StepChunks`` + ``plan_ranges``); DCP's scatter carries
each plan to its rank. This times both on synthetic manifests of N nodes x 8 rank files of
4 MiB chunks, for a scale-down to half the ranks (each new rank reads two old rank files
whole), and prints the pickled size of one rank's plan: the bytes DCP scatters per rank.
No store and no torch: it measures the planning alone.

    python -m bench.plan_scale            # 64 and 256 nodes x 2,000 chunks each
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Sequence

from transfer.engine.memrestore import StepChunks, plan_ranges
from transfer.format.chunkid import chunk_id
from transfer.format.manifest import ChunkRef, FileEntry, Manifest

CHUNK = 4 << 20
RANKS_PER_NODE = 8


def node_manifest(node: int, chunks: int) -> Manifest:
    per = chunks // RANKS_PER_NODE
    files = []
    for r in range(RANKS_PER_NODE):
        refs = tuple(
            ChunkRef(chunk_id(f"{node}:{r}:{i}".encode()), CHUNK, "zstd", 0, i * 1000, 900)
            for i in range(per)
        )
        files.append(FileEntry(f"__{node * RANKS_PER_NODE + r}_0.distcp", per * CHUNK, 0o644, refs))
    return Manifest("j", 7, f"n{node:04d}", "2026-12-06T00:00:00+00:00", CHUNK, ("0" * 32,),
                    tuple(files))  # fmt: skip


def measure(nodes: int, chunks: int) -> str:
    manifests = [node_manifest(n, chunks) for n in range(nodes)]
    began = time.perf_counter()
    step = StepChunks(manifests)
    built = time.perf_counter() - began
    world = nodes * RANKS_PER_NODE // 2
    began = time.perf_counter()
    sizes = []
    for rank in range(world):
        paths = [f"__{2 * rank + k}_0.distcp" for k in (0, 1)]
        plan = plan_ranges(step, {p: [(0, step.files[p].size)] for p in paths})
        sizes.append(len(pickle.dumps(plan)))
    planned = time.perf_counter() - began
    per_rank_chunks = 2 * (chunks // RANKS_PER_NODE)
    return (
        f"{nodes} nodes x {chunks} chunks ({nodes * chunks * CHUNK / 2**40:.1f} TiB), "
        f"{world} new ranks: manifests indexed in {built:.2f} s, every rank planned in "
        f"{planned:.2f} s, one rank's plan {max(sizes) / 1024:.0f} KiB "
        f"({max(sizes) / per_rank_chunks:.0f} B per chunk)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,256", help="node counts (default 64,256)")
    ap.add_argument("--chunks", type=int, default=2000, help="chunks per node (default 2000)")
    args = ap.parse_args(argv)
    for n in (int(x) for x in args.nodes.split(",")):
        print(measure(n, args.chunks), flush=True)


if __name__ == "__main__":
    main()
