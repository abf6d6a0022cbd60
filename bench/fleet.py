"""The control plane at fleet shape: store requests and bytes per operation against N nodes.

    python -m bench.fleet                              # N = 8, 32, 128, 512; S = 3
    python -m bench.fleet --nodes 8,16,32 --steps 3 --json /tmp/fleet.json
    python -m bench.fleet --quick                      # N = 4, 8; S = 2 (a smoke test)

A job on N nodes saves a checkpoint every few minutes and each node pushes its own part
(``manifests/<job>/<step>/<node>.json``, docs/FORMAT.md). For each N this fills a fresh
prefix of a real S3 server (SeaweedFS on loopback, ``tests/s3server.py``) with S steps of
all N nodes, each part one small ``__<rank>_0.distcp`` (8-12 KB of random bytes in 4 KiB
chunks, a few bytes changed per step; node 0's also the step's
``.metadata``, ``tests/fake_dcp.py``: the rank's row of a tensor saved ``Shard(0)``, then 64
bytes every rank reads, as DCP spreads a save's replicated items over every rank's file)
and each step's completion marker, then measures,
through a counting proxy in front of the server (``CountingProxy``: ``tests/faultproxy.py``
with no faults, tallying each request by method and key), in this order:

- ``pull step``: ``transfer.engine.pull`` of step S (all N parts merged) into an empty dir;
- ``pull latest``: the same with ``step=None``;
- ``pull node``: node n0005's part of step S alone (``node=``);
- ``share, every part``: the share a survivor's rank reads after the job shrinks to N/2
  ranks (the files of two old ranks), read as every reader of a share did before the
  completion marker's file map: every part's manifest, then the share's bytes;
- ``share, by the map, no index``: the same share prefetched by a survivor's agent onto a
  node that holds nothing of the step (``agent/node/prefetch.py``), the parts it touches
  found by the step's file map (docs/FORMAT.md, "The marker's file map") but not its common
  index: as with markers written before it, every part (each holds an item it reads);
- ``share, by the map``: the same with the marker's common index (docs/FORMAT.md, "The
  marker's common index"): the parts its rows are in, the rest from the marker;
- ``share, fan-out member``: the share of the same survivor's rank by its layout (the job
  shrunk to N/2 ranks: ``.metadata`` here holds one tensor saved ``Shard(0)``, a row per
  old rank's file, so the new rank reads the files of two old ranks), prefetched as one
  member of the survivors' fan-out group, every member's layout named: what one member
  asks of the store (the others do not run here; their address refuses connections);
- ``load, coordinator``: what the coordinator rank of a ``dcp.load`` through FerryReader
  asks of the store: the step's parts resolved once, every node's rank planned from them
  (``transfer.engine.memrestore.plan_ranges``: here each rank reads one node's file), then
  its own share (n0005's file) restored into memory;
- ``load, another rank``: what each other rank asks: its share restored from the plan the
  coordinator sent it (no manifest, no listing);
- ``push``: n0005's part of a new step S+1 (its previous save beside it on disk, as on a
  node that wrote it: the delta base is read locally);
- ``retention``: what ``ferry retention URL --keep-last 1 --grace 0 --expected-nodes ...``
  runs (``make_plan`` + ``apply_plan``, repacking as the CLI's default): it expires steps
  1..S-1 (S is the newest complete step, S+1 is in progress) and collects their packs;
- ``gc``: one more mark-and-sweep on its own (``take_inventory`` + ``collect_garbage`` under
  ``gc_lease``, grace 0).

Every operation opens its store afresh, as one CLI command does. Requests whose key is under
``packs/`` are data; everything else is control (manifests, the store descriptor, leases,
markers, pins, GC state). Listings count as control whatever their prefix, a listing of
``packs/`` included: LIST is a GET with ``list-type`` (ListObjectsV2) or ``uploads``
(ListMultipartUploads) in its query. Bytes are HTTP bodies (up: requests, down: replies).

Population does not go through the proxy. ``--populate staged`` (the default) pushes each
node's S steps with the engine into a local store of its own on /dev/shm and then copies
every object into the S3 prefix; ``--populate direct`` pushes all N nodes into the S3
prefix itself, step by step, 16 at a time, which is what a fleet does but costs O(N^2)
requests per step (every push reads every manifest of the job's newest steps and every
other part of its own step, one GET at a time): 3 / 9 / 27 / 126 s at N = 8 / 32 / 64 / 128
here (staged: 1 / 2 / 5 s, and 20 s at N = 512). The stored objects are the same either way
(parts of different nodes share no chunks): every operation measured the same requests
after either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy, State
from agent.peers.chunks import PeerSource
from bench._env import machine_info, source_info
from bench._loopback import run_main
from tests.fake_dcp import dcp_metadata
from tests.faultproxy import FaultProxy
from tests.harness import reserve_port
from tests.s3server import S3Endpoint
from transfer.engine import PullPlan, PushPlan, pull, push
from transfer.engine.catalog import Catalog, open_catalog, resolve_manifests
from transfer.engine.memrestore import RangePlan, StepChunks, plan_ranges, restore_plan
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.engine.share import plan_share
from transfer.format.layout import completion_key
from transfer.options import TransferOptions
from transfer.retention import (
    Tier,
    TierPolicy,
    apply_plan,
    collect_garbage,
    gc_lease,
    make_plan,
    take_inventory,
)
from transfer.retention.repack import RepackPolicy
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store

JOB = "fleet"
STEP_EVERY = 100
OPS = (
    "push", "pull step", "pull latest", "pull node", "share, every part",
    "share, by the map, no index", "share, by the map", "share, fan-out member",
    "load, coordinator", "load, another rank", "retention", "gc",
)  # fmt: skip
METHODS = ("LIST", "GET", "PUT", "HEAD", "DELETE", "POST")
DEFAULT_NODES = (8, 32, 128, 512)
QUICK_NODES = (4, 8)
BYTE_KEYS = ("control_down", "control_up", "data_down", "data_up")
CONCURRENCY = 16  # pushes (population) and object copies in flight
REPO = Path(__file__).resolve().parent.parent


# -- counting --------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one operation sent through the proxy."""

    control: Counter[str] = field(default_factory=Counter)  # method label -> requests
    data: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)  # control_up, control_down, data_...
    areas: Counter[str] = field(default_factory=Counter)  # "GET manifests" -> requests
    area_bytes: Counter[str] = field(default_factory=Counter)  # ... -> body bytes, both ways

    def add(self, label: str, key: str, up: int, down: int) -> None:
        kind = "data" if label != "LIST" and key.startswith("packs/") else "control"
        (self.data if kind == "data" else self.control)[label] += 1
        self.bytes[f"{kind}_up"] += up
        self.bytes[f"{kind}_down"] += down
        area = f"{label} {key.split('/', 1)[0] or '(root)'}"
        self.areas[area] += 1
        self.area_bytes[area] += up + down

    def to_dict(self) -> dict[str, Any]:
        return {
            "control_requests": sum(self.control.values()),
            "data_requests": sum(self.data.values()),
            "control": dict(self.control),
            "data": dict(self.data),
            "bytes": {k: self.bytes[k] for k in BYTE_KEYS},
            "areas": dict(self.areas.most_common()),
            "area_bytes": dict(self.area_bytes),
        }


