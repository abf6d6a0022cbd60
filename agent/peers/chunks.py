"""Peer transfers: serving chunks from this node's hot data, and fetching from other agents.

A prefetch asks peers (other agents, which hold checkpoints in their hot dirs) for each chunk
before the tiers: on a LAN a peer is usually the cheapest source. The receiver verifies the
hash, so a confused or hostile peer costs time, never correctness. An unreachable peer is
skipped for a while instead of being retried per chunk.

Peers speak deltas: a receiver that holds the previous step names the chunk it holds at
the same position (``?base=<id>``); a peer that holds that chunk too sends the new one
encoded against it (XOR, byte planes, zstd: the store's codec, header ``X-Ferry-Encoding``)
instead of raw. On a full fine-tune every chunk changes, so raw chunks from a peer moved
2.3x the bytes of the same prefetch from a tier holding deltas (issue 12).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

from agent.node.hotdir import HotDir
from agent.peers.wire import PeerWire
from agent.rpc.tls import AgentTls
from transfer.codec import KNOWN_ENCODINGS, check_encoding, decode, encode, encode_as, needs_base
from transfer.codec.encodings import RAW
from transfer.codec.transforms import Buffer
from transfer.directio import ThreadBuffers
from transfer.engine.catalog import Catalog
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.resolver import read_file_into, read_file_verified
from transfer.engine.share import copy_holds
from transfer.engine.sources import ChunkSource, Land, LocalBase, Location, Supplied
from transfer.engine.stepparts import Needs, parts_for
from transfer.errors import FerryError
from transfer.format.manifest import Manifest
from transfer.format.stepcommon import COMMON_NODE
from transfer.format.stepfiles import StepFiles
from transfer.store.base import Store


class HotIndex:
    """chunk id -> where this node's hot data holds it, from the committed manifests of the
    checkpoints present locally. A miss rescans the hot dir (cheap) and loads the manifests
    of checkpoints not seen before, and of a step a prefetch has just changed here (other
    nodes' files moved in beside this node's own part, a copy swapped in: forget_step);
    one without a manifest yet (training just wrote it, the push is running) is retried
    after ``min_refresh`` s, not on every miss."""

    def __init__(
        self, hot_dir: HotDir, tiers: list[tuple[str, Store]], min_refresh: float = 2.0
    ) -> None:
        self.hot_dir = hot_dir
        self.tiers = tiers
        self.min_refresh = min_refresh
        self._known: set[tuple[str, int]] = set()
        self._unpublished: dict[tuple[str, int], float] = {}  # -> when we last looked
        self._where: dict[str, Location] = {}
        self._lock = asyncio.Lock()
        self._refreshed_at = -1e9

    async def refresh_if_stale(self) -> None:
        """Rescan unless a rescan ran within ``min_refresh`` s: for lookups that may miss
        often (a delta base this node may not hold) and must not rescan on every miss."""
        if time.monotonic() - self._refreshed_at >= self.min_refresh:
            async with self._lock:
                if time.monotonic() - self._refreshed_at >= self.min_refresh:
                    await self._refresh_locked()

    async def locate(self, cid: str) -> Location | None:
        if cid not in self._where:
            async with self._lock:  # a refresh in flight may be about to add it: wait for it
                if cid not in self._where:
                    await self._refresh_locked()
        return self._where.get(cid)

    def peek(self, cid: str) -> Location | None:
        """Where the chunk is, as far as the index knows now (no rescan)."""
        return self._where.get(cid)

    def forget(self, cid: str) -> None:
        self._where.pop(cid, None)

    def forget_step(self, job: str, step: int) -> None:
        """The step's directory here may hold other files now: the next miss reads the
        parts it holds again (where a chunk was, it still is, or read_verified says not)."""
        self._known.discard((job, step))
        self._unpublished.pop((job, step), None)

    async def _refresh_locked(self) -> None:
        now = self._refreshed_at = time.monotonic()
        # partial copies too: a fan-out member holding a share serves the chunks of its part
        # and its share to the others (read_verified: a chunk in a hole is never served)
        for held in [*self.hot_dir.all_checkpoints(), *self.hot_dir.shares()]:
            key = (held.job, held.step)
            if key in self._known or now - self._unpublished.get(key, -1e9) < self.min_refresh:
                continue
            if not await self._add(held.job, held.step, held.path):
                self._unpublished[key] = now

    async def _add(self, job: str, step: int, path: Path) -> bool:
        """Index what ``path`` holds of (job, step), by the parts of the first tier whose
        parts describe a file here; a colder tier is read only when a warmer one's parts
        describe none (a node's own part not pushed to the first tier yet, or lost there:
        the first tier's parts are then the other nodes'). A colder tier is not read for
        every step, under the lock every miss waits on."""
        found = False
        for _, store in self.tiers:
            try:
                manifests = await _parts_held(Catalog(store), job, step, path)
            except FerryError:
                continue
            found = found or bool(manifests)
            if self._index_files(manifests, path):
                break
        if found:
            self._known.add((job, step))
            self._unpublished.pop((job, step), None)
        return found

    def _index_files(self, manifests: list[Manifest], path: Path) -> bool:
        """Where each chunk of ``manifests``' files present at ``path`` is; whether any is."""
        any_here = False
        for m in manifests:
            for f in m.files:
                if (path / f.path).is_file():
                    any_here = True
                    for offset, c in f.chunk_offsets():
                        self._where.setdefault(c.id, (path / f.path, offset, c.size))
        return any_here


