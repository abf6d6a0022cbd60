"""ferry side by side with s5cmd, rclone and plain zstd, and next to the machine's limits.

Run from the repository root after ``pip install -e '.[bench]'`` (and, for the real DCP
series, ``pip install torch==2.13.0``)::

    python -m bench.corpus /work/corpus                         # once: ~30 min, 14 GB
    python -m bench.compare --corpus /work/corpus --scale-mb ''   # the decisive run
    python -m bench.compare            # synthetic: ~12-20 min on 2 cores (4 GB scaling)
    python -m bench.compare --quick    # tiny data, one round, < 60 s (CI runs this)

What it does (details in bench/README.md):

1. Data: with ``--corpus DIR`` (the real-training corpus, ``python -m bench.corpus DIR``),
   its full fine-tune pair (8 ranks, ~1.7 GB per save) for the main scenarios, and its
   frozen and bf16 pairs against s5cmd. Without it, a synthetic series
   (bench.gen_checkpoints --mode synthetic, 256 MiB per save) scaled up to ``--size-mb``,
   plus small real DCP series when torch is installed. The scaling plot uses the synthetic
   series at each of ``--scale-mb`` (``--scale-mb ''`` skips it).
2. Starts SeaweedFS on loopback (tests/s3server.py) and three agents (real processes).
3. Limits: disk (O_DIRECT dd), the server's raw PUT/GET of one object, memcpy, the codec.
4. ``--runs`` rounds; each alternates the tools' order and drops the page cache before
   every operation: cold full push of save k; incremental push of k+1 with k in the store
   (peers: their ``sync``); cold full pull of k+1; prefetch of k+1 onto an agent holding k
   (through the RPC; peers: the full download); peer-to-peer prefetch (an agent holding k
   fetches the changed chunks of k+1 from an agent holding k+1). Every restored tree is
   compared byte for byte with its source.
5. Scaling: cold push and pull by ferry and s5cmd at each size.
6. Writes bench/results/compare.{json,md} and compare_*.png.

Every tool runs as its own process; wall time, CPU seconds and peak RSS are of that process
(the agent's, for prefetches). Ratios are ours / peer's median time, from the same rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import data, limits, plots  # noqa: E402
from bench._env import describe_source, machine_info, source_info  # noqa: E402
from bench._measure import (  # noqa: E402
    check_same,
    drop_caches,
    proc_cpu_seconds,
    run_timed,
    system_busy_seconds,
    tree_digest,
)
from bench.agents import TOKEN, Agent, agent_env  # noqa: E402
from bench.peers import PEERS, Commands, tool_env  # noqa: E402
from tests.s3server import S3Server, start_s3_server  # noqa: E402

RESULTS = REPO / "bench" / "results"
BASE_STEP, NEXT_STEP = 20, 40  # the two saves of every series (step_000020, step_000040)
MB = 1e6

PUSH = "cold full push"
INCR = "incremental push (k in store)"
PULL = "cold full pull"
PULL_DELTA = "cold pull of delta-coded k+1"
PULL_BASE = "pull of k+1 holding k (CLI)"
PREFETCH = "prefetch onto node holding k"
P2P = "peer-to-peer prefetch"
SCENARIOS = (PUSH, INCR, PULL, PULL_DELTA, PULL_BASE, PREFETCH, P2P)
# the peer row each scenario is judged against (peers have no prefetch: a full download)
BASELINE = {
    PUSH: PUSH,
    INCR: INCR,
    PULL: PULL,
    PULL_DELTA: PULL,
    PULL_BASE: PULL,
    PREFETCH: PULL,
    P2P: PULL,
}


@dataclasses.dataclass
class Sample:
    data: str
    scenario: str
    tool: str
    round: int
    seconds: float
    cpu: float | None
    peak_rss_mb: float | None
    bytes_moved: int
    server_cpu: float | None = None
    other_cpu: float | None = None
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


class Run:
    def __init__(self, args: argparse.Namespace, server: S3Server, work: Path) -> None:
        self.args = args
        self.ep = server.endpoint
        proc = getattr(server, "_proc", None)
        self.server_pid = proc.pid if proc is not None else None
        self.work = work
        self.cmd = Commands(self.ep)
        rclone_conf = work / "rclone.conf"
        rclone_conf.touch()
        self.env = {k: v for k, v in os.environ.items() if k != "AWS_PROFILE"}
        self.env.update(tool_env(self.ep, rclone_conf))
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        )
        self.samples: list[Sample] = []
        self.drop = not args.no_drop_caches
        self.agents: dict[str, Agent] = {}
        self.tools: list[str] = []

    # -- measuring ----------------------------------------------------------------------

    def cold(self) -> None:
        """Page cache dropped (checkpoint data, store data), then every tool's code loaded
        again: we time moving cold data, not loading programs from disk."""
        if not self.drop:
            return
        if not drop_caches():
            print("note: cannot drop the page cache (not root?); running warm", flush=True)
            self.drop = False
            return
        for argv in self.cmd.warm_code(self.tools):
            subprocess.run(argv, env=self.env, capture_output=True, check=False)

    def startup_costs(self) -> dict[str, dict[str, float]]:
        """Seconds each tool takes to load its code from a cold page cache, and warm."""
        out: dict[str, dict[str, float]] = {}
        for tool in ("ferry", *self.tools):
            argv = self.cmd.startup(tool)
            got = {}
            for state in ("cold", "warm"):
                if state == "cold" and not (self.drop and drop_caches()):
                    continue
                t0 = time.perf_counter()
                subprocess.run(argv, env=self.env, capture_output=True, check=True)
                got[state] = time.perf_counter() - t0
            out[tool] = got
        return out

    def command(
        self, data_label: str, scenario: str, tool: str, rnd: int, argv: list[str], nbytes: int
    ) -> Sample:
        self.cold()
        ran = run_timed(argv, self.env, self.server_pid)
        if ran.returncode != 0:
            raise SystemExit(
                f"{shlex.join(argv)} failed ({ran.returncode}):\n{ran.stdout[-2000:]}\n"
                f"{ran.stderr[-2000:]}"
            )
        detail: dict[str, Any] = {}
        if tool == "ferry":
            detail = json.loads(ran.stdout)
            nbytes = int(detail["bytes_transferred"])
        sample = Sample(
            data_label, scenario, tool, rnd, ran.seconds, ran.cpu_user + ran.cpu_sys,
            ran.peak_rss_mb, nbytes, ran.server_cpu, ran.other_cpu, detail,
        )  # fmt: skip
        self.record(sample)
        return sample

    def prefetch(self, data_label: str, scenario: str, rnd: int, agent: Agent, job: str) -> Sample:
        self.cold()
        srv0, busy0 = proc_cpu_seconds(self.server_pid), system_busy_seconds()
        got = agent.prefetch(job, NEXT_STEP)
        srv1, busy1 = proc_cpu_seconds(self.server_pid), system_busy_seconds()
        status = got["status"]
        server = None if srv0 is None or srv1 is None else srv1 - srv0
        other = None
        if busy0 is not None and busy1 is not None:
            other = max(0.0, busy1 - busy0 - (got["cpu"] or 0) - (server or 0))
        sample = Sample(
            data_label, scenario, "ferry", rnd, got["seconds"], got["cpu"], got["peak_rss_mb"],
            sum(status["bytes_by_source"].values()), server, other,
            {k: status.get(k) for k in ("bytes_by_source", "chunks_local", "dest")},
        )  # fmt: skip
        self.record(sample)
        return sample

    def record(self, s: Sample) -> None:
        self.samples.append(s)
        rss = f"{s.peak_rss_mb:6.0f} MB" if s.peak_rss_mb is not None else "   n/a"
        cpu = f"{s.cpu:5.1f} s" if s.cpu is not None else "  n/a"
        print(
            f"  r{s.round} {s.data:<18} {s.scenario:<30} {s.tool:<6} {s.seconds:7.2f} s  "
            f"CPU {cpu}  RSS {rss}  moved {s.bytes_moved / MB:9.1f} MB",
            flush=True,
        )

    def quiet(self, argv: list[str]) -> None:
        subprocess.run(argv, env=self.env, capture_output=True, check=False)

    # -- agents -------------------------------------------------------------------------

    def start_agents(self) -> None:
        token = self.work / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        tier = self.cmd.s3("ferry")
        init = [*self.cmd.ferry, "init", tier, "--endpoint-url", self.ep.url]
        subprocess.run(init, env=self.env, capture_output=True, check=True)  # agents make none

        def make(name: str, peers: list[str]) -> Agent:
            hot = self.work / f"hot-{name}"
            env = agent_env(self.env, name, hot, tier, self.ep.url, token, peers)
            return Agent(name, hot, env)

        a = make("node-a", [])
        self.agents = {"a": a, "b": make("node-b", []), "c": make("node-c", [a.url])}
        for agent in self.agents.values():  # started side by side: start-up is slow here
            agent.launch(self.work / f"agent-{agent.name}.log")
        for agent in self.agents.values():
            agent.wait_healthy(self.work / f"agent-{agent.name}.log")

    def stop_agents(self) -> None:
        for agent in self.agents.values():
            agent.stop()

    # -- scenarios ----------------------------------------------------------------------

    def scenarios(
        self, label: str, k: Path, k1: Path, tools: list[str], rnd: int, digests: Any
    ) -> None:
        digest_k, digest_k1 = digests
        job = f"{_slug(label)}-r{rnd}"
        raw_k, raw_k1 = data.tree_bytes(k), data.tree_bytes(k1)
        # alternate who goes first, so drifts on this shared machine land on every tool
        order = ["ferry", *tools]
        shift = (rnd - 1) % len(order)
        order = order[shift:] + order[:shift]
        scratch = self.work / "scratch"
        scratch.mkdir(exist_ok=True)
        prefix = {t: f"{t}-{job}" for t in tools}

        def peer_bytes(tool: str, raw: int) -> int:
            z = scratch / "zst-out"  # plain zstd uploads what it compressed
            return data.tree_bytes(z) if tool == "zstd" else raw

        cmd = self.cmd

        def push_all(scenario: str, ckpt: Path, step: int, raw: int) -> dict[str, int]:
            """Every tool uploads ``ckpt``; returns the bytes each peer stored."""
            stored: dict[str, int] = {}
            for tool in order:
                if tool == "ferry":
                    argv = cmd.ferry_push(ckpt, "ferry", job, step)
                else:  # for save k+1 the prefix holds save k: peers may sync
                    argv = cmd.push(tool, ckpt, prefix[tool], scratch, sync=step == NEXT_STEP)
                s = self.command(label, scenario, tool, rnd, argv, raw)
                if tool != "ferry":
                    s.bytes_moved = stored[tool] = peer_bytes(tool, raw)
            return stored

        push_all(PUSH, k, BASE_STEP, raw_k)  # cold full push of save k
        stored_k1 = push_all(INCR, k1, NEXT_STEP, raw_k1)  # save k+1 with k in the store
        shutil.rmtree(scratch / "zst-out", ignore_errors=True)
        # cold full pull: ferry restores save k (a keyframe: every chunk coded on its own),
        # the peers download save k+1 (the same size; what they hold last). Then ferry's
        # pull of k+1, whose delta chunks need k's chunks as well (more bytes than raw).
        for tool in order:
            dest = scratch / f"pull-{tool}"
            if tool == "ferry":
                argv = cmd.ferry_pull("ferry", job, BASE_STEP, dest)
                self.command(label, PULL, tool, rnd, argv, 0)
                check_same(digest_k, dest, "ferry pull of k")
            else:
                argv = cmd.pull(tool, prefix[tool], dest)
                self.command(label, PULL, tool, rnd, argv, stored_k1.get(tool, 0))
                check_same(digest_k1, dest, f"{tool} pull")
            shutil.rmtree(dest)
        dest = scratch / "pull-ferry-k1"
        argv = cmd.ferry_pull("ferry", job, NEXT_STEP, dest)
        self.command(label, PULL_DELTA, "ferry", rnd, argv, 0)
        check_same(digest_k1, dest, "ferry pull of k+1")
        shutil.rmtree(dest)
        # onto a node holding k (the directory is named by its step: ferry finds its
        # manifests and reads from it only what it needs)
        argv = [*cmd.ferry_pull("ferry", job, NEXT_STEP, dest), "--base-dir", str(k)]
        self.command(label, PULL_BASE, "ferry", rnd, argv, 0)
        check_same(digest_k1, dest, "ferry pull of k+1 holding k")
        shutil.rmtree(dest)
        for tool in tools:
            self.quiet(self.cmd.remove(prefix[tool]))
        if self.agents:
            self.prefetches(label, k, k1, job, rnd, digest_k1)

    def prefetches(self, label: str, k: Path, k1: Path, job: str, rnd: int, digest_k1: Any) -> None:
        a, b, c = self.agents["a"], self.agents["b"], self.agents["c"]
        base = f"step_{BASE_STEP:06d}"
        nxt = f"step_{NEXT_STEP:06d}"
        data.link_tree(k, b.hot / job / base)
        data.link_tree(k, c.hot / job / base)
        # the peer is the node that trained: it holds k and k+1 (hot_keep_last 2), so it can
        # send C the chunks of k+1 as deltas against k
        data.link_tree(k, a.hot / job / base)
        data.link_tree(k1, a.hot / job / nxt)
        # their watchers push what appeared (all deduplicated)
        for agent, step in ((a, BASE_STEP), (a, NEXT_STEP), (b, BASE_STEP), (c, BASE_STEP)):
            agent.wait_pushes_settled(job, step)
        for agent, scenario in ((b, PREFETCH), (c, P2P)):
            s = self.prefetch(label, scenario, rnd, agent, job)
            check_same(digest_k1, agent.hot / job / nxt, f"prefetch on {agent.name}")
            if scenario == P2P and not s.detail["bytes_by_source"].get("peer"):
                print(f"  note: no bytes came from the peer: {s.detail}", flush=True)
            shutil.rmtree(agent.hot / job / nxt)

    def scaling(self, pairs: list[tuple[int, Path]], runs: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for size_mb, ckpt in pairs:
            digest = tree_digest(ckpt)
            raw = sum(n for n, _ in digest.values())
            label = f"scale-{size_mb}mb"  # also a job name
            got: dict[tuple[str, str], list[Sample]] = {}
            for rnd in range(1, runs + 1):
                job = f"{label}-r{rnd}"
                dest = self.work / "scale-pull"
                order = ["ferry", "s5cmd"] if rnd % 2 else ["s5cmd", "ferry"]
                for tool in order:
                    if tool == "ferry":
                        argv = self.cmd.ferry_push(ckpt, "ferry", job, BASE_STEP)
                    else:
                        argv = self.cmd.push("s5cmd", ckpt, job, self.work, sync=False)
                    s = self.command(label, "push", tool, rnd, argv, raw)
                    got.setdefault((tool, "push"), []).append(s)
                for tool in order:
                    if tool == "ferry":
                        argv = self.cmd.ferry_pull("ferry", job, BASE_STEP, dest)
                    else:
                        argv = self.cmd.pull("s5cmd", job, dest)
                    s = self.command(label, "pull", tool, rnd, argv, raw)
                    got.setdefault((tool, "pull"), []).append(s)
                    check_same(digest, dest, f"{tool} pull ({label})")
                    shutil.rmtree(dest)
                self.quiet(self.cmd.remove(job))
            for (tool, op), group in got.items():
                rows.append(
                    {
                        "size_mb": round(raw / MB),
                        "tool": tool,
                        "op": op,
                        "runs": len(group),
                        "median_s": statistics.median(x.seconds for x in group),
                        "peak_rss_mb": max(x.peak_rss_mb or 0 for x in group),
                        "cpu_s": statistics.median(x.cpu or 0 for x in group),
                        "bytes_moved": int(statistics.median(x.bytes_moved for x in group)),
                    }
                )
        return rows

    def warm_up(self, ckpt: Path) -> None:
        """One untimed upload per tool: a fresh server allocates volumes on its first writes."""
        for argv in (
            self.cmd.push("s5cmd", ckpt, "warmup", self.work, sync=False),
            self.cmd.ferry_push(ckpt, "ferry", "warmup", 1),
        ):
            subprocess.run(argv, env=self.env, capture_output=True, check=True)
        self.quiet(self.cmd.remove("warmup"))


# -- summary ------------------------------------------------------------------------------


def summarize(samples: list[Sample]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.data, s.scenario, s.tool), []).append(s)
    med = {key: statistics.median(x.seconds for x in g) for key, g in groups.items()}
    rows: list[dict[str, Any]] = []
    labels = list(dict.fromkeys(s.data for s in samples))
    for label in labels:
        for scenario in SCENARIOS:
            for tool in ("ferry", *PEERS):
                g = groups.get((label, scenario, tool))
                if not g:
                    continue
                row: dict[str, Any] = {
                    "data": label,
                    "scenario": scenario,
                    "tool": tool,
                    "runs": len(g),
                    "median_s": med[(label, scenario, tool)],
                    "min_s": min(x.seconds for x in g),
                    "max_s": max(x.seconds for x in g),
                    "bytes_moved": int(statistics.median(x.bytes_moved for x in g)),
                    "peak_rss_mb": max((x.peak_rss_mb or 0) for x in g) or None,
                    "cpu_s": _median([x.cpu for x in g]),
                    "server_cpu_s": _median([x.server_cpu for x in g]),
                    "other_cpu_s": _median([x.other_cpu for x in g]),
                    # ferry's own timer (no interpreter start-up), for the CLI rows
                    "tool_reported_s": _median([x.detail.get("seconds") for x in g]),
                }
                if tool == "ferry":
                    for peer in PEERS:
                        base = med.get((label, BASELINE[scenario], peer))
                        row[f"vs_{peer}"] = row["median_s"] / base if base else None
                rows.append(row)
    return rows


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| data | scenario | tool | median s (min–max) | MB moved | peak RSS MB | CPU s "
        "| server CPU s | ours/s5cmd | ours/rclone | ours/zstd |"
    )
    out = [head, "|" + "---|" * 11]

    def f(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in rows:
        ratios = [f(r.get(f"vs_{p}"), ".2f") + ("x" if r.get(f"vs_{p}") else "") for p in PEERS]
        out.append(
            f"| {r['data']} | {r['scenario']} | {r['tool']} | {r['median_s']:.2f} "
            f"({r['min_s']:.2f}–{r['max_s']:.2f}) | {r['bytes_moved'] / MB:,.1f} | "
            f"{f(r['peak_rss_mb'], '.0f')} | {f(r['cpu_s'], '.1f')} | "
            f"{f(r['server_cpu_s'], '.1f')} | {' | '.join(ratios)} |"
        )
    return "\n".join(out)


def scaling_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| size MB | op | tool | median s | peak RSS MB | CPU s | ours/s5cmd |"]
    out.append("|" + "---|" * 7)
    by_key = {(x["size_mb"], x["op"], x["tool"]): x for x in rows}
    for r in sorted(rows, key=lambda r: (r["size_mb"], r["op"], r["tool"])):
        peer = by_key.get((r["size_mb"], r["op"], "s5cmd"))
        ratio = f"{r['median_s'] / peer['median_s']:.2f}x" if peer and r["tool"] == "ferry" else ""
        out.append(
            f"| {r['size_mb']:,} | {r['op']} | {r['tool']} | {r['median_s']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {r['cpu_s']:.1f} | {ratio} |"
        )
    return "\n".join(out)


def limits_markdown(lim: dict[str, float], eff: dict[str, float]) -> str:
    out = ["| what | MB/s |", "|---|---|"]
    for k, v in lim.items():
        value = f"{v:,.2f}x (raw / stored)" if k == "codec_ratio" else f"{v:,.0f}"
        out.append(f"| {k.replace('_', ' ')} | {value} |")
    for k, v in eff.items():
        out.append(f"| {k.replace('_', ' ')} | {v:,.0f} |")
    return "\n".join(out)


def startup_markdown(startup: dict[str, dict[str, float]]) -> str:
    out = ["| tool | start-up s, cold page cache | warm |", "|---|---|---|"]
    for tool, got in startup.items():
        cold = f"{got['cold']:.2f}" if "cold" in got else "n/a"
        out.append(f"| {tool} | {cold} | {got['warm']:.2f} |")
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, 1 round (CI)")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 3; quick 1)")
    ap.add_argument("--size-mb", type=int, default=1024, help="main checkpoint size")
    ap.add_argument("--scale-mb", default="256,1024,4096", help="sizes for the scaling plot")
    ap.add_argument("--scale-runs", type=int, default=None, help="default 2; quick 1")
    ap.add_argument("--tools", default=",".join(PEERS), help="peers to run")
    ap.add_argument("--no-torch", action="store_true", help="skip the real DCP series")
    ap.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="a real-training corpus (python -m bench.corpus DIR): its full fine-tune (steps "
        "20 and 40, 8 ranks) is the main pair, its frozen and bf16 series run beside it",
    )
    cache = Path(tempfile.gettempdir()) / "ferry-compare-cache"
    ap.add_argument("--cache", type=Path, default=cache, help="generated series (reused)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the workdir and scaled data")
    args = ap.parse_args(argv)
    if args.quick:
        args.base_mb = 8
        args.size_mb = 8
        args.scale_mb = "8,16"
        args.runs = args.runs or 1
        args.scale_runs = args.scale_runs or 1
        args.no_torch = True
        args.no_drop_caches = True  # CI: sanity of the harness, not cold-cache numbers
    else:
        args.base_mb = 256
        args.runs = args.runs or 3
        args.scale_runs = args.scale_runs or 2
    return args


def reproduce(args: argparse.Namespace, argv: list[str] | None) -> str:
    return shlex.join(["python", "-m", "bench.compare", *(sys.argv[1:] if argv is None else argv)])


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = reproduce(args, argv)
    print(f"reproduce: {command}  (from the repo root)", flush=True)
    started = time.monotonic()
    source_before = source_info(REPO)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ferry-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    tools = [t for t in args.tools.split(",") if t]
    for tool in [t for t in tools if shutil.which(t) is None]:
        print(f"note: {tool} is not on PATH: skipped", flush=True)
        tools.remove(tool)
    scaled_root = work / "scaled"
    server: S3Server | None = None
    run: Run | None = None
    try:
        # -- data
        t0 = time.perf_counter()
        k, k1 = data.series(args.cache, "synthetic", "full", args.base_mb)
        sets: list[tuple[str, Path, Path, list[str]]] = []
        if args.corpus is not None:
            for variant in ("full", "frozen", "bf16"):
                ck, ck1 = (args.corpus / variant / f"step_{s:06d}" for s in (BASE_STEP, NEXT_STEP))
                if ck.is_dir() and ck1.is_dir():
                    label = f"real {variant} {data.tree_bytes(ck) / MB:,.0f} MB, 8 ranks"
                    sets.append((label, ck, ck1, tools if variant == "full" else ["s5cmd"]))
            if not sets or "full" not in sets[0][0]:
                raise SystemExit(f"{args.corpus} has no full/step_000020 and step_000040")
            main_pair = (sets[0][1], sets[0][2])
        else:
            copies = max(1, round(args.size_mb / args.base_mb))
            main_pair = data.scaled_pair(k, k1, scaled_root, copies)
            label = f"synthetic {data.tree_bytes(main_pair[0]) / MB:,.0f} MB"
            sets.append((label, *main_pair, tools))
        if args.corpus is None and not args.no_torch and torch_available():
            for variant in ("full", "frozen", "bf16"):
                pk, pk1 = data.series(args.cache, "torch", variant, 64)
                sets.append((f"torch-{variant} DCP", pk, pk1, ["s5cmd"]))
        elif args.corpus is None and not args.no_torch:
            print("note: torch is not installed: the real DCP series are skipped", flush=True)
        scale_pairs = []
        for mb in (int(x) for x in args.scale_mb.split(",") if x):
            n = max(1, round(mb / args.base_mb))
            scale_pairs.append((mb, data.scaled_pair(k, k1, scaled_root, n)[0]))
        print(f"data ready in {time.perf_counter() - t0:.0f} s", flush=True)

        # -- server, limits, agents
        server = start_s3_server(work / "s3server")
        run = Run(args, server, work)
        run.tools = tools
        print(f"S3 server: {run.ep.kind} at {run.ep.url}", flush=True)
        lim_size = min(data.tree_bytes(main_pair[0]), 1 << 30)
        lim: dict[str, float] = {}
        lim.update(limits.disk(work, lim_size))
        lim.update(limits.s3_raw(run.ep, work, lim_size))
        lim.update(limits.memcpy())
        lim.update(limits.codec(*main_pair, limit=min(lim_size, 256 << 20)))
        print("limits: " + ", ".join(f"{k_} {v:,.0f}" for k_, v in lim.items()), flush=True)
        startup = run.startup_costs()
        print(f"start-up (s): {startup}", flush=True)
        run.warm_up(k)
        run.start_agents()

        # -- rounds
        digests = {label: (tree_digest(a), tree_digest(b)) for label, a, b, _ in sets}
        for rnd in range(1, args.runs + 1):
            print(f"round {rnd}/{args.runs}", flush=True)
            for label, a, b, peers in sets:
                run.scenarios(label, a, b, peers, rnd, digests[label])
        run.stop_agents()
        print("scaling", flush=True)
        scale_rows = run.scaling(scale_pairs, args.scale_runs)

        # -- report
        rows = summarize(run.samples)
        main_label = sets[0][0]
        main_rows = [r for r in rows if r["data"] == main_label]
        raw_main = data.tree_bytes(main_pair[0])
        eff = {}
        for r in main_rows:
            if r["tool"] == "ferry" and r["scenario"] in (PUSH, PULL):
                eff[f"ferry {r['scenario']} (end to end)"] = raw_main / r["median_s"] / MB
        now = datetime.datetime.now(datetime.UTC)
        info = machine_info()
        info["s5cmd"] = _version(["s5cmd", "version"])
        info["rclone"] = _version(["rclone", "version"]).splitlines()[0]
        info["zstd"] = _version(["zstd", "--version"])
        source = source_info(REPO)
        cache = "dropped before every operation" if run.drop else "warm (not dropped)"
        header = (
            f"{now:%Y-%m-%d %H:%M} UTC, {info['cpus']} cores ({info['cpu_model']}), "
            f"S3 = {run.ep.kind} on loopback, page cache {cache}, median of {args.runs} "
            f"round(s) (scaling: {args.scale_runs}); {describe_source(source_before, source)}; "
            f"{info['s5cmd']}, {info['rclone']}, {info['zstd']}"
        )
        table, scale_table = markdown(rows), scaling_markdown(scale_rows)
        lim_table = limits_markdown(lim, eff) + "\n\n" + startup_markdown(startup)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        pngs = plots.scenario_plots(main_rows, args.out_dir, main_label, BASELINE)
        pngs.append(plots.scaling_plot(scale_rows, args.out_dir / "compare_scaling.png"))
        pngs.append(plots.limits_plot(lim, eff, args.out_dir / "compare_limits.png"))
        md = (
            f"# bench.compare\n\n`{command}`\n\n{header}\n\n## Scenarios\n\n{table}\n\n"
            f"## Scaling (cold push / pull)\n\n{scale_table}\n\n## Limits\n\n{lim_table}\n"
        )
        (args.out_dir / "compare.md").write_text(md)
        doc = {
            "command": command,
            "date_utc": now.isoformat(timespec="seconds"),
            "machine": info,
            "source": source_before,
            "source_after": source,
            "server": {"kind": run.ep.kind, "url": run.ep.url},
            "page_cache": cache,
            "runs": args.runs,
            "quick": args.quick,
            "total_seconds": round(time.monotonic() - started, 1),
            "summary": rows,
            "scaling": scale_rows,
            "limits_mb_per_s": lim,
            "startup_seconds": startup,
            "effective_mb_per_s": eff,
            "samples": [dataclasses.asdict(s) for s in run.samples],
            "plots": [p.name for p in pngs],
        }
        (args.out_dir / "compare.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\n{header}\n\n{table}\n\n{scale_table}\n\n{lim_table}\n")
        print(f"wrote {args.out_dir}/compare.{{json,md}} and {', '.join(p.name for p in pngs)}")
        print(f"total {time.monotonic() - started:.0f} s")
    finally:
        if run is not None:
            run.stop_agents()
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _slug(label: str) -> str:
    """A job / prefix name from a data label."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-")


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError:
        return "n/a"
    return (done.stdout or done.stderr).strip()


if __name__ == "__main__":
    sys.exit(main())
