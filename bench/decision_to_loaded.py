"""From the scheduler's decision to every rank's state loaded: what an elastic-training
scheduler waits for, by how the next checkpoint reaches the node.

    python -m bench.decision_to_loaded SERIES_DIR [--runs 3] [--busy-memory]

SERIES_DIR holds step_*/ saves (``bench.gen_checkpoints``, ``bench.corpus``); its two
newest are k and k+1. Starts SeaweedFS on loopback, pushes k, then k+1 (delta-coded
against k) into a store, and uploads k+1's raw files under a separate prefix of the same
bucket for s5cmd. Three real ``ferry agent`` processes serve the store's prefix as their
tier: S, a standby for the job (it has copied k+1 in before the decision), B, whose hot dir
holds k (copied in as the training save would have written it), and C, empty.

Each run times every case once (the order rotating from run to run), from t0, "the
decision", to every tensor of k+1 loaded in a fresh loader process: before t0 the loader
has imported torch and loaded a tiny save once (not timed: bench/write_path.py
``start_loader(warm=True)``) and waits, the page cache is dropped and the machine left to
settle (bench/_measure.py: at most ``--settle-limit`` seconds). Decision -> loaded is the
fetch's seconds plus the load's (as the loader timed it, from its go signal; its
state_dict is made, every page written, before that clock starts, as a training process's
model and optimizer state exist before it loads: ``--fresh-targets`` makes it inside the
timed load instead, untouched). ckpt-ferry's cases load their files with ckpt-ferry's
LocalReader (transfer/engine/dcplocal_torch.py; ``--torch-load``: torch's reader). The
cases:

- standby: the prefetch RPC of k+1 to S answers ready at once (nothing moved), then load;
- prefetch holding k / onto an empty node: the prefetch RPC of k+1 to B / C (the
  scheduler's client polls its status until ready), then load from the agent's hot dir;
- ``s5cmd cp`` of k+1's raw files into an empty directory, then load; ``s5cmd cp`` then
  ``sync`` of those files (fsync: its bytes on disk, as an O_DIRECT restore's are); both
  loaded by torch's own FileSystemReader, as the plain tool's user would; and ``s5cmd cp``
  then a load by ckpt-ferry's LocalReader, which shows what the reader alone is worth;
- ``ferry pull`` (the CLI) holding k (``--base-dir``: B's copy) and cold, then load;
- the same through the node's agent (``FERRY_LOCAL_SOCKET``: C's local socket, C pulls
  into the CLI's destination with its warm connections and buffers; its CPU counted too);
- FerryReader holding k / onto an empty node: the loader's ``dcp.load`` reads k+1 from the
  store itself (transfer/engine/dcpreader_torch.py; ``base_dir`` B's copy of k, or none):
  no fetch before the load, nothing written to disk; its fetch CPU is the loader's CPU
  over the whole load (deserialising included), and its load is the whole wait.

Printed per case: medians of the fetch, the load and decision -> loaded; the fetch's CPU
seconds per raw GB (the agent process's utime + stime from t0 to ready, the CLI's or
s5cmd's own; the S3 server's is not counted); each case's total against s5cmd cp's and
s5cmd cp + sync's; per case and run, what the disk holding the hot dirs read and wrote
during the load (the whole device's counters: other work on the machine shows there too)
and the agents' CPU meanwhile. And the limits the stages run against, measured at the start: the
hot dir's disk with O_DIRECT (``dd``, bench/limits.py), one GET of as many bytes from the
S3 server, and the load alone (k+1's own files) from a cold and from a warm page cache.
The first run compares every restored copy with k+1 byte for byte; every load's tensors
are checked against the load of k+1 itself.

``--write-path``: how the agents' and the CLI's restores write (``warm``, ``direct``, ``buffered``,
``auto``; default: the product's own default), to compare the write paths' whole waits.

``--cases prefetch,ferry pull via``: only the cases whose names contain one of these (with
``s5cmd cp`` and ``s5cmd cp + sync``, which every ratio needs): shorter runs for A/B work.

``--link RATE`` (root): every case's transfers over a link shaped to RATE each way (e.g.
``2gbit``; bench/shaped_link.py's veth pair and ``tc tbf``): the agents, ``s5cmd`` and the
CLI run in a network namespace and reach the S3 server on the host end, as a node reads
its store over a NIC, not over loopback (the pushes before, and the loads, are not shaped).

``--busy-memory``: the same while a helper process holds ``--busy-fraction`` (0.7) of
MemAvailable, allocated and touched, so a path that leaves its bytes in the page cache for
the load cannot count on spare memory (released at the end).
Results: bench/results/decision_to_loaded[_busy].md and .json (``--out-stem``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.rpc.client import FerryClient  # noqa: E402
from bench import estimate_cases, tls_cost  # noqa: E402
from bench._env import reproduce_command, write_results  # noqa: E402
from bench._loopback import loopback_s3  # noqa: E402
from bench._measure import (  # noqa: E402
    check_same,
    device_bytes,
    drop_caches,
    proc_cpu_seconds,
    run_timed,
    settle,
    tree_digest,
)
from bench.agents import TOKEN, Agent, agent_env  # noqa: E402
from bench.limits import disk, s3_raw  # noqa: E402
from bench.peers import Commands, tool_env  # noqa: E402
from bench.shaped_link import HOST_IP, NS, NS_IP, shaped_link  # noqa: E402
from bench.store_cost import saves  # noqa: E402
from bench.write_path import Loaded, load, start_loader  # noqa: E402
from tests.s3server import S3Endpoint  # noqa: E402
from transfer.format.names import step_from_dirname  # noqa: E402
from transfer.options import WRITE_PATHS  # noqa: E402

JOB = "bench"
#: `ferry pull` with FERRY_LOCAL_SOCKET naming agent C's local socket: the agent pulls
VIA_AGENT = "ferry pull via its agent"
assert JOB == estimate_cases.JOB == tls_cost.JOB  # their helpers name the job
MB, GB = 1e6, 1e9
CASES = (
    "standby",
    "prefetch holding k",
    "prefetch, empty node",
    "s5cmd cp",
    "s5cmd cp + sync",
    "s5cmd cp + LocalReader",
    "ferry pull holding k",
    "ferry pull, cold",
    VIA_AGENT + " holding k",
    VIA_AGENT + ", cold",
    "FerryReader holding k",
    "FerryReader, empty node",
)
STREAMED = ("FerryReader holding k", "FerryReader, empty node")
PLAIN, SYNCED = "s5cmd cp", "s5cmd cp + sync"
TORCH_LOADED = (PLAIN, SYNCED)  # the plain tool's: torch's own FileSystemReader
#: the load of k+1's own files, without a case: by torch's reader, by LocalReader
ALONE_TORCH, ALONE_LOCAL = "load alone", "load alone, LocalReader"

#: holds argv[1] bytes, every page touched, until its stdin closes; the first process the
#: kernel's OOM killer takes if the machine runs short after all
HOLDER = """
import sys
from pathlib import Path
Path("/proc/self/oom_score_adj").write_text("1000")
held = b"\\x01" * int(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("series", type=Path, help="a directory of step_*/ DCP saves")
    ap.add_argument("--runs", type=int, default=3)
    busy = "a helper process holds --busy-fraction of MemAvailable meanwhile"
    ap.add_argument("--busy-memory", action="store_true", help=busy)
    ap.add_argument("--busy-fraction", type=float, default=0.7)
    quiet = "at most this long waiting for a quiet machine before each case"
    ap.add_argument("--settle-limit", type=float, default=10.0, help=quiet)
    ap.add_argument("--write-path", choices=WRITE_PATHS, default=None,
                    help="how the agents' and the CLI's restores write (default: the "
                         "product's default)")  # fmt: skip
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="the node's transfers over a link shaped to RATE each way (tc: "
                         "2gbit, 10gbit; root)")  # fmt: skip
    ap.add_argument("--torch-load", action="store_true",
                    help="load every case's files with torch's FileSystemReader (default: "
                         "ckpt-ferry's LocalReader for ckpt-ferry's cases)")  # fmt: skip
    ap.add_argument("--fresh-targets", action="store_true",
                    help="make the state_dict inside the timed load, untouched (default: in "
                         "memory before the clock, as a training process's state is)")  # fmt: skip
    ap.add_argument("--cases", default=None, metavar="NAME,...",
                    help="only the cases whose names contain one of these (comma-separated; "
                         f"{PLAIN!r} and {SYNCED!r} always run: the ratios need them)")  # fmt: skip
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--out-stem", default=None,
                    help="results file name (default decision_to_loaded[_busy])")  # fmt: skip
    args = ap.parse_args(argv)
    args.cases = chosen_cases(args.cases)
    if not args.cases:
        ap.error("--cases: no case's name contains any of those")
    return args


