"""What TLS costs on the peer path: the same prefetch served by a peer over plain HTTP, over
TLS, and over mutual TLS, side by side in one run.

    python -m bench.tls_cost [SERIES_DIR] [--rounds 3]

SERIES_DIR holds step_*/ saves (default /work/series/full: ``python -m bench.gen_checkpoints
/work/series/full --mode torch --variant full --saves 3 --size-mb 272``); its two oldest are
k and k+1. Starts SeaweedFS, pushes both (k+1 as deltas of k), makes a CA and a certificate
for 127.0.0.1 per agent with the openssl CLI (tests/tlscerts.py), and runs two real
``ferry agent`` processes on loopback per mode: A, the node that trained (k and k+1 in its
hot dir), and C, A's peer, which prefetches k+1 either holding k (A sends deltas against
it) or empty (A sends chunks). Each round runs every mode once per case (the order of the
modes alternating), page cache dropped first.

CPU is each process's utime + stime over the prefetch (bench/agents.py), the serving peer's
and the receiving node's apart, per GB the peer sent; TLS's cost is the difference from
plain HTTP's. Both agents share this machine's cores, so the wall times say less than the
CPU figures; the S3 server's CPU is not counted (the same in every mode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench._env import reproduce_command
from bench._loopback import loopback_s3
from bench._measure import drop_caches, proc_cpu_seconds
from bench.agents import TOKEN, Agent, agent_env
from bench.data import link_tree
from tests.tlscerts import Authority, authority
from transfer.engine import push
from transfer.format.names import step_from_dirname
from transfer.store import StoreOptions, open_store

JOB = "bench"
MODES = ("http", "tls", "mtls")
CASES = ("holding k", "empty node")


@dataclass
class Run:
    mode: str
    case: str
    seconds: float
    server_cpu: float  # the peer that served (A)
    client_cpu: float  # the node that prefetched (C)
    peer_bytes: int  # sent by the peer


def mode_env(mode: str, ca: Authority, name: str, serial: int) -> dict[str, str]:
    if mode == "http":
        return {}
    leaf = ca.leaf(f"{name}-{mode}", serial)
    env = {
        "FERRY_TLS_CERT_FILE": str(leaf.cert),
        "FERRY_TLS_KEY_FILE": str(leaf.key),
        "FERRY_TLS_CA_FILE": str(ca.pem),
    }
    if mode == "mtls":
        env["FERRY_TLS_CLIENT_AUTH"] = "true"
    return env


def oldest_two(series: Path) -> tuple[Path, Path]:
    saves = sorted(
        (d for d in series.iterdir() if step_from_dirname(d.name) is not None),
        key=lambda d: step_from_dirname(d.name) or 0,
    )
    if len(saves) < 2:
        raise SystemExit(f"{series}: needs two step_*/ saves (see this module's docstring)")
    return saves[0], saves[1]


@dataclass
class Bench:
    work: Path
    tier: str
    endpoint: str
    k: Path
    k1: Path
    ca: Authority

    def agent(self, name: str, hot: Path, tls: dict[str, str], peers: list[str]) -> Agent:
        token = self.work / "token"
        env = agent_env(dict(os.environ), name, hot, self.tier, self.endpoint, token, peers)
        env.update(tls, FERRY_STANDBY_JOBS="", FERRY_RETENTION_INTERVAL_SECONDS="3600")
        return Agent(name, hot, env)

    def one_mode(self, mode: str, rnd: int) -> list[Run]:
        step = step_from_dirname(self.k1.name) or 0
        tls_a, tls_c = mode_env(mode, self.ca, "a", 10), mode_env(mode, self.ca, "c", 11)
        a = self.agent("a", self.work / f"a-{mode}-{rnd}", tls_a, [])
        link_tree(self.k, a.hot / JOB / self.k.name)
        link_tree(self.k1, a.hot / JOB / self.k1.name)
        runs = []
        a.start(self.work / f"a-{mode}.log")
        try:
            a.wait_pushes_settled(JOB, step)  # its watcher finds k and k+1 in the tier
            for case in CASES:
                c = self.agent("c", self.work / f"c-{mode}-{rnd}-{case[0]}", tls_c, [a.url])
                if case == "holding k":
                    link_tree(self.k, c.hot / JOB / self.k.name)
                c.start(self.work / f"c-{mode}.log")
                try:
                    if case == "holding k":
                        c.wait_pushes_settled(JOB, step_from_dirname(self.k.name) or 0)
                    drop_caches()
                    served_before = _cpu(a)
                    done = c.prefetch(JOB, step)
                    served = _cpu(a) - served_before
                finally:
                    c.stop()
                by_source = done["status"]["bytes_by_source"]
                peer = sum(int(n) for s, n in by_source.items() if s.startswith("peer"))
                if peer == 0:
                    raise SystemExit(f"{mode} {case}: nothing came from the peer: {by_source}")
                runs.append(Run(mode, case, done["seconds"], served, done["cpu"] or 0.0, peer))
                r = runs[-1]
                line = (
                    f"round {rnd + 1} {mode:>4} {case:<10}: {r.seconds:.2f} s, CPU served "
                    f"{r.server_cpu:.2f} s, received {r.client_cpu:.2f} s; {by_source}"
                )
                print(line, file=sys.stderr, flush=True)
        finally:
            a.stop()
        return runs


def _cpu(agent: Agent) -> float:
    assert agent.proc is not None
    return proc_cpu_seconds(agent.proc.pid) or 0.0


async def _push_both(tier: str, k: Path, k1: Path) -> None:
    store = open_store(tier, StoreOptions())
    try:
        await push(store, k, job=JOB, step=step_from_dirname(k.name) or 0, node="a")
        await push(store, k1, job=JOB, step=step_from_dirname(k1.name) or 0, node="a")
    finally:
        await store.close()


def run(series: Path, work: Path, bucket: str, endpoint: str, rounds: int) -> list[Run]:
    k, k1 = oldest_two(series)
    tier = f"s3://{bucket}/tls-cost"
    asyncio.run(_push_both(tier, k, k1))
    (work / "token").write_text(TOKEN + "\n")
    bench = Bench(work, tier, endpoint, k, k1, authority(work / "pki", "bench-ca"))
    runs: list[Run] = []
    for rnd in range(rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            runs += bench.one_mode(mode, rnd)
    return runs


def report(runs: list[Run], rounds: int) -> str:
    def med(rs: list[Run], f: str) -> float:
        return float(statistics.median(getattr(r, f) / (r.peer_bytes / 1e9) for r in rs))

    lines = [
        f"medians of {rounds} rounds; CPU-seconds per GB the peer sent (utime + stime of each "
        "agent process over the prefetch)",
        "",
        "| case | mode | prefetch | served, CPU-s/GB | received, CPU-s/GB | TLS extra, both "
        "ends, CPU-s/GB |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        plain = [r for r in runs if r.case == case and r.mode == "http"]
        base = med(plain, "server_cpu") + med(plain, "client_cpu")
        for mode in MODES:
            rs = [r for r in runs if r.case == case and r.mode == mode]
            both = med(rs, "server_cpu") + med(rs, "client_cpu")
            extra = "" if mode == "http" else f"{both - base:+.2f}"
            lines.append(
                f"| {case} ({statistics.median(r.peer_bytes for r in rs) / 1e6:,.0f} MB) "
                f"| {mode} | {statistics.median(r.seconds for r in rs):.2f} s "
                f"| {med(rs, 'server_cpu'):.2f} | {med(rs, 'client_cpu'):.2f} | {extra} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("series", nargs="?", type=Path, default=Path("/work/series/full"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(reproduce_command([sys.executable, "-m", "bench.tls_cost", *(argv or sys.argv[1:])]))
    with loopback_s3("ferry-tls-cost-") as (work, ep):
        runs = run(args.series, Path(tempfile.mkdtemp(dir=work)), ep.bucket, ep.url, args.rounds)
    print(report(runs, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
