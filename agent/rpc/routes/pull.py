"""``POST /v1/pull``: `ferry pull` handed to this node's agent over its local socket.

The agent runs the CLI's own pull (agent/cli/push_pull.py ``cmd_pull``: one home for what a
pull does) with what a one-shot process lacks: the tier's open connections, the buffers a
restore left, the imports done and the write path its start-up probe chose. It answers only
callers on the local socket who run as its own user (agent/rpc/middleware.py), only for a
store that is one of its tiers (its credentials and endpoint), and only when it sees the
destination's directory as the caller does (the same device and inode: a caller in another
mount namespace sees other paths). The CLI pulls by itself otherwise. Without a
``--base-dir`` of the caller's, the agent's own newest copy of the job at or before the
step asked (its hot dir: what training saved here, or a prefetch restored) is the base, as
for its prefetches: the chunks it holds are read there and hash-checked, not fetched.

The answer streams one JSON object per line (application/x-ndjson): ``{"start": [bytes,
what]}``, ``{"advance": bytes}`` (at most every PROGRESS_SECONDS), ``{"say": line}`` (the
pull's notes), then ``{"result": {...}, "line": "..."}`` or ``{"error": ..., "type":
...}``. A caller that goes away (Ctrl-C) cancels the pull, as Ctrl-C does in the CLI; the
next pull into the same destination waits for that one's cleanup, then resumes what it
left. An agent that stops cancels its pulls and says so (type ``AgentStopping``: the CLI
then pulls by itself)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import web

from agent.cli.args import UsageError
from agent.cli.push_pull import cmd_pull
from agent.cli.viaagent import nearest_dir
from agent.daemon.logs import event
from agent.rpc.appkeys import CONFIG, LOCAL_PULLS, PREFETCHER, STOPPING, TIERS
from agent.rpc.limits import DestLocks
from agent.rpc.middleware import error_response, json_body, local_caller, required
from transfer.endpoint import endpoint_from_env
from transfer.errors import FerryError
from transfer.store.base import Store
from transfer.store.url import local_root

if TYPE_CHECKING:
    from agent.node.prefetch import Prefetcher

log = logging.getLogger(__name__)

#: how often progress goes to the caller
PROGRESS_SECONDS = 0.2
#: a line (``{}``) at least this often, so that the caller can tell a silent agent from a
#: slow pull (its own timeout: agent/cli/viaagent.py QUIET_SECONDS)
KEEPALIVE_SECONDS = 5.0
#: how long a pull waits for another pull into the same destination (a cancelled one
#: cleaning up) before it says so
PREVIOUS_SECONDS = 120.0
#: the body: the pull's flags, paths absolute (the caller's working directory is not ours),
#: and ``dest_seen``: [path, st_dev, st_ino] of the destination's nearest existing directory
_FIELDS = ("store_url", "endpoint_url", "dest_dir", "job", "step", "node", "expected_nodes",
           "base_dir", "fsync", "world_size", "ranks", "items", "dest_seen")  # fmt: skip


async def post_pull(request: web.Request) -> web.StreamResponse:
    app, uid = request.app, local_caller(request)
    if uid is None:
        why = ("a pull into a path of this node is asked over the agent's local socket "
               "(local_socket), as the user the agent runs as")  # fmt: skip
        return error_response(403, why, "Forbidden")
    if app[STOPPING].is_set():
        return error_response(503, "the agent is stopping", "AgentStopping")
    body = await json_body(request, _FIELDS)
    args = _args(body)
    store = await asyncio.to_thread(_tier, app, args.store_url, body.get("endpoint_url"))
    if isinstance(store, str):
        return error_response(404, store, "NotATier")
    if why_not := await asyncio.to_thread(_why_not_here, body.get("dest_seen"), args.dest_dir):
        return error_response(409, why_not, "NotTheSameFiles")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    # one pull at a time into a destination (however it is spelled): a cancelled one's
    # cleanup ends before the next takes up the staging it left
    key = await asyncio.to_thread(_key_of, args.dest_dir)
    locks: DestLocks = app[LOCAL_PULLS]
    if not await locks.acquire(key, PREVIOUS_SECONDS):
        await _send(response, [{"error": f"another pull into {args.dest_dir} is still running "
                                "on the agent", "type": "DestinationBusy"}])  # fmt: skip
        return response
    if _gone(request):  # (the caller gave up while the agent checked or waited)
        locks.release(key)
        return response
    progress = _Progress()
    options = app[PREFETCHER].options  # (the write path its probe chose)
    pulling = asyncio.ensure_future(
        cmd_pull(store, args, progress, options=options, say=progress.say,
                 implicit_base=functools.partial(_held_base, app[PREFETCHER], args.job))
    )  # fmt: skip
    event(log, "local_pull", job=args.job, step=args.step, dest=key, uid=uid)
    pulling.add_done_callback(lambda done: _ended(done, args, key, locks))
    try:
        await _follow(request, response, pulling, progress, args.dest_dir)
    except asyncio.CancelledError:  # (the agent stopping past its shutdown timeout)
        pulling.cancel()
        raise
    except ConnectionResetError:  # (the caller gone: nobody to answer)
        pulling.cancel()
    return response


async def _follow(
    request: web.Request,
    response: web.StreamResponse,
    pulling: asyncio.Future[Any],
    progress: _Progress,
    dest: Path,
) -> None:
    """Stream the pull's progress to the caller, then its answer; cancel it when the caller
    goes, or say so when the agent stops (unless the pull finished first)."""
    quiet_since = time.monotonic()
    while not pulling.done():
        await asyncio.wait({pulling}, timeout=PROGRESS_SECONDS)
        if _gone(request):
            pulling.cancel()  # (the next pull into dest waits for its cleanup)
            return
        if request.app[STOPPING].is_set() and not pulling.done():
            pulling.cancel()
            await asyncio.wait({pulling})
            if pulling.cancelled():  # (else it ended first: its answer is sent below)
                sealed = await asyncio.to_thread(_whole_there, dest)
                why = ("the agent stopped as its pull ended: it is whole there" if sealed else
                       "the agent is stopping: its pull was cancelled")  # fmt: skip
                kind = "AgentStoppedAfterPull" if sealed else "AgentStopping"
                await _send(response, [{"error": why, "type": kind}])
                return
        lines = progress.take()
        if not lines and time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
            lines = [{}]  # (the caller times out an agent silent for longer)
        if lines:
            await _send(response, lines)
            quiet_since = time.monotonic()
    await _send(response, progress.take())
    try:
        doc, line = pulling.result()
    except Exception as exc:  # (the pull's own errors; any other, a bug, logged whole)
        if not isinstance(exc, FerryError | UsageError | ValueError | OSError):
            log.exception("local pull into %s failed", dest)
        await _send(response, [{"error": " ".join(str(exc).split()) or type(exc).__name__,
                                "type": type(exc).__name__}])  # fmt: skip
    else:
        await _send(response, [{"result": doc, "line": line}])
    await response.write_eof()


@contextlib.contextmanager
def _held_base(prefetcher: Prefetcher, job: str, step: int) -> Iterator[Path | None]:
    """The agent's newest whole copy of ``job`` at or before ``step`` (the step itself, if
    held: nothing to fetch), the base its prefetches would start from, held from the
    listing on (no await in between, as the prefetcher does: hot retention checks the
    holds) until the pull ends; None when it holds none."""
    try:
        held = [c for c in prefetcher.hot_dir.checkpoints(job) if c.step <= step]
    except (FerryError, OSError):
        held = []
    best = max(held, key=lambda c: c.step, default=None)
    with prefetcher.holds.hold((job, best.step) if best is not None else None):
        yield best.path if best is not None else None


def _key_of(dest: Path) -> str:
    return os.path.join(os.path.realpath(dest.parent), dest.name)


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _whole_there(dest: Path) -> bool:
    """Whether a pull renamed its restore into place at ``dest`` (it must have been missing
    or empty before: a directory with files in it now is a whole, verified restore)."""
    try:
        return dest.is_dir() and any(dest.iterdir())
    except OSError:
        return False


def _ended(
    pulling: asyncio.Future[Any], args: argparse.Namespace, dest: str, locks: DestLocks
) -> None:
    """The pull's last line in the log, however it ended; its destination free again."""
    locks.release(dest)
    if pulling.cancelled():
        event(log, "local_pull_cancelled", job=args.job, dest=dest)
    elif (exc := pulling.exception()) is not None:
        event(log, "local_pull_failed", job=args.job, dest=dest, error=" ".join(str(exc).split()))
    else:
        doc = pulling.result()[0]
        event(log, "local_pull_done", job=args.job, step=doc.get("step"), dest=dest,
              bytes=doc.get("bytes_raw"), seconds=round(doc.get("seconds", 0.0), 3))  # fmt: skip