def chosen_cases(names: str | None) -> tuple[str, ...]:
    """The cases ``--cases`` names (a substring of each), in CASES order, with the plain
    tool's two; every case without it."""
    if names is None:
        return CASES
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    picked = tuple(c for c in CASES if any(w in c for w in wanted))
    return tuple(c for c in CASES if c in picked or c in (PLAIN, SYNCED)) if picked else ()


def meminfo(field: str) -> int:
    """A /proc/meminfo field, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/meminfo")


def mem_available() -> int:
    return meminfo("MemAvailable")


@contextlib.contextmanager
def busy_memory(fraction: float) -> Iterator[dict[str, int]]:
    """A helper process holding ``fraction`` of MemAvailable while the block runs."""
    before = mem_available()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(int(before * fraction))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "held":
            raise SystemExit("the memory holder did not start")
        info = {"held": int(before * fraction), "available_before": before,
                "available_held": mem_available()}  # fmt: skip
        print(f"busy memory: holding {info['held'] / GB:.1f} GB; MemAvailable "
              f"{before / GB:.1f} -> {info['available_held'] / GB:.1f} GB", flush=True)  # fmt: skip
        yield info
        if holder.poll() is not None:
            raise SystemExit("the memory holder died while the cases ran (out of memory?)")
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=60)


@dataclass
class Node:
    """One agent process and the scheduler's RPC client to it."""

    agent: Agent
    client: FerryClient

    @property
    def pid(self) -> int:
        assert self.agent.proc is not None
        return self.agent.proc.pid


