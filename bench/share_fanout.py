"""Fleet scale: A agents on this machine prefetch the shares of a resharded DCP step, alone,
as one fan-out group, and (the behaviour before shares) the whole step as one group.

    python -m bench.share_fanout                                   # A = 16, rank i on agent i
    python -m bench.share_fanout --agents 8 --ranks-per-agent 2    # world 16, 2 ranks each
    python -m bench.share_fanout --agents 4 --width 2048 --chunk-size-kib 16 --json /tmp/sf.json

A real ``--save-ranks``-rank DCP save (``tests/dcp_drill.py``: gloo ranks on loopback, DTensor
``Shard(0)`` parameters + AdamW state; ``--width`` 16384: ~100 MB) is split by node (2 ranks
a node, node 0 also ``.metadata``) and every node pushes its part (``PushPlan(part=True)``,
``--chunk-size-kib`` chunks) straight into a real S3 server (SeaweedFS on loopback, started
as bench/fleet.py starts it). Then ``--agents`` agents run in this process on loopback, each
with its own hot dir and the S3 prefix as its tier, reading S3 through one counting proxy
(bench/fleet.py's ``CountingProxy``, which here also notes each pack GET's byte range). The
new world has A x ``--ranks-per-agent`` ranks; agent i hosts ranks i*R .. i*R+R-1. Three
rounds, each with fresh agents and empty hot dirs, every prefetch posted at once:

- ``alone``: every agent prefetches its share (``layout``), no group;
- ``fan-out shares``: the same, all A agents one fan-out group with ``fanout_layouts``;
- ``fan-out whole``: every agent prefetches the whole step (no layout) in one group, as
  before shares existed: every node receives everything, S3 is read about once.

Per round it prints the S3 pack bytes in all (the proxy's ``data_down``) against the union
of the agents' shares (the stored bytes of the chunks any share needs) and against one
stored copy of the step, pack bytes read more than once (overlapping ranges of one pack),
control requests and the manifest GETs among them (a member finds the parts its share touches
by the completion marker's file map; a whole-step member reads every part), and the wall
time; per agent (min / median / max over the A agents): the
bytes it moved (``bytes_by_source``: S3 and peers), its share's stored bytes (``plan_shares``
on the step's manifests; the whole step in the last round), moved / share, the raw bytes of
those chunks (a peer sends a chunk uncoded to a node that holds no base for it, so peer bytes
compare with these, S3 bytes with the stored ones), the share's raw bytes
(``.ferry-share.json``'s ``bytes``), the bytes allocated in its copy on disk (what lies
outside the share is punched out: about the share), and its prefetch's seconds.
Requests the agents make while starting are not counted. All agents share this machine's
cores: the times say how the group copes, not what real nodes take.

``--survivors-hold``: a scale-down's survivors, as after one: agent i is node ``n<i>`` of the
save and its hot dir holds that node's part of the step (its own ranks' files, as training
wrote them; ``commit_marker = ""``, so a part without ``.metadata`` counts as one), so a
prefetch adds to it what it lacks ("filled_in"). The S3 bytes then say what the group reads
of what none of its members holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.node.hotdir import HotDir
from bench._env import machine_info, source_info
from bench._loopback import agent, run_main
from bench.fleet import CountingProxy, Tally, mark_step_complete
from tests.s3server import S3Endpoint
from transfer.engine import PushPlan, push, resolve_manifests
from transfer.engine.catalog import Catalog
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.dcpshare import Layout
from transfer.engine.pull import share_chunk_ids
from transfer.engine.pullplan import merged_files
from transfer.engine.share import plan_shares
from transfer.format.share import SHARE_MARKER
from transfer.options import TransferOptions
from transfer.store import StoreOptions, open_store

JOB = "drill"
STEP = 100
RANKS_PER_NODE = 2  # of the saving world, as the scale-down drill splits it
ROUNDS = ("alone", "fan-out shares", "fan-out whole")
REPO = Path(__file__).resolve().parent.parent

AgentLayout = tuple[int, list[int]]


# -- counting pack reads ---------------------------------------------------------------------


class RangeProxy(CountingProxy):
    """The fleet bench's counting proxy, also noting the byte range of every pack GET of the
    current tally (to find pack bytes read more than once)."""

    def __init__(self, upstream: str, bucket: str) -> None:
        super().__init__(upstream, bucket)
        self.ranges: list[tuple[str, str]] = []  # (path, Range header)

    def begin(self, prefix: str) -> Tally:
        self.ranges = []
        return super().begin(prefix)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.tally is not None and request.method == "GET" and "/packs/" in request.path:
            self.ranges.append((request.path, request.headers.get("Range", "")))
        return await super()._handle(request)


def reread_bytes(ranges: Sequence[tuple[str, str]]) -> int:
    """Bytes of packs read more than once: the ranged GETs' lengths less their union, per pack
    (a GET without a Range header is left out)."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, header in ranges:
        if header.startswith("bytes=") and "-" in header and "," not in header:
            first, last = header.removeprefix("bytes=").split("-", 1)
            if first and last:
                by_key.setdefault(key, []).append((int(first), int(last) + 1))
    extra = 0
    for spans in by_key.values():
        covered, end = 0, -1
        for lo, hi in sorted(spans):
            covered += max(0, hi - max(lo, end))
            end = max(end, hi)
        extra += sum(hi - lo for lo, hi in spans) - covered
    return extra


