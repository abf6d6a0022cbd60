"""One push of a (job, step, node) at a time per store.

Two pushes of the same part at once (the agent and a hand-run ``ferry push``, two
``ferry push`` runs) used to both upload everything: 904 MB stored for a 452 MB checkpoint,
half of it referenced by nobody. A push now holds ``locks/push/<job>/<step>/<node>.json``
(written create-only) while it uploads; a second push of the same part waits for the first
to finish, then finds the part committed and uploads nothing ("already committed"), or, if
the first failed, pushes it itself.

The lease says who holds it (host, pid) and until when; the holder renews it every
RENEW_SECONDS, so a push killed outright leaves a lease that lapses within LEASE_SECONDS,
and one on the same host whose process is gone is broken at once (a killed ``ferry push``
run again resumes immediately). Readers of checkpoints never look at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator

from transfer.errors import AlreadyExistsError, FerryError, NotFoundError
from transfer.format.layout import PUSH_LOCKS_PREFIX, push_lock_key
from transfer.store.base import Store

log = logging.getLogger(__name__)

LEASE_SECONDS = 120.0
RENEW_SECONDS = 30.0
POLL_SECONDS = 1.0


def holder_identity() -> dict[str, object]:
    """Who holds a lease: this host and process (a lease of a dead one is broken at once)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def describe_holder(holder: dict[str, object]) -> str:
    """A lease's holder as a log line reads it: ``holder H on host X pid P``, each part
    that the lease names ("an unreadable lease" when it names none)."""
    parts = []
    name = holder.get("holder") or holder.get("token")  # a push lease: its attempt's token
    if name:
        parts.append(f"holder {name}")
    if holder.get("host"):
        parts.append(f"on host {holder['host']}")
    if holder.get("pid") is not None:
        parts.append(f"pid {holder['pid']}")
    return " ".join(parts) or "an unreadable lease"


def holder_alive(holder: dict[str, object]) -> bool:
    """False only when the holder is known dead: a process of this host that is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(int(holder["pid"]), 0)  # type: ignore[call-overload]
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.asynccontextmanager
async def push_lease(store: Store, job: str, step: int, node: str) -> AsyncIterator[None]:
    """Hold the push lease of (job, step, node) in ``store`` for the body, waiting while a
    live push holds it."""
    key = push_lock_key(job, step, node)
    # the token tells this attempt's own lease apart: when the reply to our create-only PUT
    # is lost, the retry meets the lease we wrote, and must not wait for itself to lapse
    me = {**holder_identity(), "token": secrets.token_hex(8)}
    told = False
    while True:
        doc = json.dumps({**me, "expires_at": time.time() + LEASE_SECONDS}).encode()
        try:
            await _put_or_take_back(store, key, doc)
            break
        except AlreadyExistsError:
            holder = await _read(store, key)
            if holder.get("token") == me["token"]:
                break  # an earlier try of this PUT landed: the lease is ours
            expired = (
                not isinstance(holder.get("expires_at"), (int, float))
                or float(
                    holder["expires_at"]  # type: ignore[arg-type]
                )
                < time.time()
            )
            if expired or not holder_alive(holder):
                why = "it expired" if expired else "its process is gone"
                log.warning(
                    "breaking the push lease %s of %s (%s)", key, describe_holder(holder), why
                )
                await store.delete(key)
                continue
            if not told:
                log.warning(
                    "another push of %s step %s node %s is running (%s); waiting for it",
                    job, step, node, describe_holder(holder),
                )  # fmt: skip
                told = True
            await asyncio.sleep(POLL_SECONDS)
    released = asyncio.Event()
    renewer = asyncio.create_task(_renew(store, key, me, released))
    try:
        yield
    finally:
        # never cancel a renewal mid-write: the write (a thread's rename, a PUT already
        # sent) would land after the delete below and leave the lease behind
        released.set()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(FerryError):  # it lapses on its own
            if (await _read(store, key)).get("token") == me["token"]:
                await store.delete(key)


async def _put_or_take_back(store: Store, key: str, doc: bytes) -> None:
    """The lease's create-only write; cancelled mid-way (SIGTERM), it waits for the write,
    which goes on regardless (a thread's rename, a PUT already sent), and deletes what it
    wrote: a cancelled push never got to its release, and would leave the lease behind."""
    put = asyncio.ensure_future(store.put(key, doc, create_only=True))
    try:
        await asyncio.shield(put)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # not written, or another's: nothing to undo
            await put
            await store.delete(key)
        raise


async def push_lease_census(store: Store) -> tuple[int, list[str]]:
    """How many pushes hold an unexpired lease in ``store`` (garbled leases count: unsure
    means running; retention without a grace period deletes nothing while one does), and
    the keys of the leases that lapsed (expired, or of a process of this host that is
    gone): a killed push's, which only the next push of its part would break (retention
    removes them: drop_lapsed_leases)."""
    count, lapsed, now = 0, [], time.time()
    for obj in await store.list(PUSH_LOCKS_PREFIX):
        holder = await _read(store, obj.key)
        if _lapsed(holder, now):
            lapsed.append(obj.key)
        else:
            count += 1
    return count, lapsed


async def drop_lapsed_leases(store: Store, keys: list[str]) -> int:
    """Delete the leases ``keys`` that are still lapsed (each read again first: a push may
    have taken one over since); returns how many went."""
    dropped = 0
    for key in keys:
        if _lapsed(await _read(store, key), time.time()):
            await store.delete(key)
            dropped += 1
    return dropped


def _lapsed(holder: dict[str, object], now: float) -> bool:
    """Known to be nobody's: its expiry passed, or its process is gone (a garbled lease is
    counted as running: unsure means running)."""
    expires = holder.get("expires_at", now + LEASE_SECONDS)
    if not isinstance(expires, (int, float)):
        return False
    return expires <= now or not holder_alive(holder)


async def _renew(store: Store, key: str, me: dict[str, object], released: asyncio.Event) -> None:
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), RENEW_SECONDS)
            return
        doc = json.dumps({**me, "expires_at": time.time() + LEASE_SECONDS}).encode()
        try:
            await store.put(key, doc)
        except FerryError as exc:  # the push itself will hit the same trouble and say so
            log.warning("could not renew %s: %s", key, exc)


async def _read(store: Store, key: str) -> dict[str, object]:
    try:
        doc = json.loads(await store.get(key))
    except NotFoundError:
        return {"expires_at": 0}  # released meanwhile: take it on the next try
    except ValueError:
        return {}  # garbled: treated as expired
    return doc if isinstance(doc, dict) else {}