def file_holders(manifests: Iterable[Manifest]) -> dict[str, str]:
    """File path -> the node whose part of the step holds the file (the first by name,
    where several do: the same whichever of the parts a member read): the node that wrote
    it, which still holds it after a scale-down."""
    holders: dict[str, str] = {}
    for m in _nodes_parts(manifests):
        for f in m.files:
            holders[f.path] = min(holders.get(f.path, m.node), m.node)
    return holders


def chunk_owners(manifests: Iterable[Manifest]) -> dict[str, str]:
    """Chunk id -> the node whose part of the step holds it (the first, where several do)."""
    owners: dict[str, str] = {}
    for m in _nodes_parts(manifests):
        for f in m.files:
            for c in f.chunks:
                owners.setdefault(c.id, m.node)
    return owners


def _nodes_parts(manifests: Iterable[Manifest]) -> Iterator[Manifest]:
    """The parts nodes wrote, not the step's common index (items of several nodes' files,
    stored once: no node's, and its name sorts before every node's)."""
    return (m for m in manifests if m.node != COMMON_NODE)


async def _parts_held(catalog: Catalog, job: str, step: int, path: Path) -> list[Manifest]:
    """The parts of (job, step) describing what ``path`` holds: by the step's marker, only
    those (a node's own part of an N-node step: 1 manifest, not N; a survivor's share:
    the parts its rows are in, and the common index for the items every rank reads);
    else every part."""
    files = await catalog.step_files(job, step)
    if files is None:
        return await catalog.manifests(job, step)
    needs = await asyncio.to_thread(_held_needs, files, path)
    return await parts_for(catalog, job, step, files, needs)


def _held_needs(files: StepFiles, path: Path) -> Needs:
    """What the copy at ``path`` holds of each file of the step (share.copy_holds: a share
    copy, the ranges its record names; a whole copy, every file it has)."""
    return copy_holds(path, files.files)


def read_verified(where: Location, cid: str) -> bytearray | None:
    path, offset, size = where
    return read_file_verified(Path(path), offset, size, cid)


def read_at(where: Location) -> bytearray | None:
    """The bytes at ``where``, unverified (a delta's base: the receiver's check covers it)."""
    path, offset, size = where
    data = bytearray(size)
    return data if read_file_into(Path(path), offset, memoryview(data)) else None