# -- the step and its shares -----------------------------------------------------------------


@dataclass
class StepFacts:
    """What the stored step holds, and each agent's share of it."""

    raw: int  # file bytes of the whole step
    stored: int  # stored bytes of one copy: every distinct chunk once
    union: int  # stored bytes of the chunks any agent's share needs
    share_raw: list[int]  # per agent: the bytes its ranks read
    share_stored: list[int]  # per agent: stored bytes of the chunks its share needs
    chunk_raw: int  # raw bytes of the step's distinct chunks (what peers send, uncoded)
    share_chunk_raw: list[int]  # per agent: raw bytes of the distinct chunks its share needs


def layouts_of(agents: int, ranks_per_agent: int) -> list[AgentLayout]:
    """Agent i hosts ranks i*R .. i*R+R-1 of a world of agents x R."""
    world = agents * ranks_per_agent
    return [
        (world, list(range(i * ranks_per_agent, (i + 1) * ranks_per_agent))) for i in range(agents)
    ]


def save_on_nodes(root: Path, ranks: int, width: int) -> list[Path]:
    """The drill save of ``ranks`` ranks, split into node dirs of RANKS_PER_NODE ranks."""
    from tests.dcp_drill import save_drill, split_by_node

    save_drill(root / "save", ranks, width=width)
    nodes = split_by_node(root / "save", root / "nodes", RANKS_PER_NODE)
    shutil.rmtree(root / "save")
    return nodes


async def push_nodes(url: str, endpoint: str, nodes: list[Path], chunk: int) -> None:
    """Every node pushes its part straight to the server (not through the proxy), then the
    step's completion marker with its file map (what finds a share's parts) is written."""
    options = TransferOptions(chunk_size=chunk, part_size=max(chunk, 1 << 20), window=8)
    store = open_store(url, StoreOptions(endpoint_url=endpoint))
    try:
        for k, node_dir in enumerate(nodes):
            await push(
                store, node_dir, job=JOB, step=STEP, node=f"n{k}", options=options,
                plan=PushPlan(part=True),
            )  # fmt: skip
        await mark_step_complete(store, JOB, STEP)
    finally:
        await store.close()


async def step_facts(url: str, endpoint: str, layouts: list[AgentLayout]) -> StepFacts:
    """The step's sizes and the agents' shares, from its manifests and ``.metadata``."""
    store = open_store(url, StoreOptions(endpoint_url=endpoint))
    try:
        manifests = await resolve_manifests(store, JOB, STEP)
        index = ChunkIndex()
        for m in manifests:
            index.add_manifest(m)
        asks = {i: (Layout(w, tuple(r)), None) for i, (w, r) in enumerate(layouts)}
        shares = await plan_shares(Catalog(store), manifests, asks)
    finally:
        await store.close()
    files = merged_files(manifests)
    needs = [share_chunk_ids(files, shares[i]) for i in range(len(layouts))]
    every = {c.id for m in manifests for c in m.all_chunks()}
    stored = {cid: index[cid].stored for cid in every}
    return StepFacts(
        raw=sum(f.size for m in manifests for f in m.files),
        stored=sum(stored.values()),
        union=sum(stored[c] for c in set().union(*needs)),
        share_raw=[shares[i].nbytes for i in range(len(layouts))],
        share_stored=[sum(stored[c] for c in ids) for ids in needs],
        chunk_raw=sum(index[c].size for c in every),
        share_chunk_raw=[sum(index[c].size for c in ids) for ids in needs],
    )


# -- one round -------------------------------------------------------------------------------


@dataclass
class Round:
    name: str
    seconds: float
    tally: dict[str, Any]
    reread: int  # pack bytes read more than once
    agents: list[dict[str, Any]] = field(default_factory=list)  # one row per agent