def classify(
    method: str, path: str, query: Mapping[str, str], bucket: str, prefix: str
) -> tuple[str, str]:
    """(method label, store-relative key) of one S3 request (path-style addressing); the key
    of a listing is its ``prefix`` parameter."""
    if method == "GET" and ("list-type" in query or "uploads" in query):
        label, key = "LIST", query.get("prefix", "")
    else:
        label, key = method, path.lstrip("/").removeprefix(bucket).lstrip("/")
    if prefix:
        key = "" if key.rstrip("/") == prefix else key.removeprefix(prefix + "/")
    return label, key


class CountingProxy(FaultProxy):
    """The tests' forwarding proxy (no faults) that also tallies every request into the
    current ``Tally`` by method and key, with its body bytes each way."""

    def __init__(self, upstream: str, bucket: str) -> None:
        super().__init__(upstream)
        self.bucket = bucket
        self.prefix = ""
        self.tally: Tally | None = None

    def begin(self, prefix: str) -> Tally:
        """Count from now on into a fresh Tally; keys are taken relative to ``prefix``."""
        self.prefix = prefix
        self.tally = Tally()
        return self.tally

    def end(self) -> None:
        self.tally = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        up = len(await request.read())  # (cached: the forwarding reads it again)
        reply = await super()._handle(request)
        tally = self.tally
        if tally is not None:
            body = reply.body if isinstance(reply, web.Response) else None
            down = len(body) if isinstance(body, (bytes, bytearray)) else 0
            label, key = classify(
                request.method, request.path, request.query, self.bucket, self.prefix
            )
            tally.add(label, key, up, down)
        return reply


