"""What a store holds: its descriptor, and the committed manifests by job, step and node."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass, replace

from transfer.engine.dcp import METADATA, lacks_metadata
from transfer.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    FerryError,
    FormatError,
    IncompleteStepError,
    IntegrityError,
    NotAStoreError,
    NotFoundError,
    RangeNotSatisfiableError,
    StoreNotEmptyError,
)
from transfer.format import layout
from transfer.format.manifest import Manifest, parse_manifest
from transfer.format.names import check_name
from transfer.format.stepcommon import COMMON_KEY, parse_common
from transfer.format.stepfiles import MAX_MARKER_BYTES, StepFiles, parse_file_map
from transfer.store.base import Store

log = logging.getLogger(__name__)

#: manifests fetched at once by Catalog.manifests (a step of 512 parts is 512 GETs)
_MANIFEST_FETCHES = 16


@dataclass(frozen=True)
class CheckpointInfo:
    job: str
    step: int
    node: str
    manifest_bytes: int


async def open_catalog(store: Store, *, create: bool) -> bool:
    """Check the store descriptor (creating it when ``create``). False: not a store yet.
    ``create`` is for the Python API (``push``) and tests; the CLI and the agent make a
    store only on purpose (``init_store``) and otherwise ask ``require_store``."""
    await store.check()
    try:
        raw = await store.get(layout.STORE_DESCRIPTOR_KEY)
    except NotFoundError:
        if not create:
            return False
        await _write_descriptor(store)
        return True
    _check_descriptor(raw)
    return True


async def require_store(store: Store, *, hint: str = "") -> None:
    """Raise NotAStoreError (naming ``ferry init``; ``hint`` appended) unless ``store``
    holds a store descriptor. A URL that holds other objects is not offered ``ferry init``
    (which refuses it): it is most likely the wrong URL, a checkpoint given as the store."""
    if await open_catalog(store, create=False):
        return
    if not await store.holds_objects():
        raise not_a_store(store.url, hint)
    looks = " (a DCP checkpoint: it has .metadata)" if await store.exists(METADATA) else ""
    raise NotAStoreError(
        f"{store.url} is not a ckpt-ferry store (no {layout.STORE_DESCRIPTOR_KEY}) and holds "
        f"other files{looks}: check the URL (`ferry init` makes a store only in an empty "
        "directory or prefix)"
    )


def not_a_store(url: str, hint: str = "") -> NotAStoreError:
    return NotAStoreError(
        f"{url} is not a ckpt-ferry store (no {layout.STORE_DESCRIPTOR_KEY}): create it with "
        f"`ferry init {shlex.quote(url)}`{hint}"
    )


async def init_store(store: Store) -> bool:
    """Make ``store`` a ckpt-ferry store (``ferry init``): its root made if it is a local
    directory not there yet, then its descriptor written. True: created; False: it already
    was one (nothing changed: idempotent). A store that holds other objects and no
    descriptor (a directory or prefix in use for something else) is refused:
    StoreNotEmptyError, nothing written."""
    await store.create_root()
    if await open_catalog(store, create=False):
        return False
    if await store.holds_objects():
        raise StoreNotEmptyError(
            f"{store.url} is not empty and is not a ckpt-ferry store (no "
            f"{layout.STORE_DESCRIPTOR_KEY}): a store is made only in an empty directory or "
            "prefix"
        )
    return await _write_descriptor(store)


async def _write_descriptor(store: Store) -> bool:
    """Write the descriptor, create-only. False: a concurrent init or push wrote it first
    (the one there is checked)."""
    descriptor = json.dumps(layout.store_descriptor()).encode()
    try:
        await store.put(layout.STORE_DESCRIPTOR_KEY, descriptor, create_only=True)
        return True
    except AlreadyExistsError:  # a concurrent first push won the race
        _check_descriptor(await store.get(layout.STORE_DESCRIPTOR_KEY))
        return False


def _check_descriptor(raw: bytes) -> None:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise FormatError(f"{layout.STORE_DESCRIPTOR_KEY} is not JSON") from None
    layout.check_store_descriptor(doc)


async def list_checkpoints(store: Store, job: str | None = None) -> list[CheckpointInfo]:
    """Committed manifests, sorted by (job, step, node). Strays and temp files are ignored."""
    found = []
    for obj in await store.list(layout.manifest_prefix(job)):
        parsed = layout.parse_manifest_key(obj.key)
        if parsed is not None:
            found.append(CheckpointInfo(*parsed, manifest_bytes=obj.size))
    found.sort(key=lambda c: (c.job, c.step, c.node))
    return found


async def list_parts(store: Store, job: str, step: int) -> list[CheckpointInfo]:
    """The committed parts of one step, by node: one listing scoped to the step, so its
    cost grows with the step's nodes, never with the job's history."""
    prefix = layout.manifest_prefix(job, step)
    found = []
    for obj in await store.list(prefix):
        parsed = layout.parse_manifest_key(obj.key)
        if parsed is not None and parsed[:2] == (job, step):
            found.append(CheckpointInfo(*parsed, manifest_bytes=obj.size))
    found.sort(key=lambda c: c.node)
    return found


async def list_steps(store: Store, job: str) -> list[int]:
    """The steps of ``job`` that have (or, on a local store, had) a part, ascending: one
    delimiter listing, whose cost grows with the steps, not steps x nodes. A step named
    here may have no part left (a local store keeps an emptied step directory): callers
    list the step's parts before they act on it."""
    steps = []
    for name in await store.list_dirs(layout.manifest_prefix(job)):
        if len(name) == 18 and name.isascii() and name.isdigit():
            steps.append(int(name))
    return sorted(steps)