def prefetch_args(name: str, urls: list[str], layouts: list[AgentLayout], i: int) -> dict[str, Any]:
    """What agent i's prefetch asks for in round ``name``."""
    me, by_url = urls[i], dict(zip(urls, layouts, strict=True))
    if name == "alone":
        return {"layout": layouts[i]}
    if name == "fan-out shares":
        return {"layout": layouts[i], "fanout": (urls, me), "fanout_layouts": by_url}
    return {"fanout": (urls, me)}


def hold_parts(hot_root: Path, parts: Sequence[Path]) -> None:
    """Agent i's hot dir holds node i's part of the step (``parts``: the save's node dirs)."""
    for i, part in enumerate(parts):
        shutil.copytree(part, HotDir(hot_root / f"a{i:02d}", "").step_path(JOB, STEP))


async def run_round(
    name: str,
    hot_root: Path,
    tier: str,
    layouts: list[AgentLayout],
    proxy: RangeProxy,
    within_s: float,
    held: Sequence[Path] = (),
) -> Round:
    """A fresh agent per layout, every prefetch posted at once, waited for together;
    with ``held``, agent i is node n<i> and holds that node's part (hold_parts)."""
    env = {"FERRY_COMMIT_MARKER": "", "FERRY_QUIET_SECONDS": "3600"} if held else {}
    if held:
        hold_parts(hot_root, held[: len(layouts)])
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                agent(f"n{i}" if held else f"a{i:02d}", hot_root / f"a{i:02d}", tier, **env)
            )
            for i in range(len(layouts))
        ]
        urls = [c.base_url for c in clients]
        tally = proxy.begin(tier.split("/", 3)[3])
        began = time.monotonic()
        try:
            ids = await asyncio.gather(
                *(
                    c.prefetch(JOB, STEP, **prefetch_args(name, urls, layouts, i))
                    for i, c in enumerate(clients)
                )
            )
            done = await asyncio.gather(
                *(
                    c.wait_prefetch(p, within_s=within_s, poll=0.2)
                    for c, p in zip(clients, ids, strict=True)
                ),
                return_exceptions=True,
            )
        finally:
            seconds = time.monotonic() - began
            proxy.end()
    rows = [agent_row(d) for d in done]
    return Round(name, round(seconds, 2), tally.to_dict(), reread_bytes(proxy.ranges), rows)


def agent_row(status: dict[str, Any] | BaseException) -> dict[str, Any]:
    """One agent's figures from its final prefetch status (and its copy on disk)."""
    if isinstance(status, BaseException):
        return {"state": "error", "error": f"{type(status).__name__}: {status}"}
    by = status["bytes_by_source"]
    dest = Path(status["dest"]) if status.get("dest") else None
    record = None
    if dest is not None and (dest / SHARE_MARKER).is_file():
        record = json.loads((dest / SHARE_MARKER).read_text())
    return {
        "state": status["state"],
        "satisfied_by": status["satisfied_by"],
        "error": status["error"],
        "moved": sum(by.values()),
        "from_s3": sum(v for k, v in by.items() if k.startswith("tier:")),
        "from_peers": by.get("peer", 0),
        "peers": len(status["bytes_by_peer"]),
        "record_bytes": None if record is None else record["bytes"],
        "allocated": allocated_bytes(dest) if dest is not None else 0,
        "seconds": status["seconds"],
    }


def allocated_bytes(root: Path) -> int:
    """Bytes the files under ``root`` occupy on disk (holes are not counted)."""
    if not root.is_dir():
        return 0
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


# -- the whole run ---------------------------------------------------------------------------


@contextlib.contextmanager
def endpoint_env(url: str) -> Iterator[None]:
    """AWS_ENDPOINT_URL at ``url`` (the agents read it as they start), restored afterwards."""
    old = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = url
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = old


def scratch_dir(prefix: str) -> Path:
    """Hot dirs on tmpfs when there is one (16 whole copies of the step in the last round)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


async def prepare(args: argparse.Namespace, ep: S3Endpoint, tier: str, work: Path) -> StepFacts:
    """Save, split and push the step (its node dirs kept under ``work``/nodes with
    ``--survivors-hold``); its facts for the agents' layouts."""
    began = time.monotonic()
    nodes = await asyncio.to_thread(save_on_nodes, work, args.save_ranks, args.width)
    saved = time.monotonic()
    await push_nodes(tier, ep.url, nodes, args.chunk_size_kib << 10)
    if not args.survivors_hold:
        shutil.rmtree(work / "nodes", ignore_errors=True)
    facts = await step_facts(tier, ep.url, layouts_of(args.agents, args.ranks_per_agent))
    pushed = time.monotonic() - saved
    print(
        f"saved {args.save_ranks} ranks (width {args.width}) in {saved - began:.1f} s, pushed "
        f"{len(nodes)} parts in {pushed:.1f} s: {mb(facts.raw)} MB raw, {mb(facts.stored)} MB "
        "stored",
        flush=True,
    )
    return facts