# -- the fleet's checkpoints -----------------------------------------------------------------


def node_name(rank: int) -> str:
    return f"n{rank:04d}"


def step_of(k: int) -> int:
    """The step number of the k-th save (k from 0)."""
    return (k + 1) * STEP_EVERY


#: the bytes at the end of every rank's file that every rank reads (DCP spreads a save's
#: replicated items, step counters and param_groups, over every rank's file)
REPLICATED = 64


def measured_rank(n: int) -> int:
    return min(5, n - 1)


def part_bytes(rank: int, step: int) -> bytes:
    """One node's shard at ``step``: its rank's random bytes with a few of them changed
    (8-12 KB: its row in 2-3 chunks of CHUNK_BYTES, the item every rank reads in the last)."""
    size = 8192 + (rank * 733) % 3585
    data = bytearray(random.Random(rank).randbytes(size))
    rng = random.Random(rank * 1_000_003 + step)
    for _ in range(8):
        data[rng.randrange(size)] ^= 1 + rng.randrange(255)
    return bytes(data)


def part_dir(root: Path, rank: int, step: int) -> Path:
    return root / node_name(rank) / f"step_{step:06d}"


def write_parts(root: Path, n: int, saves: int) -> None:
    """Every node's saves 0..saves-1 on disk (plus the measured node's next one); node 0's
    part also holds the step's ``.metadata`` (naming every node's file: its row of ``w``,
    then REPLICATED bytes every rank reads)."""
    lengths = {f"__{rank}_0.distcp": len(part_bytes(rank, 0)) for rank in range(n)}
    metadata = dcp_metadata(lengths, sharded=True, replicated=REPLICATED)
    for rank in range(n):
        for k in range(saves + (rank == measured_rank(n))):
            d = part_dir(root, rank, step_of(k))
            d.mkdir(parents=True, exist_ok=True)
            (d / f"__{rank}_0.distcp").write_bytes(part_bytes(rank, step_of(k)))
            if rank == 0:
                (d / ".metadata").write_bytes(metadata)


def share_items(n: int) -> list[dict[str, Any]]:
    """The share a survivor's rank reads after the job shrinks to n/2 ranks (one per
    node): the files of old ranks 2m and 2m+1, m the measured node's new rank, and the
    replicated item at the end of every other rank's file (as the item list DCP's planner
    gives: dcpplan_torch)."""
    first = 2 * (measured_rank(n) // 2)
    ranks = sorted({first, min(first + 1, n - 1)})
    items = []
    for r in range(n):
        size = len(part_bytes(r, 0))
        offset = 0 if r in ranks else size - REPLICATED
        items.append({"path": f"__{r}_0.distcp", "offset": offset, "length": size - offset})
    return items


async def mark_complete(store: Store, saves: int) -> None:
    """Each step's completion marker."""
    for k in range(saves):
        await mark_step_complete(store, JOB, step_of(k))


async def mark_step_complete(store: Store, job: str, step: int) -> None:
    """The step's completion marker, as the agent of the node that completes it writes it
    (with its file map: docs/FORMAT.md)."""
    doc = completion_doc(job, step, await check_step_whole(Catalog(store), job, step))
    await store.put(completion_key(job, step), json.dumps(doc).encode())


#: the parts' chunks: a few per part, as a real rank file is many
CHUNK_BYTES = 4096


def push_options() -> TransferOptions:
    """Population: one hash/codec thread per push (many run at once)."""
    return TransferOptions(workers=1, chunk_size=CHUNK_BYTES)


async def bounded(jobs: Iterable[Awaitable[None]], limit: int = CONCURRENCY) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(job: Awaitable[None]) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(j) for j in jobs))