async def load_manifest(store: Store, job: str, step: int, node: str) -> Manifest:
    key = layout.manifest_key(job, step, node)
    try:
        manifest = parse_manifest(await store.get(key))
    except FormatError as exc:
        raise FormatError(f"{key}: {exc}") from None
    if (manifest.job, manifest.step, manifest.node) != (job, step, node):
        raise FormatError(f"{key} describes {manifest.job}/{manifest.step}/{manifest.node}")
    return manifest


class Catalog:
    """One operation's view of a store's committed parts: each listing is made once and
    each manifest fetched once, however many questions the operation asks (a push asks for
    its base and for its dedupe window, which overlap). A view, not a cache that lives
    on: make one per operation, so nothing it holds is staler than the operation."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._parts: dict[tuple[str, int], list[CheckpointInfo]] = {}
        self._steps: dict[str, list[int]] = {}
        self._manifests: dict[tuple[str, int, str], Manifest] = {}
        self._heads: dict[tuple[str, str], list[int]] = {}
        #: parts this view found missing (NotFoundError) where it looked for them
        self.gone: set[tuple[str, int, str]] = set()

    async def parts(self, job: str, step: int) -> list[CheckpointInfo]:
        if (job, step) not in self._parts:
            self._parts[(job, step)] = await list_parts(self.store, job, step)
        return self._parts[(job, step)]

    async def steps(self, job: str) -> list[int]:
        if job not in self._steps:
            self._steps[job] = await list_steps(self.store, job)
        return self._steps[job]

    async def manifest(self, job: str, step: int, node: str) -> Manifest:
        key = (job, step, node)
        if key not in self._manifests:
            try:
                self._manifests[key] = await load_manifest(self.store, job, step, node)
            except NotFoundError:
                self.gone.add(key)  # e.g. a head's step that retention has deleted since
                raise
        return self._manifests[key]

    async def manifests(self, job: str, step: int) -> list[Manifest]:
        """Every part of one step, in node order (a few fetched at a time)."""
        return await self.manifests_of(job, step, [c.node for c in await self.parts(job, step)])

    async def manifests_of(self, job: str, step: int, nodes: Sequence[str]) -> list[Manifest]:
        """The parts of ``nodes`` (in that order), a few fetched at a time."""
        limit = asyncio.Semaphore(_MANIFEST_FETCHES)

        async def one(node: str) -> Manifest:
            async with limit:
                return await self.manifest(job, step, node)

        return list(await asyncio.gather(*(one(n) for n in nodes)))

    async def step_files(self, job: str, step: int) -> StepFiles | None:
        """Which part holds each file of the step, from its completion marker's map
        (format/stepfiles.py); None: no marker, or one without a usable map (then a reader
        reads every part: a map is a shortcut, never needed to read a step)."""
        key = layout.completion_key(job, step)
        try:
            raw = await self.store.get(key)
        except NotFoundError:
            return None
        try:
            if len(raw) > MAX_MARKER_BYTES:
                raise FormatError(f"{len(raw):,} bytes, over the {MAX_MARKER_BYTES:,} read")
            # (a big map: off the loop)
            return await asyncio.to_thread(_parse_file_map, raw, key, job, step)
        except (ValueError, FormatError) as exc:
            log.warning("%s: %s; reading every part of the step instead", key, exc)
            return None

    async def node_steps(self, job: str, node: str) -> list[int]:
        """The steps ``node`` committed parts of, ascending, from its head (one GET) when
        it has one, else from one listing of the whole job (a store written before heads,
        or this node's first push). A hint: a step named may since have been deleted."""
        if (job, node) not in self._heads:
            head = await read_node_head(self.store, job, node)
            if head is None:
                listed = await list_checkpoints(self.store, job)
                head = sorted({c.step for c in listed if c.node == node})
            self._heads[(job, node)] = head
        return self._heads[(job, node)]

    async def record_head(self, job: str, node: str, step: int) -> None:
        """After a commit: the node's head names ``step`` too, and no longer the steps this
        view found deleted. Best effort: a failure only costs the next push a listing."""
        gone = {s for j, s, n in self.gone if (j, n) == (job, node)}
        try:
            steps = sorted((set(await self.node_steps(job, node)) - gone) | {step})
            steps = steps[-layout.HEAD_STEPS :]
            doc = {"format": layout.HEAD_FORMAT, "version": layout.HEAD_VERSION, "job": job}
            doc |= {"node": node, "steps": steps}
            await self.store.put(layout.node_head_key(job, node), json.dumps(doc).encode())
        except FerryError as exc:
            log.warning("could not update the head of %s/%s: %s", job, node, exc)
            return
        self._heads[(job, node)] = steps

    async def newest_step_with_parts(self, job: str, node: str | None = None) -> int | None:
        """The newest step that has a part (``node``'s, when given), walking back from the
        newest step listed: one listing per step walked, usually one."""
        for step in reversed(await self.steps(job)):
            if any(node is None or c.node == node for c in await self.parts(job, step)):
                return step
        return None


def _parse_file_map(raw: bytes, key: str, job: str, step: int) -> StepFiles | None:
    """The map of a marker, with its common index when that is sound (one that is not is
    left out with a warning: the map alone still spares the reader most parts)."""
    doc = json.loads(raw)
    files = parse_file_map(doc)
    if files is None or COMMON_KEY not in doc:
        return files
    sizes = {path: size for path, (_, size) in files.files.items()}
    try:
        common = parse_common(doc[COMMON_KEY], job, step, sizes, str(doc.get("created_at")))
    except FormatError as exc:
        log.warning("%s: its common index is unusable (%s); reading the parts instead", key, exc)
        return files
    return replace(files, common=common)


async def read_node_head(store: Store, job: str, node: str) -> list[int] | None:
    """The steps a node's head names, or None when it has none (or an unreadable one: a
    hint is never trusted enough to fail on)."""
    key = layout.node_head_key(job, node)
    try:
        doc = json.loads(await store.get(key))
    except NotFoundError:
        return None
    except ValueError:
        log.warning("%s is not JSON; listing the job instead", key)
        return None
    except FerryError as exc:  # e.g. a bucket policy that predates heads: list instead
        log.warning("cannot read %s (%s); listing the job instead", key, exc)
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != layout.HEAD_FORMAT
        or (doc.get("job"), doc.get("node")) != (job, node)
        or not isinstance(doc.get("steps"), list)
        or not all(type(s) is int and s >= 0 for s in doc["steps"])
    ):
        log.warning("%s is not a node head this ferry reads; listing the job instead", key)
        return None
    return sorted(set(doc["steps"]))