async def run_all(args: argparse.Namespace, ep: S3Endpoint, work: Path) -> dict[str, Any]:
    tier = f"s3://{ep.bucket}/share-fanout-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    facts = await prepare(args, ep, tier, work)
    layouts = layouts_of(args.agents, args.ranks_per_agent)
    proxy = RangeProxy(ep.url, ep.bucket)
    proxy.start()
    rounds = []
    held = [work / "nodes" / f"node{k}" for k in range(args.agents)] if args.survivors_hold else []
    try:
        with endpoint_env(proxy.url):
            for name in args.rounds:
                hot_root = scratch_dir("ferry-share-fanout-")
                try:
                    rounds.append(
                        await run_round(name, hot_root, tier, layouts, proxy, args.timeout, held)
                    )
                finally:
                    shutil.rmtree(hot_root, ignore_errors=True)
                print(f"round {name}: {rounds[-1].seconds:.1f} s", flush=True)
    finally:
        proxy.stop()
    config = {
        k: getattr(args, k)
        for k in (
            "agents", "ranks_per_agent", "save_ranks", "width", "chunk_size_kib", "timeout",
            "survivors_hold",
        )
    }  # fmt: skip
    config["layouts"] = layouts
    return {"config": config, "step": asdict(facts), "rounds": [asdict(r) for r in rounds]}