def _args(body: dict[str, Any]) -> argparse.Namespace:
    """The pull's flags as the CLI's parser gives them (a null field: its default); paths
    must be absolute."""

    def path(name: str) -> Path | None:
        value = body.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ValueError(f"body field {name!r} must be an absolute path")
        return Path(value)

    def text(name: str, default: str | None = None) -> str | None:
        value = body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ValueError(f"body field {name!r} must be a string")
        return value

    world_size = body.get("world_size")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise ValueError("body field 'world_size' must be an integer")
    fsync = body.get("fsync")
    if fsync is not None and not isinstance(fsync, bool):
        raise ValueError("body field 'fsync' must be true or false")
    return argparse.Namespace(
        store_url=text("store_url") or required(body, "store_url", "body field"),
        dest_dir=path("dest_dir") or required(body, "dest_dir", "body field"),
        job=text("job") or required(body, "job", "body field"),
        step=text("step", "latest"),
        node=text("node"),
        expected_nodes=text("expected_nodes", ""),
        base_dir=path("base_dir"),
        fsync=bool(fsync),
        world_size=world_size,
        ranks=text("ranks"),
        items=path("items"),
    )


def _tier(app: web.Application, url: str, endpoint: object) -> Store | str:
    """The tier the caller's store URL (and S3 endpoint) names, or why none is."""
    if endpoint is not None and not isinstance(endpoint, str):
        raise ValueError("body field 'endpoint_url' must be a string")
    ours = (app[CONFIG].endpoint_url or endpoint_from_env()[0] or "").rstrip("/")
    theirs = (endpoint or "").rstrip("/")
    tiers: list[tuple[str, Store]] = app[TIERS]
    for tier_url, store in tiers:
        if not same_store(url, tier_url):
            continue
        if urlsplit(url).scheme == "s3" and theirs != ours:
            return (f"{url} is a tier of this agent at the S3 endpoint {ours or '(AWS)'}, not "
                    f"at {theirs or '(AWS)'} (give --endpoint-url or AWS_ENDPOINT_URL as the "
                    "agent's)")  # fmt: skip
        return store
    return f"{url} is not a tier of this agent (its tiers: {', '.join(u for u, _ in tiers)})"