async def push_part(store: Store, root: Path, rank: int, step: int) -> None:
    d = part_dir(root, rank, step)
    plan = PushPlan(part=True)  # one node's part of the step, as its agent pushes it
    await push(
        store, d, job=JOB, step=step, node=node_name(rank), options=push_options(), plan=plan
    )


async def populate_direct(store: Store, root: Path, n: int, saves: int) -> None:
    """Every node pushes into the shared store, a step at a time (as a fleet does)."""
    for k in range(saves):
        await bounded(push_part(store, root, rank, step_of(k)) for rank in range(n))


async def populate_staged(store: Store, root: Path, n: int, saves: int, stage: Path) -> None:
    """Each node pushes its saves into a local store of its own; then every object of those
    stores is copied into ``store``."""

    async def one_node(rank: int) -> None:
        local_dir = stage / node_name(rank)
        local_dir.mkdir(parents=True)
        local = open_store(str(local_dir))
        try:
            for k in range(saves):
                await push_part(local, root, rank, step_of(k))
        finally:
            await local.close()

    await bounded(one_node(rank) for rank in range(n))
    await open_catalog(store, create=True)
    await bounded(copy_objects(stage / node_name(rank), store) for rank in range(n))


async def copy_objects(local_dir: Path, dest: Store) -> None:
    """Every object of the local store at ``local_dir`` but its descriptor, into ``dest``."""
    local = open_store(str(local_dir))
    try:
        for obj in await local.list(""):
            if obj.key != "ferry-store.json":
                await dest.put(obj.key, await local.get(obj.key))
    finally:
        await local.close()


# -- the measured operations -----------------------------------------------------------------


@dataclass
class Fleet:
    """One N's store and checkpoints."""

    n: int
    saves: int
    url: str
    prefix: str
    root: Path  # node dirs
    work: Path  # pull destinations
    planned: RangePlan | None = None  # the coordinator's plan for another rank

    @property
    def nodes(self) -> list[str]:
        return [node_name(r) for r in range(self.n)]

    @property
    def last(self) -> int:
        return step_of(self.saves - 1)

    @property
    def me(self) -> str:
        return node_name(measured_rank(self.n))


Op = Callable[[Store, Fleet], Awaitable[None]]


async def op_pull(store: Store, fleet: Fleet, step: int | None, node: str | None) -> None:
    dest = fleet.work / f"pull-{secrets.token_hex(4)}"
    try:
        result = await pull(store, dest, PullPlan(JOB, step, node))
        if result.files != (1 if node else fleet.n + 1):  # (+ .metadata)
            raise SystemExit(f"pull of step {step} node {node} restored {result.files} files")
    finally:
        shutil.rmtree(dest, ignore_errors=True)


async def op_share_every_part(store: Store, fleet: Fleet) -> None:
    """A survivor's share of step S as every reader of a share read it before the marker's
    file map (and still does without one): every part, then the share's bytes."""
    manifests = await resolve_manifests(store, JOB, fleet.last)
    share = await plan_share(Catalog(store), manifests, items=share_items(fleet.n))
    dest = fleet.work / f"share-{secrets.token_hex(4)}"
    try:
        await pull(store, dest, PullPlan(JOB, fleet.last, manifests=manifests, share=share))
    finally:
        shutil.rmtree(dest, ignore_errors=True)