async def resolve_manifests(
    store: Store,
    job: str,
    step: int | None,
    node: str | None = None,
    catalog: Catalog | None = None,
) -> list[Manifest]:
    """The manifests of one checkpoint: every node's part, or only ``node``'s.

    ``step=None`` means the newest step that has a part (of ``node``, when given). Reads
    one listing of the step (more only while walking back over emptied steps) and the
    manifests it returns: nothing that grows with the job's history (``catalog``: what
    the caller's catalog has read already is not read again)."""
    check_name("job", job)
    if not await open_catalog(store, create=False):
        raise CheckpointNotFoundError(f"{store.url} holds no checkpoints (no store descriptor)")
    catalog = catalog or Catalog(store)
    if step is not None and node is not None:  # one part named: its manifest, no listing
        try:
            return [await catalog.manifest(job, step, node)]
        except NotFoundError:
            pass  # (said below, as for any other checkpoint not found)
    chosen = step if step is not None else await catalog.newest_step_with_parts(job, node)
    nodes = [] if chosen is None else [c.node for c in await catalog.parts(job, chosen)]
    nodes = [n for n in nodes if node is None or n == node]
    if chosen is None or not nodes:
        what = f"job {job!r}" + (f" step {step}" if step is not None else "")
        what += f" node {node!r}" if node else ""
        raise CheckpointNotFoundError(f"no committed checkpoint for {what} in {store.url}")
    assert chosen is not None
    if node is not None:
        return [await catalog.manifest(job, chosen, node)]
    return await catalog.manifests(job, chosen)