#: chunks received from peers at once, per agent (each a thread with its connections and
#: its receive buffer; a prefetch asks ``window`` at a time, queued here). The agent's peak
#: RSS during a peer-served prefetch of the 1.69 GB save: 16 threads 540-630 MB, 8 threads
#: 343-389 MB (glibc keeps each thread's freed 4 MiB chunks in that thread's arena)
PEER_THREADS = 8

#: how long a peer may stay silent (no byte of a reply) before it counts as down and the
#: chunk comes from the tiers: a chunk takes a live peer milliseconds (read, hash, code,
#: send 4 MiB), so ten seconds is generous, where 60 s let a peer that stopped answering
#: without closing its connections (a node partitioned away, or shutting down with
#: requests in flight) stall a prefetch for a minute before the tiers took over
PEER_SILENCE_SECONDS = 10.0


class PeerSource:
    """The chunk source a prefetch uses: asks each live peer in turn. ``token``: the bearer
    token to present (a callable: asked per request, so a rotated token file takes effect);
    ``tls``: how to reach a peer over TLS (verified against tls_ca_file, this agent's
    certificate presented; agent/rpc/tls.py), and that a peer named http:// is reached by
    https:// when this agent serves TLS. A peer keeps the name it was given (in the
    fan-out split, ``bytes_by_peer``, ``peer:<url>`` sources)."""

    def __init__(
        self,
        peers: tuple[str, ...],
        token: str | Callable[[], str],
        *,
        down_seconds: float = 10.0,
        tls: AgentTls | None = None,
        node: str | None = None,
    ) -> None:
        self.peers = [p.rstrip("/") for p in peers]
        #: this agent's node (a fan-out member tells its own part from the others' by it)
        self.node = node
        self.token = token if callable(token) else (lambda: token)
        self.down_seconds = down_seconds
        self._tls = tls or AgentTls()
        self._down_until: dict[str, float] = {}
        #: node name -> peer URL, as each peer's /healthz names its node (owners_first)
        self._peer_of_node: dict[str, str] = {}
        self._node_of_peer: dict[str, str] = {}  # (the other way: a fan-out's members)
        self._session: aiohttp.ClientSession | None = None  # health checks
        self._wire = PeerWire(self.token, tls=self._tls.client_context)
        self._buffers = ThreadBuffers()  # each receiving thread's decode buffer
        self._pool = ThreadPoolExecutor(PEER_THREADS, thread_name_prefix="ferry-peer")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._wire.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def is_down(self, peer: str) -> bool:
        """Failed recently (skipped for ``down_seconds``)."""
        return self._down_until.get(peer, 0.0) > time.monotonic()

    def _live(self) -> list[str]:
        now = time.monotonic()
        return [p for p in self.peers if self._down_until.get(p, 0.0) <= now]

    async def __call__(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None:
        """The chunk's raw bytes (unverified: the caller checks the hash, or ``land``
        does), the bytes moved and ``peer:<url>``, from the first live peer that has it."""
        for peer in self._live():
            got = await self.ask(peer, chunk, base, land=land)
            if got is not None:
                return got
        return None

    async def alive(self, peer: str, within: float = 2.0) -> bool:
        """Whether ``peer``'s agent answers its health check (marked down if not)."""
        if await self._health(peer, within) == 200:
            return True
        self._down_until[peer] = time.monotonic() + self.down_seconds
        return False

    async def _health(self, peer: str, within: float) -> int | None:
        """The status of ``peer``'s /healthz, None if it cannot be reached (then it is
        marked down: a peer partitioned away costs one wait, not one per prefetch); the
        node it names is remembered (owners_first)."""
        try:
            async with self._small("GET", peer, "/healthz", within) as resp:
                if resp.status == 200:
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        doc = await resp.json()
                        if isinstance(doc, dict) and isinstance(node := doc.get("node"), str):
                            self._peer_of_node[node] = peer
                            self._node_of_peer[peer] = node
                return resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            self._down_until[peer] = time.monotonic() + self.down_seconds
            return None

    async def holds(self, peer: str, cid: str, within: float = 2.0) -> bool:
        """Whether ``peer`` holds chunk ``cid`` now (a HEAD: it reads nothing to say so);
        False when it cannot be asked."""
        if self.is_down(peer):
            return False
        auth = {"Authorization": f"Bearer {self.token()}"}
        try:
            async with self._small("HEAD", peer, f"/v1/chunks/{cid}", within, auth) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _small(
        self,
        method: str,
        peer: str,
        path: str,
        within: float,
        headers: Mapping[str, str] | None = None,
    ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """A request with a small reply to ``peer`` (health checks, holds), over TLS as
        this agent reaches its peers, answered within ``within`` s."""
        url = f"{self._tls.origin(peer)}{path}"
        verify = self._tls.client_context() if url.startswith("https://") else True
        timeout = aiohttp.ClientTimeout(total=within)
        return self._client().request(method, url, headers=headers, timeout=timeout, ssl=verify)

    def node_of(self, peer: str) -> str | None:
        """The node ``peer``'s /healthz named when it was last checked (None: not yet,
        or it did not say)."""
        return self._node_of_peer.get(peer)

    async def learn_nodes(self, within: float = 2.0) -> None:
        """Ask each live peer whose node is not known yet which node it is (its /healthz):
        one request per peer, not per chunk. One that answers without saying is asked in
        turn, as before."""
        known = set(self._peer_of_node.values())
        todo = [p for p in self._live() if p not in known]
        if todo:
            await asyncio.gather(*(self._health(p, within) for p in todo))

    async def for_step(self, manifests: Iterable[Manifest]) -> ChunkSource:
        """The chunk source a restore of the step ``manifests`` describe asks (and its
        estimate's probe): owners first (``owners_first``), the peers' nodes learnt."""
        await self.learn_nodes()
        return self.owners_first(chunk_owners(manifests))

    def owners_first(self, owners: Mapping[str, str]) -> ChunkSource:
        """A chunk source asking first the peer whose node's part holds the chunk
        (``owners``: chunk id -> node, from the step's manifests), then the others in turn.
        Asked in turn alone, a chunk held by the k-th of N peers cost k requests: N/2 per
        chunk on average, N x chunks per restore from an N-node job's peers."""

        async def ask(
            chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
        ) -> Supplied | None:
            owner = self._peer_of_node.get(owners.get(chunk.id, ""))
            if owner is not None:
                got = await self.ask(owner, chunk, base, land=land)
                if got is not None:
                    return got
            for peer in self._live():
                if peer != owner and (got := await self.ask(peer, chunk, base, land=land)):
                    return got
            return None

        return ask

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(  # (health checks, holds: small replies)
                timeout=aiohttp.ClientTimeout(total=60, sock_connect=2)
            )
        return self._session

    async def ask(
        self,
        peer: str,
        chunk: StoredChunk,
        base: LocalBase | None,
        *,
        wait: float = 0.0,
        land: Land | None = None,
    ) -> Supplied | None:
        """The chunk from one peer, who may hold the request ``wait`` s for it to land (a
        fan-out restore: agent/peers/fanout.py); None if it has not, or is down (then it is
        skipped for ``down_seconds``). Received and decoded in a worker thread
        (agent/peers/wire.py), and handed to ``land`` there when given."""
        if self.is_down(peer):
            return None
        query = {"base": base.id, "enc": chunk.enc} if base is not None else {}
        if wait:
            query["wait"] = f"{wait:g}"
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._pool,
                self._ask_here,
                peer,
                chunk,
                base,
                query,
                PEER_SILENCE_SECONDS + wait,
                land,
            )
        except (http.client.HTTPException, TimeoutError, OSError):
            self._down_until[peer] = time.monotonic() + self.down_seconds
            return None

    def _ask_here(
        self,
        peer: str,
        chunk: StoredChunk,
        base: LocalBase | None,
        query: dict[str, str],
        timeout: float,
        land: Land | None,
    ) -> Supplied | None:
        got = self._wire.get_chunk(self._tls.origin(peer), chunk.id, query, chunk.size, timeout)
        if got is None:
            return None
        enc, body = got
        out = self._buffers.view("out", chunk.size) if land is not None else None
        data = _decoded(enc, body, chunk.size, base, out)
        if data is None:
            return None
        if land is None:
            return data, len(body), f"peer:{peer}"
        return (None, len(body), f"peer:{peer}") if land(chunk, data) else None


def _decoded(
    enc: str, body: memoryview, size: int, base: LocalBase | None, out: memoryview | None
) -> Buffer | None:
    """(In a worker thread.) The chunk from a peer's reply (``body``: a reused buffer):
    decoded into ``out`` (reused too), or without it into memory of its own; the local
    base is read only for a delta."""
    if enc == RAW:
        return body if out is not None else bytes(body)
    try:
        check_encoding(enc)
        if not needs_base(enc):
            return decode(enc, body, size, None, out)
        data = base.read() if base is not None else None
        if data is None:
            return None  # no base here after all (or a peer that ignored ours)
        return decode(enc, body, size, data, out)
    except FerryError:
        return None  # a confused peer: the caller falls back to the tiers


async def encode_for_peer(
    index: HotIndex,
    cid: str,
    base_id: str | None,
    zstd_level: int | None,
    enc: str | None = None,
    where: Location | None = None,
) -> tuple[str, bytes | bytearray] | None:
    """A chunk this node holds, as (encoding, payload) for a peer: against ``base_id`` when
    this node holds that chunk too, else raw. ``enc``: the encoding the store chose for it
    (the receiver knows it from the manifest), used as is instead of trying every
    candidate on samples. ``where``: where it is, if the caller knows (a restore running
    here landed it), else the hot index is asked. None: not held (or no longer intact).
    The reads, the hash check and the encoding run in one worker thread."""
    where = where or await index.locate(cid)
    if where is None:
        return None
    coding = enc if enc in KNOWN_ENCODINGS else None
    there: Location | None = None
    whole = coding is not None and not needs_base(coding)  # no base needed
    if base_id is not None and zstd_level is not None and not whole:
        # peek first: the chunk's own locate refreshed the index on a miss. A chunk that a
        # restore here just landed (fan-out) skipped that locate, so the base may be in the
        # hot dir unindexed: rescan then, but at most every few seconds, never every time
        there = index.peek(base_id)
        if there is None:
            await index.refresh_if_stale()
            there = index.peek(base_id)
    got = await asyncio.to_thread(_encoded, where, cid, base_id, there, zstd_level, coding)
    if got is None:
        index.forget(cid)
    return got


def _encoded(
    where: Location,
    cid: str,
    base_id: str | None,
    there: Location | None,
    zstd_level: int | None,
    coding: str | None,
) -> tuple[str, bytes | bytearray] | None:
    """(In a worker thread.) encode_for_peer's reading and coding; ``coding``: the store's
    encoding of the chunk when this codec knows it."""
    data = read_verified(where, cid)
    if data is None:
        return None
    if base_id is None or zstd_level is None:
        return RAW, data
    if coding is not None and not needs_base(coding):
        # the store keeps it whole (its delta saved too little: keyframes.py), so it goes
        # whole here too, in the same coding, without trying every candidate on samples:
        # that search made a peer's prefetch 2.2-3.0x the tier's (bench.peer_deltas)
        payload = encode_as(coding, data, zstd_level)
    else:
        base = read_at(there) if there else None
        if base is None:
            return RAW, data
        if coding is None:
            return encode(data, zstd_level, base)
        payload = encode_as(coding, data, zstd_level, base)
    return (coding, payload) if len(payload) < len(data) else (RAW, data)
