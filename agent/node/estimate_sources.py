"""What a prefetch of a checkpoint to this node would cost (GET /v1/estimate): which step
it would restore, from where (a peer, else the first tier that holds it; nothing if the
step is here), how many bytes would move and at what rate (measured, else probed now),
fed to agent/node/estimate.py's arithmetic."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.daemon.config import AgentConfig
from agent.node.estimate import PEER_DELTAS, BandwidthMeter, estimate_migration, peer_key
from agent.node.hotdir import LocalCheckpoint
from agent.node.prefetch import Prefetcher
from agent.peers import probe
from agent.rpc.middleware import MAX_LAYOUT_RANKS
from transfer.engine.catalog import Catalog, resolve_checkpoint
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.dcpshare import Layout, parse_ranks
from transfer.engine.pull import local_bases, share_chunk_ids
from transfer.engine.pullplan import merged_files
from transfer.engine.share import (
    Share,
    base_parts,
    covers,
    held_chunks,
    read_record,
    resolve_share,
)
from transfer.errors import CheckpointNotFoundError, FerryError, StoreError
from transfer.format.manifest import FileEntry, Manifest
from transfer.store.base import Store

#: what a Sourcing's source is when the step (or the share asked) is here already
HELD = frozenset({"local", "replica", "verified"})
#: held steps a prefetch finds ready by a stat of their files, not a re-hash
#: (prefetch.py intact_restore): a standby's replica, or a step this agent restored itself
STAT_CHECKED = frozenset({"replica", "verified"})


@dataclass(frozen=True)
class Sourcing:
    source: str  # "peer:<url>" or "tier:<name>"
    moving: dict[str, int]  # meter source -> bytes
    bases: int  # of those, delta bases a node without them fetches too
    rate_basis: str  # "measured" (by transfers or an earlier probe), "probe" (now), "default"


@dataclass(frozen=True)
class PrefetchEstimator:
    """Estimates for this node, over its tiers in order (as a prefetch would use them)."""

    config: AgentConfig
    tiers: list[tuple[str, Store]]
    meter: BandwidthMeter
    prefetcher: Prefetcher

    async def estimate(
        self,
        job: str,
        step: int | None,
        *,
        gpus: int,
        gpu_hour_price: float,
        layout: str | None = None,
    ) -> dict[str, Any]:
        """The estimate document for (job, step; None: the step a prefetch would pick), from
        the first tier that holds it; with ``layout`` ("W:A,B" or "W:A-B": ranks of a world
        of W), of a prefetch of the share those ranks read (its bytes and its chunks only).
        CheckpointNotFoundError when no tier holds it; StoreError when none that could be
        read did."""
        unreachable: list[str] = []
        lacking: list[str] = []
        ranks = None if layout is None else _layout(layout)  # checked once, not per tier
        # the start-up write probe first (running, it only waits for it): at an agent's
        # first contact the two probes ran at once and each slowed the other (the corpus's
        # first estimate holding k was +68% and +74% in two runs of three, the disk probe's
        # median round 700-880 MB/s where it was 3,000 in the third)
        await self.prefetcher.measure_disk()
        for name, store in self.tiers:
            try:
                expected = self.config.expected_nodes
                began = time.monotonic()
                if ranks is None:
                    manifests, share = await resolve_checkpoint(store, job, step, expected), None
                else:  # only the parts the share touches, as its prefetch reads them
                    ask = (ranks, None)
                    manifests, share = await resolve_share(store, job, step, expected, ask)
                resolved_in = time.monotonic() - began
                total = share.nbytes if share else sum(f.size for m in manifests for f in m.files)
                sourcing = await self._sourcing(name, store, job, manifests, total, share)
            except CheckpointNotFoundError as exc:  # (each tier's why: it may hold part of it)
                lacking.append(f"{name}: {' '.join(str(exc).split())}")
                continue
            except StoreError as exc:  # the next tier may answer (as a prefetch would use it)
                unreachable.append(f"{name}: {' '.join(str(exc).split())}")
                continue
            # a restore writes the whole step (or share), reused chunks too; a held one none
            written = 0 if sourcing.source in HELD else total
            kind = "check" if sourcing.source in HELD else "restore"
            # a whole step this agent restored, asked by number, is ready without a request
            # to any tier (prefetch.py _intact_here): the estimate's own resolution is not
            # repeated (a corpus replica's prefetch took 0.005 s where it took 0.06 s)
            by_stat = sourcing.source in STAT_CHECKED
            asks_store = not (by_stat and share is None and step is not None)
            start = self.meter.start_seconds(kind, resolved_in if asks_store else 0.0)
            est = estimate_migration(
                sourcing.moving,
                self.meter,
                bytes_total=total,
                gpus=gpus,
                gpu_hour_price=gpu_hour_price,
                fixed_seconds=start,
                bytes_written=written,
            )
            doc = est.to_dict()
            # the peers by one name, as a prefetch counts them (its rate key says how they
            # serve: estimate.PEER_DELTAS)
            moves = est.bytes_by_source.items()
            doc["bytes_by_source"] = {("peer" if s == PEER_DELTAS else s): n for s, n in moves}
            doc.update(job=job, step=manifests[0].step, node=self.config.node)
            doc.update(source=sourcing.source)
            doc.update(bytes_bases=sourcing.bases, rate_basis=sourcing.rate_basis)
            doc.update(bytes_written=written, disk_rate=round(self.meter.rate("disk")))
            doc.update(disk_rate_basis=self.meter.basis("disk") if written else None)
            doc.update(seconds_start=start)
            doc.update(share=None if share is None else _share_doc(share))
            return doc
        which = "latest" if step is None else str(step)
        if unreachable:
            raise StoreError(
                f"no reachable tier holds job {job!r} step {which}; " + "; ".join(unreachable)
            )
        raise CheckpointNotFoundError(
            f"no tier holds job {job!r} step {which}" + "".join(f"; {why}" for why in lacking)
        )

    async def _sourcing(
        self,
        tier: str,
        store: Store,
        job: str,
        manifests: list[Manifest],
        total: int,
        share: Share | None,
    ) -> Sourcing:
        step = manifests[0].step
        here = await self._held_here(job, step)
        own_part = False  # this node's own part of the step, lacking what is asked
        if here == "local":
            copy = self.config.hot.step_path(job, step)
            own_part = await asyncio.to_thread(_lacks, copy, manifests, share)
        if here is not None and not own_part:  # nothing moves: a replica is checked by
            return await self._held_sourcing(job, step, here, total)  # stat, a copy re-hashed
        files = merged_files(manifests)  # (once: the bases' positions reuse it)
        wanted = None
        copy = self.config.hot.step_path(job, step)
        partial = self.config.hot.is_share(copy)
        if share is not None:
            if partial and covers(read_record(copy) or {}, share):
                return Sourcing("local", {"local": 0}, 0, "default")  # held: nothing to do
            wanted = share_chunk_ids(files, share)
        if partial:  # a partial copy here (a share, beside this node's own part): a
            # prefetch of more of the step keeps what it holds in place and restores the
            # rest against it alone, not against an earlier step here (prefetch._pull_share:
            # counted missing, the whole step's estimate after a share was 2.5x what the
            # prefetch then moved)
            in_place = await asyncio.to_thread(held_chunks, copy, files)
            return await self._source_of(tier, store, manifests, files, {}, wanted, in_place)
        entries = None if share is None else [f for m in manifests for f in m.files]
        held = await self._held_manifests(store, job, step, entries)
        return await self._source_of(tier, store, manifests, files, held, wanted)

    async def _source_of(
        self,
        tier: str,
        store: Store,
        manifests: list[Manifest],
        files: list[FileEntry] | None,
        held: dict[LocalCheckpoint, list[Manifest]],
        wanted: set[str] | None = None,
        in_place: set[str] | frozenset[str] = frozenset(),
    ) -> Sourcing:
        """Where a prefetch would get the chunks this node lacks and what it would move
        from there: the peers, each chunk of a sample asked of them in turn (as deltas
        against what this node holds at its position, as a prefetch asks), and the tier
        for the fraction of the sample no peer served. A source the meter has not measured
        yet is probed (agent/peers/probe.py)."""
        held_ids = {c.id for parts in held.values() for m in parts for c in m.all_chunks()}
        held_ids |= in_place
        index = ChunkIndex()
        for m in manifests:
            index.add_manifest(m)
        needed = {
            c.id
            for m in manifests
            for f in m.files
            for c in f.chunks
            if c.id not in held_ids and (wanted is None or c.id in wanted)
        }
        # what the newest earlier step held here has at each chunk's position
        base = next((c for c in held if c.step < manifests[0].step), None)
        bases = {}
        if base is not None and needed:
            merged = files if files is not None else merged_files(manifests)
            bases = local_bases(base.path, held[base], merged)
        meter, peers = self.meter, self.prefetcher.fanout_client
        content, bases_moved = _to_move(index, needed, held_ids)
        budget = probe.budget(content + bases_moved)
        source = f"tier:{tier}"
        moving: dict[str, int] = {}
        served_fraction, peer, peer_basis = 0.0, "", "default"
        key = peer_key(bool(bases))  # the peers' rate: with deltas against what is held here
        if self.config.peers and peers is not None and needed:
            picked = probe.sample(index, needed, bases, budget=budget)
            # (asked as its prefetch will ask: owners first)
            served = await probe.probe_peers(await peers.for_step(manifests), picked, bases)
            if served is not None:
                peer_basis = "measured" if meter.measured(key) else "probe"
                timed = served.probe
                if peer_basis == "probe":
                    meter.record(key, timed.moved, timed.seconds, provisional=True)
                raw = sum(c.size for cid in needed if (c := index.get(cid)) is not None)
                moving[key] = round(raw * served.served * timed.ratio)
                served_fraction, peer = served.served, served.peer
        # what no peer served comes from the tier, as in the prefetch (bases included)
        rest = round((content + bases_moved) * (1 - served_fraction))
        bases_rest = round(bases_moved * (1 - served_fraction))
        basis = "measured" if meter.measured(source) else "default"
        if rest or not moving:
            moving[source] = rest
            if basis == "default" and needed:
                picked = probe.sample(
                    index, needed, bases, run_bytes=probe.RUN_BYTES, budget=budget
                )
                got = await probe.probe_tier(store, picked, bases)
                if got is not None and meter.record(
                    source, got.moved, got.seconds, provisional=True
                ):
                    basis = "probe"
        if peer and moving[key] >= rest:  # (named by the source of most of the bytes)
            return Sourcing(f"peer:{peer}", moving, bases_rest, peer_basis)
        return Sourcing(source, moving, bases_rest, basis)

    async def _held_sourcing(self, job: str, step: int, here: str, total: int) -> Sourcing:
        """A step held here: one this agent restored is checked by stat (nothing to rate),
        any other copy is re-hashed at the local rate, probed on this copy at first contact
        (the 200 MB/s default was 2x slow: a cold re-hash of a 289 MB save took 0.17 s)."""
        if here in STAT_CHECKED:
            return Sourcing(here, {"local": 0}, 0, "default")
        meter = self.meter
        basis = "measured" if meter.measured("local") else "default"
        if basis == "default":
            step_dir = self.config.hot.step_path(job, step)
            got = await asyncio.to_thread(probe.probe_local, step_dir)
            if got is not None and meter.record("local", got.moved, got.seconds, provisional=True):
                basis = "probe"
        return Sourcing(here, {"local": total}, 0, basis)

    async def _held_here(self, job: str, step: int) -> str | None:
        """How this node holds the step, if it does: "replica" (a standby's replication) or
        "verified" (restored by a prefetch of this agent's) when its prefetch would find it
        unchanged since it was verified, as the prefetch asks (a step restored in the
        foreground was estimated as a re-hash, 1.3 s on the corpus, for 0.01 s); else
        "local" (training's own save, or a copy changed since: re-hashed). None: not here."""
        held = next((c for c in self.config.hot.checkpoints(job) if c.step == step), None)
        if held is None:
            return None
        try:
            how = await self.prefetcher.intact_restore(job, step, held.path)
        except (FerryError, OSError):  # (evicted meanwhile: its prefetch looks the long way)
            how = None
        return {"replica": "replica", "held": "verified"}.get(how or "", "local")

    async def _held_manifests(
        self, store: Store, job: str, step: int, entries: list[FileEntry] | None
    ) -> dict[LocalCheckpoint, list[Manifest]]:
        """The steps of ``job`` up to ``step`` this node holds, newest first, with their
        committed manifests (a local copy was verified when it was pulled, or is the source
        a push was made from): for a share, only the parts holding its ``paths`` where the
        step's marker says which (share.base_parts, of ``entries``); an unreadable manifest is left
        out: its chunks count as missing."""
        here = [c for c in self.config.hot.checkpoints(job) if c.step <= step]
        found: dict[LocalCheckpoint, list[Manifest]] = {c: [] for c in here}
        catalog = Catalog(store)
        for held in here:  # one listing per held step, not one of the whole job
            if held.step == step:  # this step here, not whole: this node's own part
                with contextlib.suppress(FerryError):
                    found[held] = [await catalog.manifest(job, step, self.config.node)]
                continue
            if entries is not None:
                try:
                    narrowed = await base_parts(catalog, job, held.step, entries)
                except FerryError:
                    continue
                if narrowed is not None:
                    found[held] = narrowed
                    continue
            for part in await catalog.parts(job, held.step):
                try:
                    found[held].append(await catalog.manifest(job, held.step, part.node))
                except FerryError:
                    continue
        return found


#: the spec's pattern for ``layout`` (docs/openapi.yaml)
_LAYOUT = re.compile(r"[0-9]{1,7}:[0-9]{1,7}(-[0-9]{1,7})?(,[0-9]{1,7}(-[0-9]{1,7})?)*")


def _lacks(copy: Path, manifests: list[Manifest], share: Share | None) -> bool:
    """Whether ``copy`` lacks a file of the step (of ``share``, given one) that a prefetch
    would then bring: it is this node's own part of a multi-node step."""
    files = (f for m in manifests for f in m.files)
    wanted = (f for f in files if share is None or share.spans_of(f.path) != ())
    return any(not (copy / f.path).exists() for f in wanted)


def _layout(text: str) -> Layout:
    """``"W:A,B"`` as a Layout: text that is not one is a bad request; a share that
    cannot exist (a rank outside the world) a share not found, as the spec's shape cannot
    say so."""
    world, _, ranks = text.partition(":")
    if not _LAYOUT.fullmatch(text):
        raise ValueError(f"layout: expected W:A,B or W:A-B, got {text!r}")
    try:  # the shape is right: what is wrong now is the share, which cannot exist
        picked = parse_ranks(ranks)
        if len(picked) > MAX_LAYOUT_RANKS:
            raise FerryError(f"at most {MAX_LAYOUT_RANKS} ranks per node, not {len(picked)}")
        return Layout(int(world), picked)
    except FerryError as exc:
        raise CheckpointNotFoundError(f"no such share: {exc}") from None


def _share_doc(share: Share) -> dict[str, Any]:
    layout = share.layout
    assert layout is not None  # (an estimate's share is always a layout's)
    return {"world_size": layout.world_size, "ranks": list(layout.ranks), "bytes": share.nbytes}


def _to_move(index: ChunkIndex, needed: set[str], held: set[str]) -> tuple[int, int]:
    """Stored bytes a prefetch moves: (the ``needed`` chunks, the delta bases they need that
    this node lacks too: a node without the previous step fetches those as well)."""
    bases: set[str] = set()
    for cid in needed:
        cur = index.get(cid)
        while cur is not None and cur.base is not None and cur.base not in held:
            if cur.base in needed or cur.base in bases:
                break
            bases.add(cur.base)
            cur = index.get(cur.base)
    stored = {cid: c.stored for cid in needed | bases if (c := index.get(cid)) is not None}
    return sum(stored[c] for c in needed if c in stored), sum(stored[c] for c in bases)