async def nothing_matches(store: Store, job: str | None, step: int | None) -> FerryError:
    """The error for a job or step a store lacks, naming what it has instead (a typo'd
    job is seen at once): one listing of the store's manifests."""
    return _nothing_matches(store, await list_checkpoints(store), job, step)


async def missing(store: Store, job: str, step: int | None) -> FerryError | None:
    """``nothing_matches``'s error when the store's listing has no part of ``job`` (of
    ``step``, if one is named), else None (a step listed but not whole: its own reason
    says more). One listing."""
    found = await list_checkpoints(store)
    if any(c.job == job and step in (None, c.step) for c in found):
        return None
    return _nothing_matches(store, found, job, step)


def _nothing_matches(
    store: Store, found: list[CheckpointInfo], job: str | None, step: int | None
) -> FerryError:
    jobs = sorted({c.job for c in found})
    if not found:
        return CheckpointNotFoundError(f"{store.url} holds no checkpoints")
    if (job is not None and job not in jobs) or step is None:
        return CheckpointNotFoundError(
            f"no checkpoint of job {job!r} in {store.url} (jobs there: {', '.join(jobs)})"
        )
    steps = sorted({c.step for c in found if job is None or c.job == job})
    shown = ", ".join(map(str, steps[-8:]))
    earlier = f", and {len(steps) - 8} earlier" if len(steps) > 8 else ""
    what = f"job {job!r}" if job is not None else "any job"
    return CheckpointNotFoundError(
        f"no step {step} of {what} in {store.url} (steps there: {shown}{earlier})"
    )


def step_is_complete(
    parts: Collection[str],
    has_marker: bool,
    expected_nodes: Sequence[str],
    job_writes_markers: bool,
    *,
    without_metadata: bool = False,
) -> bool:
    """The one rule for "is this step whole" (the prefetcher, the listing and retention all
    ask it): its completion marker, or every expected node's part (the node that would have
    written the marker may have died just after its own part); without expected nodes (a
    single-node view), any part, unless the job writes markers: then it is a multi-node job
    and one part is not the step. Without its marker, never a step whose parts hold DCP
    storage files and no ``.metadata`` (``without_metadata``, parts_lack_metadata: rank 0's
    node's part is not in; a multi-node job pushed by hand writes no markers)."""
    if has_marker:
        return True
    if without_metadata:
        return False
    if expected_nodes:
        return set(expected_nodes) <= set(parts)
    return not job_writes_markers


async def completion_markers(store: Store, job: str) -> set[int]:
    """The steps of ``job`` with a completion marker: one listing of the job's markers."""
    return {
        parsed[1]
        for obj in await store.list(f"{layout.COMPLETE_PREFIX}{job}/")
        if (parsed := layout.parse_completion_key(obj.key)) is not None and parsed[0] == job
    }


async def complete_steps(store: Store, job: str, expected_nodes: Sequence[str]) -> set[int]:
    """The steps of ``job`` in ``store`` that are whole by step_is_complete, from one listing
    of its parts and one of its completion markers (every step: the listing's question); a
    step whole only by its expected nodes' parts is confirmed by its files (whole_by_files:
    read only for such steps, which a marker soon vouches for unless they are torn)."""
    parts: dict[int, set[str]] = {}
    for c in await list_checkpoints(store, job):
        parts.setdefault(c.step, set()).add(c.node)
    markers = await completion_markers(store, job)
    catalog = Catalog(store)
    return {
        step
        for step, nodes in parts.items()
        if step_is_complete(nodes, step in markers, expected_nodes, bool(markers))
        and (
            step in markers
            or not expected_nodes
            or await unless_damaged(whole_by_files(catalog, job, step, nodes))
        )
    }