def run(args: argparse.Namespace, ep: S3Endpoint) -> dict[str, Any]:
    """The whole benchmark against the server at ``ep`` (its credentials in the AWS
    environment); the results document (also written to ``--json``)."""
    work = Path(tempfile.mkdtemp(prefix="ferry-share-fanout-work-"))
    try:
        doc = asyncio.run(run_all(args, ep, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["server"] = ep.kind
    if args.json:
        extra = {"machine": machine_info(), "source": source_info(REPO)}
        Path(args.json).write_text(json.dumps(doc | extra, indent=1) + "\n")
    return doc


# -- tables ----------------------------------------------------------------------------------


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def spread(values: Sequence[float], fmt: Any = mb) -> str:
    """min / median / max."""
    if not values:
        return "-"
    return " / ".join(fmt(v) for v in (min(values), statistics.median(values), max(values)))


def round_table(doc: dict[str, Any]) -> list[str]:
    step = doc["step"]
    lines = [
        "| round | ready | S3 pack MB | / union of shares | / one copy | re-read MB | pack GETs "
        "| control req | manifest GETs | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rounds"]:
        data = r["tally"]["bytes"]["data_down"]
        ready = sum(a["state"] == "ready" for a in r["agents"])
        lines.append(
            f"| {r['name']} | {ready}/{len(r['agents'])} | {mb(data)} "
            f"| {data / step['union']:.2f}x | {data / step['stored']:.2f}x | {mb(r['reread'])} "
            f"| {r['tally']['data'].get('GET', 0):,} | {r['tally']['control_requests']:,} "
            f"| {r['tally']['areas'].get('GET manifests', 0):,} | {r['seconds']:.1f} |"
        )
    return lines


def needs_of(doc: dict[str, Any], name: str, kind: str = "stored") -> list[int]:
    """Each agent's bytes to receive in round ``name`` (``kind``: stored, or its chunks'
    raw bytes): its share's, or the whole step's."""
    step = doc["step"]
    if name == "fan-out whole":
        whole = step["stored"] if kind == "stored" else step["chunk_raw"]
        return [whole] * len(step["share_stored"])
    return list(step["share_stored"] if kind == "stored" else step["share_chunk_raw"])


def agent_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| round | moved MB | from S3 MB | from peers MB | share stored MB | moved / share "
        "| chunks raw MB | share raw MB | on disk MB | prefetch s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rounds"]:
        rows = [a for a in r["agents"] if a["state"] != "error"]
        ok = [a["state"] != "error" for a in r["agents"]]
        need = [n for n, keep in zip(needs_of(doc, r["name"]), ok, strict=True) if keep]
        need_raw = [n for n, keep in zip(needs_of(doc, r["name"], "raw"), ok, strict=True) if keep]
        ratio = [a["moved"] / n for a, n in zip(rows, need, strict=True) if n]
        raw = [a["record_bytes"] for a in rows if a["record_bytes"] is not None]
        cells = [
            spread([a["moved"] for a in rows]),
            spread([a["from_s3"] for a in rows]),
            spread([a["from_peers"] for a in rows]),
            spread(need),
            spread(ratio, lambda v: f"{v:.2f}x"),
            spread(need_raw),
            spread(raw) if raw else f"(whole) {mb(doc['step']['raw'])}",
            spread([a["allocated"] for a in rows]),
            spread([a["seconds"] or 0 for a in rows], lambda v: f"{v:.1f}"),
        ]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


def problems(doc: dict[str, Any]) -> list[str]:
    """Every prefetch that did not end ready and restored, one line each; and, per fan-out
    round, the members no peer sent anything (they read their whole need from S3: a member
    whose health probes of the others time out, as on a loop too busy to answer in 2 s,
    leaves them out of its split while they count it in)."""
    out = []
    expected = "filled_in" if doc["config"].get("survivors_hold") else "restored"
    for r in doc["rounds"]:
        for i, a in enumerate(r["agents"]):
            if a["state"] != "ready" or a.get("satisfied_by") != expected:
                out.append(
                    f"- {r['name']}, agent {i}: {a['state']} "
                    f"({a.get('satisfied_by')}): {a.get('error')}"
                )
        alone = [i for i, a in enumerate(r["agents"]) if a.get("peers") == 0]
        if r["name"] != "alone" and alone and len(r["agents"]) > 1:
            out.append(f"- {r['name']}: {len(alone)} member(s) got nothing from peers: {alone}")
    return out


def report(doc: dict[str, Any]) -> str:
    c, s = doc["config"], doc["step"]
    head = (
        f"{c['agents']} agents, {c['ranks_per_agent']} rank(s) each (world "
        f"{c['agents'] * c['ranks_per_agent']}); saved by {c['save_ranks']} ranks, width "
        f"{c['width']}, {c['chunk_size_kib']} KiB chunks; step {mb(s['raw'])} MB raw, "
        f"{mb(s['stored'])} MB stored; union of the shares {mb(s['union'])} MB stored "
        f"({s['union'] / s['stored']:.2f} of a copy), sum of the shares "
        f"{mb(sum(s['share_stored']))} MB"
    )
    lines = [
        head,
        "",
        *round_table(doc),
        "",
        "Per agent, min / median / max (moved: S3 bytes"
        " stored, peer bytes as sent; chunks raw: the share's distinct chunks):",
        "",
    ]
    lines += agent_table(doc)
    bad = problems(doc)
    return "\n".join([*lines, "", *(["Problems:", *bad] if bad else [])])


# -- the command -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--agents", type=int, default=16, help="agents (default 16)")
    ap.add_argument("--ranks-per-agent", type=int, default=1, help="new ranks per agent")
    ap.add_argument("--save-ranks", type=int, default=16, help="ranks that save (default 16)")
    ap.add_argument("--width", type=int, default=16384, help="drill width (16384: ~100 MB)")
    ap.add_argument("--chunk-size-kib", type=int, default=1024, help="push chunk size")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-prefetch wait, seconds")
    ap.add_argument(
        "--rounds",
        type=round_list,
        default=list(ROUNDS),
        help="comma-separated, of: " + ", ".join(ROUNDS),
    )
    ap.add_argument(
        "--survivors-hold",
        action="store_true",
        help="agent i is node n<i> of the save and holds its part of the step",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    args = ap.parse_args(argv)
    if min(args.agents, args.ranks_per_agent, args.width, args.chunk_size_kib) < 1:
        ap.error("--agents, --ranks-per-agent, --width and --chunk-size-kib must be positive")
    if args.save_ranks < RANKS_PER_NODE or args.save_ranks % RANKS_PER_NODE:
        ap.error(f"--save-ranks must be a multiple of {RANKS_PER_NODE}")
    if args.survivors_hold and args.agents > args.save_ranks // RANKS_PER_NODE:
        ap.error("--survivors-hold: --agents must not exceed the save's nodes (--save-ranks / 2)")
    return args


def round_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ROUNDS for n in names):
        raise argparse.ArgumentTypeError(f"rounds are of {', '.join(ROUNDS)}: {text!r}")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    run_main("bench.share_fanout", argv, parse_args, run, report)


if __name__ == "__main__":
    main()