@dataclass(frozen=True)
class Link:
    """How the node's processes (agents, s5cmd, the CLI) reach the store: on loopback, or
    from a network namespace over a shaped veth pair (``--link``)."""

    endpoint: S3Endpoint  # the store's, as the node sees it
    wrap: tuple[str, ...] = ()  # what the node's commands run under
    host: str = "127.0.0.1"  # the address its agents listen on
    rate: str | None = None  # tc's rate each way, or None: loopback


@dataclass
class Bench:
    args: argparse.Namespace
    ep: S3Endpoint
    work: Path
    prefix: str  # of this run's objects in the bucket
    k: Path
    k1: Path
    link: Link
    cmd: Commands = field(init=False)
    env: dict[str, str] = field(init=False)
    nodes: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cmd = Commands(self.link.endpoint)
        # s5cmd from the interpreter's environment, activated or not
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # the node's state dir, the agents' and the CLI's: the CLI takes agent C's write
        # probe's choice from it (agent/node/writechoice.py), not the developer's own
        self.env = {**os.environ, **tool_env(self.link.endpoint, self.work / "rclone.conf"),
                    "PYTHONPATH": str(REPO), "PATH": path,
                    "XDG_STATE_HOME": str(self.work / "state")}  # fmt: skip
        self.step = step_from_dirname(self.k1.name) or 0
        self.digest = tree_digest(self.k1)
        self.raw_bytes = sum(size for size, _ in self.digest.values())
        self.tier = self.cmd.s3(f"{self.prefix}/tier")
        self.raw = self.cmd.s3(f"{self.prefix}/raw")

    async def setup(self) -> None:
        await tls_cost._push_both(self.tier, self.k, self.k1)
        ran = run_timed(self.cmd.s5cmd("cp", f"{self.k1}/*", f"{self.raw}/"), self.env, None)
        if ran.returncode != 0:
            raise SystemExit(f"s5cmd upload failed ({ran.returncode}): {ran.stderr[-2000:]}")
        (self.work / "token").write_text(TOKEN + "\n")
        held = self.hot("b") / JOB / self.k.name
        shutil.copytree(self.k, held)  # written there as by the training save
        for name, standby in (("s", JOB), ("b", ""), ("c", "")):
            env = agent_env(dict(os.environ), name, self.hot(name), self.tier,
                            self.link.endpoint.url, self.work / "token", [])  # fmt: skip
            # the tier holds k and k+1 already: B's watcher would push its k again beside
            # the measured cases; nothing else of the agents' own runs beside them either
            env.update(FERRY_QUIET_SECONDS="3600", FERRY_RETENTION_INTERVAL_SECONDS="3600",
                       FERRY_STANDBY_JOBS=standby, FERRY_STANDBY_MAX_RATE="0",
                       XDG_STATE_HOME=self.env["XDG_STATE_HOME"])  # fmt: skip
            if self.args.write_path:
                env["FERRY_TRANSFER_WRITE_PATH"] = self.args.write_path
            if name == "c":  # (the CLI's pulls through an agent: C's, between its cases)
                env["FERRY_LOCAL_SOCKET"] = str(self.local_socket)
            agent = Agent(name, self.hot(name), env, host=self.link.host, wrap=self.link.wrap)
            agent.launch(self.work / f"agent-{name}.log")
            self.nodes[name] = Node(agent, FerryClient(agent.url, TOKEN, timeout=900))
        for name, node in self.nodes.items():
            node.agent.wait_healthy(self.work / f"agent-{name}.log")
        began = time.monotonic()
        await estimate_cases.replicated(self.nodes["s"].client, self.step)
        print(f"standby S has k+1 ({time.monotonic() - began:.1f} s after its start)", flush=True)

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.client.close()
            node.agent.stop()

    def busy(self) -> tuple[int, int, float]:
        """Bytes the hot dir's disk has read and written, CPU seconds the agents have used."""
        read, written = device_bytes(self.work) or (0, 0)
        cpu = sum(proc_cpu_seconds(node.pid) or 0.0 for node in self.nodes.values())
        return read, written, cpu

    @property
    def local_socket(self) -> Path:
        return self.work / "agent-c.sock"

    def hot(self, name: str) -> Path:
        return self.work / f"hot-{name}"

    def dest(self, case: str) -> Path:
        """Where the case puts k+1 (and the loader reads it)."""
        if case == "standby":
            return self.hot("s") / JOB / self.k1.name
        if case.startswith("prefetch"):
            return self.hot("b" if "holding" in case else "c") / JOB / self.k1.name
        return self.work / "dest" / self.k1.name

    def loader_source(self, case: str) -> str:
        """What the case's loader loads: ``dest(case)``, or (FerryReader) the store's step."""
        if case not in STREAMED:
            return str(self.dest(case))
        held = self.hot("b") / JOB / self.k.name
        spec = {"store": self.tier, "job": JOB, "step": self.step,
                "base_dir": str(held) if "holding" in case else None,
                "endpoint_url": self.link.endpoint.url}  # fmt: skip
        return "ferry+" + json.dumps(spec)

    def local_load(self, case: str) -> bool:
        """Whether ``case``'s files are loaded by LocalReader (ckpt-ferry's, for its own
        cases: ``--torch-load`` gives them torch's reader), not torch's FileSystemReader."""
        if case in STREAMED or case == ALONE_TORCH:
            return False
        return (
            case == ALONE_LOCAL
            or case == "s5cmd cp + LocalReader"
            or (case not in TORCH_LOADED and not self.args.torch_load)
        )

    def start_loader(self, case: str) -> subprocess.Popen[str]:
        """A warm loader for ``case`` (or k+1's own files: ALONE_*); a FerryReader's is
        started as the agents are (under ``--link``, behind the shaped link), with the
        store's keys. Its state_dict is in memory before the clock (``--fresh-targets``:
        made in the load)."""
        flags = ["local"] if self.local_load(case) else []
        if not self.args.fresh_targets:
            flags.append(f"shapes={self.k1}")
        if case not in STREAMED:
            save = self.k1 if case in (ALONE_TORCH, ALONE_LOCAL) else self.dest(case)
            return start_loader(save, warm=True, flags=flags)
        return start_loader(
            self.loader_source(case), warm=True, env=self.env, wrap=self.link.wrap, flags=flags
        )

    async def fetch(self, case: str) -> dict[str, Any]:
        """Bring k+1 to ``dest(case)``, timed from now: seconds, CPU seconds, bytes moved."""
        if case in STREAMED:  # the load fetches: its own CPU and bytes fill these in
            return {"fetch": 0.0, "cpu": 0.0, "moved": 0, "satisfied_by": None}
        if case == "standby" or case.startswith("prefetch"):
            node = self.nodes["s" if case == "standby" else "b" if "holding" in case else "c"]
            cpu0, began = proc_cpu_seconds(node.pid), time.monotonic()
            done = await estimate_cases.ready(
                node.client, await node.client.prefetch(JOB, self.step)
            )
            took, cpu1 = time.monotonic() - began, proc_cpu_seconds(node.pid)
            if done["state"] != "ready" or Path(done["dest"]) != self.dest(case):
                raise SystemExit(f"{case}: prefetch ended {done}")
            return {"fetch": took, "cpu": (cpu1 or 0.0) - (cpu0 or 0.0),
                    "moved": sum(done["bytes_by_source"].values()),
                    "satisfied_by": done["satisfied_by"]}  # fmt: skip
        return self.fetch_command(case)

    def fetch_command(self, case: str) -> dict[str, Any]:
        """s5cmd or the ferry CLI: the command's own wall clock and CPU seconds."""
        dest = self.dest(case)
        if case.startswith("s5cmd"):
            argv = self.cmd.s5cmd("cp", f"{self.raw}/*", f"{dest}/")
        else:
            argv = [*self.cmd.ferry_pull(f"{self.prefix}/tier", JOB, self.step, dest)]
            if "holding" in case:
                argv += ["--base-dir", str(self.hot("b") / JOB / self.k.name)]
            if self.args.write_path and not case.startswith(VIA_AGENT):  # (the agent's own)
                argv += ["--write-path", self.args.write_path]
        env = self.env
        if case.startswith(VIA_AGENT):
            env = {**env, "FERRY_LOCAL_SOCKET": str(self.local_socket)}
        agent_cpu0 = proc_cpu_seconds(self.nodes["c"].pid) or 0.0
        ran = run_timed([*self.link.wrap, *argv], env, None)
        agent_cpu = (proc_cpu_seconds(self.nodes["c"].pid) or 0.0) - agent_cpu0
        if ran.returncode != 0:
            raise SystemExit(f"{case} failed ({ran.returncode}): {ran.stderr[-2000:]}")
        took = ran.seconds
        if case == SYNCED:  # fsync each file and the directory: on disk, not just in memory
            began = time.monotonic()
            subprocess.run(["sync", str(dest), *map(str, dest.iterdir())], check=True)
            took += time.monotonic() - began
        moved, cpu = self.raw_bytes, ran.cpu_user + ran.cpu_sys
        if case.startswith("ferry"):
            doc = json_of(ran.stdout)
            moved = int(doc.get("bytes_transferred", 0))
            if case.startswith(VIA_AGENT):  # the pull is the agent's: its CPU too
                if doc.get("through_agent") != str(self.local_socket):
                    raise SystemExit(f"{case}: not pulled through the agent: {ran.stderr}")
                cpu += agent_cpu
        return {"fetch": took, "cpu": cpu, "moved": moved, "satisfied_by": None}

    async def clean(self, case: str) -> None:
        """Leave the node as it was before the case (the standby keeps its replica)."""
        if case == "standby" or case in STREAMED:
            return
        dest = self.dest(case)
        shutil.rmtree(dest)  # (an agent's restore: flushed, one_case waited for it)

    async def one_case(
        self, case: str, rnd: int, loader: subprocess.Popen[str], reference: str
    ) -> dict[str, Any]:
        """``loader``: started on ``dest(case)``, torch imported (before the clock). Beside
        the load: what the disk read and wrote meanwhile, and when an agent's flush of its
        restore (after ready) ended."""
        dest = self.dest(case)
        drop_caches()
        waited = settle(self.work, limit=self.args.settle_limit)
        fetched = await self.fetch(case)
        io0, ready_at = self.busy(), time.monotonic()
        dirty = meminfo("Dirty") + meminfo("Writeback")  # the machine's, at ready
        loading = asyncio.ensure_future(asyncio.to_thread(load, loader, self.busy))
        flushed = None
        if case.startswith("prefetch"):
            await estimate_cases.settled(dest.parent.parent, dest.name)
            flushed = time.monotonic() - ready_at
        loaded = await loading
        read, written, agents_cpu = (b - a for a, b in zip(io0, loaded.probed, strict=True))
        row = {"round": rnd, "case": case, **fetched, "load": loaded.seconds,
               "total": fetched["fetch"] + loaded.seconds, "settle_waited": waited,
               "agents_cpu_during_load": agents_cpu,
               "loaded_bytes": loaded.nbytes, "load_disk_read": read,
               "load_disk_written": written, "flushed_after": flushed,
               "dirty_at_ready": dirty}  # fmt: skip
        if case in STREAMED:
            row.update(cpu=loaded.cpu, moved=loaded.moved)
        if loaded.digest != reference:
            raise SystemExit(f"WRONG TENSORS loaded after {case}: {loaded.digest} != {reference}")
        if rnd == 1 and case not in STREAMED:
            check_same(self.digest, dest, case)
        await self.clean(case)
        return row