async def is_complete(store: Store, job: str, step: int, expected_nodes: Sequence[str]) -> bool:
    """Whether (job, step) is whole in ``store`` (step_is_complete), from the job's markers
    and one listing of the step's parts; whole only by its expected nodes' parts, confirmed
    by its files (whole_by_files)."""
    markers = await completion_markers(store, job)
    nodes = {c.node for c in await list_parts(store, job, step)}
    if not nodes or not step_is_complete(nodes, step in markers, expected_nodes, bool(markers)):
        return False
    if step in markers or not expected_nodes:
        return True
    return await unless_damaged(whole_by_files(Catalog(store), job, step, nodes))


async def latest_complete_step(
    store: Store, job: str, expected_nodes: Sequence[str], catalog: Catalog | None = None
) -> int:
    """The newest step of ``job`` that is complete in ``store``: an incomplete multi-node
    checkpoint (a node still uploading, or dead) is never "latest". Walks back from the
    newest step, one listing of parts per step walked (usually one or two); a step no
    marker vouches for is confirmed by its files (whole_by_files: its parts and its
    ``.metadata`` read), and skipped where its parts lack ``.metadata``
    (parts_lack_metadata) or a file it names."""
    markers = await completion_markers(store, job)
    catalog = catalog or Catalog(store)
    for step in reversed(await catalog.steps(job)):
        if step in markers:  # whole by its marker: no older step is asked about
            return step
        nodes = {c.node for c in await catalog.parts(job, step)}
        if nodes and step_is_complete(nodes, False, expected_nodes, bool(markers)):
            if not expected_nodes and parts_lack_metadata(await catalog.manifests(job, step)):
                continue
            if await whole_by_files(catalog, job, step, nodes):
                return step
    raise CheckpointNotFoundError(f"no complete checkpoint of job {job!r} in {store.url}")


#: whole_by_files's answers, by (store, job, step, its parts), with when each was found:
#: a torn step stays torn (committed parts are create-only), so every listing, standby
#: poll and retention run need not read all its manifests again; an answer is read anew
#: after a while all the same (a step expired and pushed again under the same name)
_WHOLE_BY_FILES: dict[tuple[str, str, int, frozenset[str]], tuple[bool, float]] = {}
WHOLE_SECONDS, TORN_SECONDS = 60.0, 600.0


async def whole_by_files(
    catalog: Catalog,
    job: str,
    step: int,
    nodes: Collection[str],
    manifests: list[Manifest] | None = None,
) -> bool:
    """Whether a step no completion marker vouches for is whole by its files: its parts
    hold every file its ``.metadata`` names at full length (check_step_whole: the parts'
    manifests, unless given, and one read of it). Every expected node's part being in is
    not enough: a node that wrote one file late pushed its part without it (a newcomer's
    trial), and the agent whose check found it torn wrote no marker, while the listing,
    "latest" and retention took the step for whole (retention could then expire the last
    loadable step). Where ``.metadata`` cannot be read (a pack lost or short, a chunk
    corrupt) that error is raised, as a pull of the step would say it (``unless_damaged``
    takes such a step for not whole instead)."""
    from transfer.engine.parts import check_step_whole  # (parts reads chunks: it imports this)

    key = (catalog.store.url, job, step, frozenset(nodes))
    now = time.monotonic()
    known = _WHOLE_BY_FILES.get(key)
    if known is not None and now - known[1] < (WHOLE_SECONDS if known[0] else TORN_SECONDS):
        return known[0]
    try:
        await check_step_whole(catalog, job, step, manifests)
        whole = True
    except IncompleteStepError:
        whole = False
    for stale in [k for k, (w, at) in _WHOLE_BY_FILES.items() if now - at >= TORN_SECONDS]:
        del _WHOLE_BY_FILES[stale]
    _WHOLE_BY_FILES[key] = (whole, now)
    return whole


async def unless_damaged(whole: Awaitable[bool]) -> bool:
    """``whole``'s answer, False where the step is damaged (a pack lost or short, a chunk
    corrupt or undecodable, parts that clash, a part gone since it was listed): for the
    questions that must not fail on one bad step (the listing, retention's inventory, which
    says more of it), unlike a pull, which names the damage."""
    try:
        return await whole
    except (FormatError, IntegrityError, NotFoundError, RangeNotSatisfiableError):
        return False