async def op_share_by_map(store: Store, fleet: Fleet, use_index: bool = True) -> None:
    """The same share prefetched by a survivor's agent onto a node holding nothing of the
    step (agent/node/prefetch.py): the parts it touches, by the step's file map, and the
    marker's common index for the replicated items (``use_index=False``: as with a marker
    written before the index: every part holds an item the share reads)."""
    hot = HotDir(fleet.work / f"hot-{secrets.token_hex(4)}", ".metadata")
    policy = PrefetchPolicy(expected_nodes=tuple(fleet.nodes))
    prefetcher = Prefetcher(hot, [("s3", store)], push_options(), BandwidthMeter(), policy)
    try:
        record = prefetcher.submit(JOB, fleet.last, None, items=share_items(fleet.n))
        record.use_index = use_index  # (before its task first runs)
        assert record.task is not None
        await record.task
        if record.state is not State.READY:
            raise SystemExit(f"share prefetch: {record.state} {record.error}")
    finally:
        shutil.rmtree(hot.root, ignore_errors=True)


async def op_share_fanout_member(store: Store, fleet: Fleet) -> None:
    """The share of the same survivor's rank in the job shrunk to N/2 ranks (by its layout:
    the rows of old ranks 2m and 2m+1, their files), prefetched as one member of the
    survivors' fan-out group (N/2 members, every member's layout named, as a scheduler
    sends them): what one member asks of the store. The other members are not running here
    (their address refuses connections), so this one fetches its whole share itself."""
    world = max(1, fleet.n // 2)
    mine = measured_rank(fleet.n) // 2
    refused = reserve_port()  # (bound, never listening: a connection is refused at once)
    members = tuple(f"http://127.0.0.1:{refused}/member-{i}" for i in range(world))
    layouts = {url: {"world_size": world, "ranks": [i]} for i, url in enumerate(members)}
    hot = HotDir(fleet.work / f"hot-{secrets.token_hex(4)}", ".metadata")
    policy = PrefetchPolicy(expected_nodes=tuple(fleet.nodes))
    peers = PeerSource((), "bench-token")
    links = PrefetchLinks(fanout_client=peers)
    prefetcher = Prefetcher(hot, [("s3", store)], push_options(), BandwidthMeter(), policy, links)
    try:
        record = prefetcher.submit(
            JOB, fleet.last, None, fanout=(members, members[mine]), layout=layouts[members[mine]],
            fanout_layouts=layouts,
        )  # fmt: skip
        assert record.task is not None
        await record.task
        if record.state is not State.READY:
            raise SystemExit(f"fan-out share prefetch: {record.state} {record.error}")
    finally:
        await peers.close()
        shutil.rmtree(hot.root, ignore_errors=True)


async def op_load_coordinator(store: Store, fleet: Fleet) -> None:
    """The coordinator of a FerryReader load (transfer/engine/dcpreader_torch.py),
    ``.metadata`` aside: the step resolved once, every rank's share planned, its own read."""
    step = StepChunks(await resolve_manifests(store, JOB, fleet.last))
    plans = {
        rank: plan_ranges(step, {path: [(0, step.files[path].size)]})
        for rank in range(fleet.n)
        for path in [f"__{rank}_0.distcp"]
    }
    mine = measured_rank(fleet.n)
    await restore_into_memory(store, plans[mine])
    fleet.planned = plans[(mine + 1) % fleet.n]  # for "load, another rank"


async def op_load_another_rank(store: Store, fleet: Fleet) -> None:
    """Another rank of the same load: its share, from the plan the coordinator sent it."""
    if fleet.planned is None:
        raise SystemExit("load, another rank: the coordinator's operation did not run first")
    await restore_into_memory(store, fleet.planned)


async def restore_into_memory(store: Store, plan: RangePlan) -> None:
    got = await restore_plan(store, plan, lambda *_: None)
    want = sum(hi - lo for spans in plan.wanted.values() for lo, hi in spans)
    if got.bytes_raw != want:
        raise SystemExit(f"a load restored {got.bytes_raw} of {want} bytes")


async def op_push(store: Store, fleet: Fleet) -> None:
    """One node's part of the next step, pushed as the agent of a multi-node job pushes it
    (``part=True``: the step is judged whole once, by the node that finds its last part in,
    so a part reads no other node's part and lists nothing of the step)."""
    rank = measured_rank(fleet.n)
    step = step_of(fleet.saves)
    d = part_dir(fleet.root, rank, step)
    await push(store, d, job=JOB, step=step, node=fleet.me, plan=PushPlan(part=True))


async def op_retention(store: Store, fleet: Fleet) -> None:
    """``ferry retention URL --keep-last 1 --grace 0 --expected-nodes <all N>``."""
    tiers = [Tier(store, TierPolicy(keep_last=1))]
    if not await open_catalog(store, create=False):
        raise SystemExit(f"{store.url} is not a store")
    plan = await make_plan(
        tiers, now=time.time(), expected_nodes=fleet.nodes, repacking=RepackPolicy(0.2)
    )
    await apply_plan(plan, tiers, grace_s=0.0, holder="bench-fleet", expected_nodes=fleet.nodes)
    errors = [e for t in plan.tiers for e in t.errors]
    if errors:
        raise SystemExit(f"retention failed: {errors}")


async def op_gc(store: Store, fleet: Fleet) -> None:
    now = time.time()
    async with gc_lease(store, "bench-fleet", now=now):
        inventory = await take_inventory(store, now=now, expected_nodes=fleet.nodes)
        await collect_garbage(
            store, inventory, grace_s=0.0, now=now, expected_nodes=tuple(fleet.nodes)
        )


def operations(fleet: Fleet) -> list[tuple[str, Op]]:
    """In the order they run: the pulls before the push (a pull of "latest" would otherwise
    take step S+1, which then has only the measured node's part)."""
    return [
        ("pull step", lambda s, f: op_pull(s, f, f.last, None)),
        ("pull latest", lambda s, f: op_pull(s, f, None, None)),
        ("pull node", lambda s, f: op_pull(s, f, f.last, f.me)),
        ("share, every part", op_share_every_part),
        ("share, by the map, no index", lambda s, f: op_share_by_map(s, f, use_index=False)),
        ("share, by the map", op_share_by_map),
        ("share, fan-out member", op_share_fanout_member),
        ("load, coordinator", op_load_coordinator),
        ("load, another rank", op_load_another_rank),
        ("push", op_push),
        ("retention", op_retention),
        ("gc", op_gc),
    ]


async def measure(fleet: Fleet, proxy: CountingProxy) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, op in operations(fleet):
        store = open_store(fleet.url, StoreOptions(endpoint_url=proxy.url))
        tally = proxy.begin(fleet.prefix)
        began = time.monotonic()
        try:
            await op(store, fleet)
        finally:
            proxy.end()
            await store.close()
        out[name] = tally.to_dict() | {"seconds": round(time.monotonic() - began, 3)}
    return out


# -- one N, all Ns ---------------------------------------------------------------------------


async def run_fleet(
    n: int, saves: int, ep: S3Endpoint, proxy: CountingProxy, work: Path, populate: str
) -> dict[str, Any]:
    prefix = f"fleet-{secrets.token_hex(3)}-n{n}"
    fleet = Fleet(n, saves, f"s3://{ep.bucket}/{prefix}", prefix, work / "nodes", work)
    await asyncio.to_thread(write_parts, fleet.root, n, saves)
    store = open_store(fleet.url, StoreOptions(endpoint_url=ep.url))  # not through the proxy
    began = time.monotonic()
    try:
        if populate == "direct":
            await populate_direct(store, fleet.root, n, saves)
        else:
            stage = stage_dir(work)
            try:
                await populate_staged(store, fleet.root, n, saves, stage)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        await mark_complete(store, saves)
        populate_s = time.monotonic() - began
        objects = len(await store.list(""))
    finally:
        await store.close()
    print(f"N={n}: populated {saves} steps, {objects} objects, in {populate_s:.1f} s ({populate})",
          flush=True)  # fmt: skip
    ops = await measure(fleet, proxy)
    return {"nodes": n, "populate_seconds": round(populate_s, 2), "objects": objects, "ops": ops}


def stage_dir(work: Path) -> Path:
    """Where the staged population's local stores go: tmpfs when there is one (the stores
    fsync every object)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else work
    return Path(tempfile.mkdtemp(prefix="ferry-fleet-", dir=base))


def run(args: argparse.Namespace, ep: S3Endpoint) -> dict[str, Any]:
    """Every N against the server at ``ep`` (its credentials in the AWS environment); the
    results document (also written to ``--json``)."""
    nodes, saves = nodes_and_steps(args)
    runs = []
    proxy = CountingProxy(ep.url, ep.bucket)
    proxy.start()
    try:
        for n in nodes:
            work = Path(tempfile.mkdtemp(prefix=f"ferry-fleet-n{n}-"))
            try:
                runs.append(asyncio.run(run_fleet(n, saves, ep, proxy, work, args.populate)))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        proxy.stop()
    doc = {"steps": saves, "populate": args.populate, "server": ep.kind, "runs": runs}
    if args.json:
        extra = {"machine": machine_info(), "source": source_info(REPO)}
        Path(args.json).write_text(json.dumps(doc | extra, indent=1) + "\n")
    return doc


def nodes_and_steps(args: argparse.Namespace) -> tuple[list[int], int]:
    if args.quick:
        return list(QUICK_NODES), 2
    return list(args.nodes), args.steps


# -- tables ----------------------------------------------------------------------------------

COLUMNS: list[tuple[str, Callable[[dict[str, Any]], int]]] = [
    ("control req", lambda o: o["control_requests"]),
    ("data req", lambda o: o["data_requests"]),
    *((m, lambda o, m=m: o["control"].get(m, 0)) for m in METHODS),
    ("ctl KB down", lambda o: o["bytes"]["control_down"]),
    ("ctl KB up", lambda o: o["bytes"]["control_up"]),
    ("data KB down", lambda o: o["bytes"]["data_down"]),
    ("data KB up", lambda o: o["bytes"]["data_up"]),
]


def cell(name: str, value: int, ref: int) -> str:
    text = f"{value / 1000:,.1f}" if "KB" in name else f"{value:,}"
    if ref:
        return f"{text} ({value / ref:.1f}x)"
    return text if not value else f"{text} (-)"


def op_table(doc: dict[str, Any], op: str) -> list[str]:
    """One markdown table: a row per N, each cell with its ratio to the N=8 row (or the
    smallest N's)."""
    runs = doc["runs"]
    ref = next((r for r in runs if r["nodes"] == 8), runs[0])
    lines = [
        f"**{op}** (method columns: control requests; ratio to N={ref['nodes']})",
        "",
        "| N | " + " | ".join(name for name, _ in COLUMNS) + " | wall s |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for r in runs:
        o, base = r["ops"][op], ref["ops"][op]
        cells = [cell(name, get(o), get(base)) for name, get in COLUMNS]
        lines.append(f"| {r['nodes']} | " + " | ".join(cells) + f" | {o['seconds']:.2f} |")
    last = runs[-1]["ops"][op]
    areas = ", ".join(
        f"{k} {v:,} ({last['area_bytes'][k] / 1000:,.1f} KB)" for k, v in last["areas"].items()
    )
    lines += ["", f"N={runs[-1]['nodes']}, requests (body KB) by method and area: {areas}", ""]
    return lines


def report(doc: dict[str, Any]) -> str:
    head = [f"Steps held: {doc['steps']}; populated {doc['populate']}; server {doc['server']}."]
    head += [
        f"N={r['nodes']}: population {r['populate_seconds']:.1f} s, {r['objects']:,} objects"
        for r in doc["runs"]
    ]
    lines = [*head, ""]
    for op in OPS:
        lines += op_table(doc, op)
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nodes", type=node_list, default=list(DEFAULT_NODES),
                    help="node counts, comma-separated (default 8,32,128,512)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="steps the store holds (default 3)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ap.add_argument("--quick", action="store_true", help="N = 4, 8 and 2 steps: a smoke test")
    ap.add_argument("--populate", choices=("staged", "direct"), default="staged",
                    help="staged: per-node local stores, copied in; direct: S3")  # fmt: skip
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (retention keeps the newest of them)")
    return args


def node_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"node counts must be positive: {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    run_main("bench.fleet", argv, parse_args, run, report)


if __name__ == "__main__":
    main()
