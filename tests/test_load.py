"""Load on one ``ferry agent`` process (loopback, a local-directory tier): many concurrent
prefetch requests while training saves new checkpoints that the agent pushes. The agent's
memory (RSS of the process, sampled) stays within its configured budget, /healthz keeps
answering (p50/p99 latency printed), and nothing is lost: every prefetch ends ready and
byte-exact, every push becomes durable and verifies.

CI sends FERRY_LOAD_PREFETCHES (default 40) prefetch requests; the figures in
docs/RELIABILITY.md come from ``python -m pytest -s tests/test_load.py``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from agent.rpc.client import FerryClient
from tests.harness import TOKEN, Node, assert_same_tree, make_node, running, save
from transfer.engine import TransferOptions, push, verify
from transfer.store import StoreOptions, open_store

MiB = 1 << 20
PREFETCHES = int(os.environ.get("FERRY_LOAD_PREFETCHES", "40"))
PUBLISHED = 4  # checkpoints in the tier that the prefetches ask for
SAVES = 3  # checkpoints training writes into the hot dir meanwhile (the agent pushes them)
SHARD = 40 * MiB
BUDGET_MIB = 48  # [transfer] memory_mib: the cap on each transfer's buffers
TRANSFERS = 3  # at most 2 prefetches (prefetch_concurrency) + 1 push at a time
#: and one transfer's budget of buffers a finished restore leaves for the next
#: (transfer/directio.py POOL: the next prefetch faults in no fresh pages)
KEPT_FOR_THE_NEXT = 1
SLACK_MIB = 16  # allocator, thread stacks (the peak is ~115 MiB on main as of 2026-11)
OPTS = TransferOptions(chunk_size=MiB, part_size=4 * MiB, pack_size=16 * MiB)


def checkpoint(root: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    return save(root, {f"__{r}_0.distcp": rng.bytes(SHARD) for r in range(2)})


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


class Sampler(threading.Thread):
    """Polls /healthz (latency) and the agent's RSS until stopped."""

    def __init__(self, node: Node) -> None:
        super().__init__(daemon=True)
        self.node, self.latencies, self.rss = node, [], []  # type: ignore[var-annotated]
        self.stop = threading.Event()

    def run(self) -> None:
        assert self.node.proc is not None
        while not self.stop.is_set():
            began = time.perf_counter()
            with urllib.request.urlopen(self.node.url + "/healthz", timeout=30) as resp:
                assert resp.status == 200
            self.latencies.append(time.perf_counter() - began)
            self.rss.append(rss_mib(self.node.proc.pid))
            self.stop.wait(0.02)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@pytest.mark.slow  # ~8 s: a load test (latency quantiles under many clients)
def test_many_prefetches_and_pushes_at_once(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    sources = [
        checkpoint(tmp_path / "src" / f"step_{10 * (i + 1):06d}", i) for i in range(PUBLISHED)
    ]

    async def publish() -> None:
        store = open_store(str(tier), StoreOptions())
        for i, src in enumerate(sources):
            await push(store, src, job="llm", step=10 * (i + 1), node="a", options=OPTS)
        await store.close()

    asyncio.run(publish())
    node = make_node(
        tmp_path, "b", [str(tier)],
        FERRY_TRANSFER_MEMORY_MIB=str(BUDGET_MIB), FERRY_TRANSFER_PART_SIZE_MIB="4",
        FERRY_TRANSFER_PACK_SIZE_MIB="16",
    )  # fmt: skip
    with running(node):
        assert node.proc is not None
        idle = rss_mib(node.proc.pid)
        sampler = Sampler(node)
        sampler.start()

        async def load() -> list[dict]:  # type: ignore[type-arg]
            async with FerryClient(node.url, TOKEN) as client:
                steps = [10 * (i % PUBLISHED + 1) for i in range(PREFETCHES)]
                ids = await asyncio.gather(*(client.prefetch("llm", s) for s in steps))
                for k in range(SAVES):  # training saves while the prefetches run
                    checkpoint(node.hot / "train" / f"step_{k + 1:06d}", 100 + k)
                return list(
                    await asyncio.gather(*(client.wait_prefetch(i, within_s=300) for i in ids))
                )

        began = time.monotonic()
        results = asyncio.run(load())
        for k in range(SAVES):
            node.wait_durable("train", k + 1, within=300)
        took = time.monotonic() - began
        sampler.stop.set()
        sampler.join(30)
        peak = rss_mib(node.proc.pid, "VmHWM")

    bad = [f"{r['step']} {r['state']}: {r['error']!r}" for r in results if r["state"] != "ready"]
    assert not bad, "; ".join(bad)
    for i, src in enumerate(sources):
        assert_same_tree(node.hot / "llm" / f"step_{10 * (i + 1):06d}", src)

    async def check_pushes() -> None:
        store = open_store(str(tier), StoreOptions())
        result = await verify(store, job="train")
        await store.close()
        assert result.ok and result.checkpoints == SAVES, result

    asyncio.run(check_pushes())
    allowed = idle + (TRANSFERS + KEPT_FOR_THE_NEXT) * BUDGET_MIB + SLACK_MIB
    p50, p99 = percentile(sampler.latencies, 50), percentile(sampler.latencies, 99)
    print(
        f"\nload: {PREFETCHES} prefetch requests ({PUBLISHED} checkpoints, "
        f"{PUBLISHED * 2 * SHARD / MiB:.0f} MiB) + {SAVES} pushes ({SAVES * 2 * SHARD / MiB:.0f}"
        f" MiB) in {took:.1f}s; RSS idle {idle:.0f} MiB, peak {peak:.0f} MiB (allowed "
        f"{allowed:.0f}: budget {BUDGET_MIB} MiB x {TRANSFERS} transfers + "
        f"{KEPT_FOR_THE_NEXT} kept + {SLACK_MIB}); "
        f"/healthz p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms over "
        f"{len(sampler.latencies)} probes"
    )
    assert peak <= allowed
    assert len(sampler.latencies) >= 20  # the probe really ran during the load
    assert p99 < 5.0  # generous: the event loop never stalls for seconds