def json_of(text: str) -> dict[str, Any]:

    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def start_loaders(bench: Bench, cases: list[str]) -> list[subprocess.Popen[str]]:
    """A loader per case, all importing torch at once (sooner than one after another; each
    then waits idle for its turn)."""
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(bench.start_loader, cases))


def load_alone(loaders: list[subprocess.Popen[str]], disk: Path, limit: float) -> list[Loaded]:
    """The load of a save by itself (two loaders started on it), as the cases' loads run
    (page cache dropped, the machine left to settle): from a cold page cache, then again
    from the warm one the first left."""
    drop_caches()
    settle(disk, limit=limit)
    return [load(loader) for loader in loaders]


async def one_run(bench: Bench, rnd: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The load of k+1 alone (torch's reader, then LocalReader), cold and warm, then every
    case, the order rotated by ``rnd``."""
    cases = bench.args.cases
    shift = (rnd - 1) % len(cases)
    order = cases[shift:] + cases[:shift]
    loaders = start_loaders(bench, [ALONE_TORCH] * 2 + [ALONE_LOCAL] * 2 + list(order))
    try:
        cold, warm = load_alone(loaders[:2], bench.work, bench.args.settle_limit)
        local_cold, local_warm = load_alone(loaders[2:4], bench.work, bench.args.settle_limit)
        if len({cold.digest, warm.digest, local_cold.digest, local_warm.digest}) != 1:
            raise SystemExit("four loads of k+1 gave different tensors")
        alone = {"cold": cold.seconds, "warm": warm.seconds, "digest": cold.digest,
                 "local_cold": local_cold.seconds, "local_warm": local_warm.seconds}  # fmt: skip
        print(
            f"r{rnd} load alone: cold {cold.seconds:.2f} s, warm {warm.seconds:.2f} s; "
            f"LocalReader cold {local_cold.seconds:.2f} s, warm {local_warm.seconds:.2f} s"
        )
        rows = []
        for case, loader in zip(order, loaders[4:], strict=True):
            row = await bench.one_case(case, rnd, loader, cold.digest)
            rows.append(row)
            flushed = row["flushed_after"]
            during = (
                f"disk read {row['load_disk_read'] / MB:,.0f} MB, written "
                f"{row['load_disk_written'] / MB:,.0f} MB (dirty at ready "
                f"{row['dirty_at_ready'] / MB:,.0f} MB), agents' CPU "
                f"{row['agents_cpu_during_load']:.2f} s during the load"
                + ("" if flushed is None else f"; the agent's flush ended after {flushed:.2f} s")
            )
            print(f"r{rnd} {case:<21} fetch {row['fetch']:6.2f} s (CPU {row['cpu']:5.2f},"
                  f" {row['moved'] / MB:6,.0f} MB)  load {row['load']:5.2f} s  total "
                  f"{row['total']:6.2f} s  [{during}; settled {row['settle_waited']:.1f} s"
                  f"{', ' + row['satisfied_by'] if row['satisfied_by'] else ''}]",
                  flush=True)  # fmt: skip
    finally:
        for loader in loaders:  # those a failure left waiting
            if loader.poll() is None:
                loader.kill()
                loader.wait()
    return alone, rows


async def measure(
    args: argparse.Namespace, ep: S3Endpoint, work: Path, link: Link
) -> dict[str, Any]:
    k, k1 = saves(args.series)[-2:]
    bench = Bench(args, ep, work, f"d2l-{os.getpid()}-{int(time.time())}", k, k1, link)
    cases = args.cases
    doc: dict[str, Any] = {"series": str(args.series), "k": k.name, "k1": k1.name,
                           "raw_bytes": bench.raw_bytes, "cases": list(cases),
                           "runs": args.runs, "rows": [], "load_alone": [],
                           "link": link.rate, "fresh_targets": args.fresh_targets,
                           "local_loaded": [c for c in cases if bench.local_load(c)]}  # fmt: skip
    try:
        await bench.setup()
        with contextlib.ExitStack() as stack:
            if args.busy_memory:
                doc["busy_memory"] = stack.enter_context(busy_memory(args.busy_fraction))
            doc["limits"] = disk(work, bench.raw_bytes) | s3_raw(ep, work, bench.raw_bytes)
            print(", ".join(f"{name} {v:,.0f} MB/s" for name, v in doc["limits"].items()))
            for rnd in range(1, args.runs + 1):
                alone, rows = await one_run(bench, rnd)
                doc["load_alone"].append(alone)
                doc["rows"] += rows
    finally:
        await bench.close()
    doc["reference_digest"] = doc["load_alone"][0]["digest"]
    return doc


def report(doc: dict[str, Any]) -> str:
    def med(case: str, key: str) -> float:
        return float(statistics.median(r[key] for r in doc["rows"] if r["case"] == case))

    raw_mb, lim = doc["raw_bytes"] / MB, doc["limits"]
    alone = {key: statistics.median(a[key] for a in doc["load_alone"] if key in a)
             for key in ("cold", "warm", "local_cold", "local_warm")
             if any(key in a for a in doc["load_alone"])}  # fmt: skip
    cold, warm = alone["cold"], alone["warm"]
    local_cases = set(doc.get("local_loaded", ()))
    busy = doc.get("busy_memory")
    held = ""
    if busy:
        held = (
            f"; another process holding {busy['held'] / GB:.1f} GB (MemAvailable "
            f"{busy['available_before'] / GB:.1f} -> {busy['available_held'] / GB:.1f} GB)"
        )
    lines = [
        f"{doc['series']}: {doc['k1']} ({raw_mb:,.0f} MB raw) onto a node, from the decision "
        f"to every tensor loaded; medians of {doc['runs']} runs, page cache dropped before "
        f"each case{held}"
        + (
            f"; the node's transfers over a link shaped to {doc['link']} each way"
            if doc.get("link")
            else ""
        ),
        "",
        "| case | loaded by | fetch s | load s | decision -> loaded s | fetch CPU-s / raw GB "
        f"| moved MB | load: MB read from disk | load / its reader's load alone cold "
        f"| / {PLAIN} | / {SYNCED} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in doc["cases"]:
        total = med(case, "total")
        local = case in local_cases
        by = "FerryReader" if case in STREAMED else "LocalReader" if local else "torch"
        its_cold = alone.get("local_cold", cold) if local else cold
        lines.append(
            f"| {case} | {by} | {med(case, 'fetch'):.2f} | {med(case, 'load'):.2f} | "
            f"{total:.2f} | {med(case, 'cpu') / (raw_mb / 1e3):.2f} | "
            f"{med(case, 'moved') / MB:,.0f} | {med(case, 'load_disk_read') / MB:,.0f} | "
            f"{med(case, 'load') / its_cold:.2f}x | {total / med(PLAIN, 'total'):.2f}x | "
            f"{total / med(SYNCED, 'total'):.2f}x |"
        )
    write, read = lim["disk_write_direct"], lim["disk_read_direct"]
    get = lim["s3_get_one_object"]
    lines += [
        "",
        f"Limits, measured at the start: the hot dir's disk with O_DIRECT (`dd`): write "
        f"{write:,.0f} MB/s (k+1 in {raw_mb / write:.2f} s), read {read:,.0f} MB/s "
        f"({raw_mb / read:.2f} s); the S3 server from the host (never shaped), one object "
        f"of as many bytes "
        f"through botocore: GET {get:,.0f} MB/s ({raw_mb / get:.2f} s); the load of k+1 alone "
        f"(medians), by torch's reader: {cold:.2f} s from a cold page cache "
        f"({raw_mb / cold:,.0f} MB/s), {warm:.2f} s from a warm one ({raw_mb / warm:,.0f} MB/s)"
        + (
            f"; by LocalReader: {alone['local_cold']:.2f} s cold, {alone['local_warm']:.2f} s "
            f"warm ({alone['cold'] / alone['local_cold']:.2f}x and "
            f"{alone['warm'] / alone['local_warm']:.2f}x faster)."
            if "local_cold" in alone
            else "."
        ),
        "",
        "Loads: "
        + (
            "the state_dict is in memory, every page written, before the clock starts (as "
            "a training process's model and optimizer state are when it loads), "
            if not doc.get("fresh_targets")
            else "the state_dict is made inside the timed load (its pages untouched), "
        )
        + "then `dcp.load` reads k+1 into it: torch's own FileSystemReader for the plain "
        "tool's rows, ckpt-ferry's LocalReader (transfer/engine/dcplocal_torch.py) for "
        "ckpt-ferry's (and `s5cmd cp + LocalReader`, which shows the reader's share of the "
        "difference), FerryReader's own for its rows.",
    ]
    if any(case in STREAMED for case in doc["cases"]):
        lines += [
            "",
            "FerryReader rows: nothing is fetched before the load, which reads k+1 from the "
            "store itself, so its load is the whole wait; their CPU is the loader's over that "
            "load (fetch, decode, verify and deserialise), and the disk read during it is the "
            "S3 server's reading its own objects (its cache dropped, as before every case).",
        ]
    return "\n".join(lines)


@contextlib.contextmanager
def store_and_link(rate: str | None) -> Iterator[tuple[Path, S3Endpoint, Link]]:
    """A scratch directory, a running S3 server (its credentials in the environment, for
    the pushes made before the cases) and how the node reaches it: on loopback, or (``rate``)
    from bench/shaped_link.py's namespace over a veth pair shaped to ``rate`` each way."""
    if rate is None:
        with loopback_s3("ferry-d2l-") as (work, ep):
            yield work, ep, Link(ep)
        return
    with loopback_s3("ferry-d2l-", bind="0.0.0.0") as (work, ep), shaped_link(rate):
        port = ep.url.rsplit(":", 1)[1]  # the namespace reaches the server on HOST_IP
        seen = dataclasses.replace(ep, url=f"http://{HOST_IP}:{port}")
        yield work, ep, Link(seen, ("ip", "netns", "exec", NS), NS_IP, rate)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = reproduce_command([sys.executable, "-m", "bench.decision_to_loaded", *argv])
    print(command, flush=True)
    with store_and_link(args.link) as (work, ep, link):
        doc = asyncio.run(measure(args, ep, work, link))
    md = report(doc)
    print(md)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    stem = args.out_stem or (
        "decision_to_loaded_busy" if args.busy_memory else "decision_to_loaded"
    )
    write_results(args.out_dir, stem, command, date, md + "\n\n`" + command + "`\n", **doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