def same_store(a: str, b: str) -> bool:
    """Whether two store URLs name one store: two local ones (a path, or file://, as
    open_store reads them; relative: to the agent's working directory, as its own tiers'
    are) by their real paths; any other two by scheme, bucket and prefix, exactly (but for
    slashes at the ends)."""
    try:
        local = [local_root(u) for u in (a, b)]
    except ValueError:  # (a malformed one names no tier)
        return False
    if local[0] is not None and local[1] is not None:
        return os.path.realpath(local[0]) == os.path.realpath(local[1])
    if local[0] is not None or local[1] is not None:
        return False
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.scheme, pa.netloc, pa.path.strip("/")) == (pb.scheme, pb.netloc, pb.path.strip("/"))


def _why_not_here(seen: object, dest: Path) -> str | None:
    """Why the agent should not write ``dest`` for this caller, or None: the caller's view
    of the destination's nearest existing directory (``[path, st_dev, st_ino]``) is not the
    agent's (another mount namespace, a link that leads elsewhere here), or the agent may
    not write there (same uid, other groups)."""
    if not (isinstance(seen, list) and len(seen) == 3 and isinstance(seen[0], str)):
        raise ValueError("body field 'dest_seen' must be [path, st_dev, st_ino]")
    try:
        ours = nearest_dir(str(dest))
    except OSError:
        ours = None
    if ours != seen:
        return "the agent sees other files at the destination's path (another mount namespace?)"
    if not os.access(ours[0], os.W_OK | os.X_OK):
        return f"the agent may not write into {ours[0]} (its groups are not the caller's?)"
    return None


class _Progress:
    """The pull's progress and notes, gathered for the next line to the caller (the engine
    calls it from its threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[dict[str, Any]] = []
        self._advanced = 0
        self._started: float | None = None

    def start(self, total_bytes: int, what: str) -> None:
        with self._lock:
            self._lines.append({"start": [total_bytes, what]})
            self._started = time.monotonic()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._advanced += nbytes

    def finish(self) -> None:
        pass

    def say(self, line: str) -> None:
        with self._lock:
            self._lines.append({"say": line})

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            lines, self._lines = self._lines, []
            if self._advanced:  # (with how long ago it started: the caller's rate)
                ago = round(time.monotonic() - (self._started or time.monotonic()), 3)
                lines.append({"advance": self._advanced, "started_ago": ago})
                self._advanced = 0
        return lines


async def _send(response: web.StreamResponse, lines: list[dict[str, Any]]) -> None:
    """Write ``lines``; a caller gone meanwhile is no error (the loop sees it, and cancels)."""
    if lines:
        with contextlib.suppress(ConnectionResetError):
            await response.write("".join(json.dumps(line) + "\n" for line in lines).encode())


ROUTES = [web.post("/v1/pull", post_pull)]
