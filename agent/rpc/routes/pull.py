"""``POST /v1/pull``: `ferry pull` handed to this node's agent over its local socket.

The agent runs the CLI's own pull (agent/cli/push_pull.py ``cmd_pull``: one home for what a
pull does) with what a one-shot process lacks: the tier's open connections, the buffers a
restore left, the imports done and the write path its start-up probe chose. It answers only
callers on the local socket (the path it writes is the caller's; the socket's callers are
the agent's own user: agent/daemon/localsocket.py), and only for a store that is one of its
tiers (its credentials and endpoint); the CLI pulls by itself otherwise.

The answer streams one JSON object per line (application/x-ndjson): ``{"start": [bytes,
what]}``, ``{"advance": bytes}`` (at most every PROGRESS_SECONDS), ``{"say": line}`` (the
pull's notes), then ``{"result": {...}, "line": "..."}`` or ``{"error": ..., "type":
...}``. A caller that goes away (Ctrl-C) cancels the pull, as Ctrl-C does in the CLI."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from agent.cli.args import UsageError
from agent.cli.push_pull import cmd_pull
from agent.daemon.logs import event
from agent.rpc.appkeys import CONFIG, PREFETCHER, TIERS
from agent.rpc.middleware import error_response, json_body, local_caller, required
from transfer.endpoint import endpoint_from_env
from transfer.errors import FerryError
from transfer.store.base import Store

log = logging.getLogger(__name__)

#: how often progress goes to the caller
PROGRESS_SECONDS = 0.2
#: the body: the pull's flags, paths absolute (the caller's working directory is not ours)
_FIELDS = ("store_url", "endpoint_url", "dest_dir", "job", "step", "node", "expected_nodes",
           "base_dir", "fsync", "world_size", "ranks", "items")  # fmt: skip


async def post_pull(request: web.Request) -> web.StreamResponse:
    if local_caller(request) is None:
        why = ("a pull into a path of this node is asked over the agent's local socket "
               "(local_socket), as the user the agent runs as")  # fmt: skip
        return error_response(403, why, "Forbidden")
    body = await json_body(request, _FIELDS)
    args = _args(body)
    store = _tier(request.app, args.store_url, body.get("endpoint_url"))
    if store is None:
        tiers = ", ".join(url for url, _ in request.app[TIERS])
        return error_response(404, f"{args.store_url} is not a tier of this agent ({tiers})",
                              "NotATier")  # fmt: skip
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    progress = _Progress()
    options = request.app[PREFETCHER].options  # (the write path its probe chose)
    pulling = asyncio.ensure_future(
        cmd_pull(store, args, progress, options=options, say=progress.say)
    )
    event(log, "local_pull", job=args.job, step=args.step, dest=str(args.dest_dir))
    try:
        while not pulling.done():
            await asyncio.wait({pulling}, timeout=PROGRESS_SECONDS)
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the caller went away")
            await _send(response, progress.take())
        await _send(response, progress.take())
        doc, line = pulling.result()
        await _send(response, [{"result": doc, "line": line}])
    except (FerryError, ValueError, OSError, UsageError) as exc:  # (the CLI's own errors)
        if isinstance(exc, ConnectionResetError):
            raise  # (no one to tell: the finally cancels the pull)
        await _send(response, [{"error": " ".join(str(exc).split()) or type(exc).__name__,
                                "type": type(exc).__name__}])  # fmt: skip
    finally:
        if not pulling.done():
            pulling.cancel()
            with contextlib.suppress(BaseException):
                await pulling  # (its cleanups run, as a Ctrl-C'd CLI pull's do)
            event(log, "local_pull_cancelled", job=args.job, dest=str(args.dest_dir))
    await response.write_eof()
    return response


def _args(body: dict[str, Any]) -> argparse.Namespace:
    """The pull's flags as the CLI's parser gives them; paths must be absolute."""

    def path(name: str) -> Path | None:
        value = body.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ValueError(f"body field {name!r} must be an absolute path")
        return Path(value)

    def text(name: str, default: str | None = None) -> str | None:
        value = body.get(name, default)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"body field {name!r} must be a string")
        return value

    world_size = body.get("world_size")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise ValueError("body field 'world_size' must be an integer")
    return argparse.Namespace(
        store_url=required(body, "store_url", "body field"),
        dest_dir=path("dest_dir") or required(body, "dest_dir", "body field"),
        job=text("job") or required(body, "job", "body field"),
        step=text("step", "latest"),
        node=text("node"),
        expected_nodes=text("expected_nodes", ""),
        base_dir=path("base_dir"),
        fsync=body.get("fsync") is True,
        world_size=world_size,
        ranks=text("ranks"),
        items=path("items"),
    )


def _tier(app: web.Application, url: object, endpoint: object) -> Store | None:
    """The tier the caller's store URL (and S3 endpoint) names, or None."""
    if not isinstance(url, str) or (endpoint is not None and not isinstance(endpoint, str)):
        raise ValueError("body fields 'store_url' and 'endpoint_url' must be strings")
    ours = app[CONFIG].endpoint_url or endpoint_from_env()[0]
    tiers: list[tuple[str, Store]] = app[TIERS]
    for tier_url, store in tiers:
        if not _same_store(url, tier_url):
            continue
        if urlsplit(url).scheme == "s3" and (endpoint or "").rstrip("/") != (ours or "").rstrip(
            "/"
        ):
            continue
        return store
    return None


def _same_store(a: str, b: str) -> bool:
    """Whether two store URLs name one store (s3://bucket/prefix, or a path / file://)."""
    pa, pb = urlsplit(a), urlsplit(b)
    if pa.scheme == "s3" or pb.scheme == "s3":
        return pa.scheme == pb.scheme and (pa.netloc, pa.path.strip("/")) == (
            pb.netloc,
            pb.path.strip("/"),
        )
    local = [p.path if p.scheme == "file" else u for p, u in ((pa, a), (pb, b))]
    return os.path.realpath(local[0]) == os.path.realpath(local[1])


class _Progress:
    """The pull's progress and notes, gathered for the next line to the caller (the engine
    calls it from its threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[dict[str, Any]] = []
        self._advanced = 0

    def start(self, total_bytes: int, what: str) -> None:
        with self._lock:
            self._lines.append({"start": [total_bytes, what]})

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
            if self._advanced:
                lines.append({"advance": self._advanced})
                self._advanced = 0
        return lines


async def _send(response: web.StreamResponse, lines: list[dict[str, Any]]) -> None:
    if lines:
        await response.write("".join(json.dumps(line) + "\n" for line in lines).encode())


ROUTES = [web.post("/v1/pull", post_pull)]