def parts_lack_metadata(manifests: Sequence[Manifest]) -> bool:
    """Parts of a step that hold DCP storage files and no ``.metadata``: never the whole
    step, however many nodes pushed them (rank 0's node's part, which holds it, is not in;
    no DCP load of them can succeed). One node's part was once taken as a single-node job's
    whole step: a newcomer's trial pushed one node's part with ``--part``, and retention
    kept it as the job's newest step and expired the last loadable one (``ferry push``
    refuses such a directory without ``--part`` since)."""
    return lacks_metadata(f.path for m in manifests for f in m.files)


async def latest_step(
    store: Store, job: str, expected_nodes: Sequence[str], catalog: Catalog | None = None
) -> int:
    """What ``latest`` means everywhere (a prefetch, a pull, a pin, a verify, a load): the
    newest complete step (latest_complete_step); where there is none, the error says why
    (no store, no part of the job at all, or no step whole yet)."""
    try:
        return await latest_complete_step(store, job, expected_nodes, catalog)
    except CheckpointNotFoundError:
        await resolve_manifests(store, job, None)  # (raises: no store, or no part at all)
        raise


async def resolve_checkpoint(
    store: Store, job: str, step: int | None, expected_nodes: Sequence[str]
) -> list[Manifest]:
    """The manifests of the checkpoint a prefetch, an estimate or a pull means by ``step``:
    ``None`` is the newest step that is complete (latest_complete_step); a named step is
    refused when the store holds only some of its parts (whole_parts). Complete by
    step_is_complete's rule: its marker, or every expected node's part; without expected
    nodes, its parts, unless the job writes markers (then its marker) or several parts
    hold DCP shards and no ``.metadata`` (parts_lack_metadata)."""
    if step is None:  # (one catalog: the parts the walk read are not read again)
        catalog = Catalog(store)
        step = await latest_step(store, job, expected_nodes, catalog)
        return await resolve_manifests(store, job, step, catalog=catalog)
    return await whole_parts(store, await resolve_manifests(store, job, step), expected_nodes)


async def whole_parts(
    store: Store, manifests: list[Manifest], expected_nodes: Sequence[str]
) -> list[Manifest]:
    """The parts of a named step, refused as not there (CheckpointNotFoundError) when
    ``store`` holds only some of them by step_is_complete's rule: a prefetch then takes it
    from the next tier (this one's push may still be running) instead of restoring a torn
    step or failing. Asks nothing when every expected node's part is listed; else reads
    the step's marker (with no nodes expected, after one listing of the job's markers: a
    job with none is a single node's, or one pushed by hand: parts_lack_metadata). Parts
    the marker names that the listing missed landed between the two: the parts are read
    again."""
    job, step = manifests[0].job, manifests[0].step
    nodes = {m.node for m in manifests}
    if expected_nodes:
        if step_is_complete(nodes, False, expected_nodes, False):
            return manifests
        marked = await _marker_nodes(store, job, step)
    else:
        markers = await completion_markers(store, job)
        if not markers and not (parts_lack_metadata(manifests)):
            return manifests  # a job that writes no markers: its parts say
        marked = await _marker_nodes(store, job, step) if step in markers else None
    if marked is not None:
        return manifests if marked <= nodes else await Catalog(store).manifests(job, step)
    if expected_nodes:
        missing = sorted(set(expected_nodes) - nodes)
        named = ", ".join(missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        why = f"{len(nodes)} of {len(expected_nodes)} parts, none yet from {named}"
    elif not markers:
        why = (
            f"no part of the {len(nodes)} in holds {METADATA} (rank 0's node's part still to "
            "come? name the job's nodes to be sure: --expected-nodes, or expected_nodes in an "
            "agent's config)"
        )
    else:
        why = (
            f"no completion marker yet, {len(nodes)} part(s) in (a node's part still to come? "
            "if every node's is in, name the job's nodes: --expected-nodes, or "
            "expected_nodes in an agent's config)"
        )
    raise CheckpointNotFoundError(f"{job} step {step} is not whole in {store.url}: {why}")


async def _marker_nodes(store: Store, job: str, step: int) -> frozenset[str] | None:
    """The nodes the step's completion marker names; None without a marker (an unreadable
    one names none: every part is then read again)."""
    try:
        raw = await store.get(layout.completion_key(job, step))
    except NotFoundError:
        return None
    try:
        nodes = json.loads(raw)["nodes"] if len(raw) <= MAX_MARKER_BYTES else None
    except (ValueError, KeyError, TypeError):
        nodes = None
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        return frozenset({"(unreadable marker)"})
    return frozenset(nodes)
