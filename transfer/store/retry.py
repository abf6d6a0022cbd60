"""Which store failures are worth another try, how long to wait before it, and what each
becomes: one loop (``run_retried``) for every request of every backend (S3: control calls,
ranged reads, part uploads; a local or NFS directory: reads, lists, deletes, whole-object
writes; an fsspec filesystem: every call), and one ``ErrorTable`` per backend beside its
code (local.py, fsspecstore.py, s3errors.py). botocore's and obstore's own retries are off,
so this is the only layer (stacked retry layers multiplied into a minute of retries per
request against a store that was down)."""

from __future__ import annotations

import contextlib
import errno
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from transfer.errors import StoreError, StoreUnavailableError
from transfer.options import StoreSettings

#: A file system's failures worth another try: what an NFS mount answers while its server
#: fails over or the network drops (soft mounts give EIO on a timeout). Retrying them on a
#: local disk costs a few seconds before the same error, so one rule serves both.
TRANSIENT_ERRNOS = frozenset(
    {errno.ESTALE, errno.ETIMEDOUT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOLCK}
)
T = TypeVar("T")


def transient_os_error(exc: BaseException) -> bool:
    """A network failure (timed out, refused, reset) or an errno a flaky mount answers."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


@dataclass(frozen=True)
class ErrorTable:
    """One backend's failures: which are ``transient`` (worth another try), and the
    StoreError each becomes: ``mapped(exc, what, tries, where)`` (``what``: the request
    in a few words; ``where``: the object or prefix asked for, or None). A table may
    re-raise an exception it does not know (a bug, not an I/O failure) as it is."""

    transient: Callable[[BaseException], bool]
    mapped: Callable[[BaseException, str, int, str | None], StoreError]


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; after the n-th failure wait a jittered
    ``first_backoff * 2**(n-1)``, capped (retries of requests that failed together do not
    arrive together). Blocking: run it on the store's threads, never on an event loop."""

    attempts: int = StoreSettings.attempts
    first_backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    def backoff_seconds(self, tried: int) -> float:
        cap = doubling_wait(self.first_backoff, tried, self.max_backoff)
        return random.uniform(cap / 2, cap)


def doubling_wait(first: float, failures: int, most: float) -> float:
    """The wait after the ``failures``-th failure in a row: ``first``, doubled after each
    further one, at most ``most`` (a request's retries here; a push's or a standby's copy
    in the agent)."""
    return min(first * float(2 ** min(max(failures, 1) - 1, 32)), most)


#: per thread: an event that, once set, ends ``run_retried``'s tries (``no_retries_after``)
_stop = threading.local()


@contextlib.contextmanager
def no_retries_after(event: threading.Event) -> Iterator[None]:
    """In this thread, inside: once ``event`` is set, a failed request is not tried again
    and no backoff is waited out. A cancelled restore's reader threads (engine/fetch.py):
    the restore's end waits for them, and a store that black-holes reads held each for
    every try of its policy (6 x a 60 s read timeout), so an agent's stop for minutes."""
    before = getattr(_stop, "event", None)
    _stop.event = event
    try:
        yield
    finally:
        _stop.event = before


def _stopped(backoff: float) -> bool:
    """Wait ``backoff`` seconds, or less if this thread's tries were stopped: whether they
    were."""
    event: threading.Event | None = getattr(_stop, "event", None)
    if event is None:
        time.sleep(backoff)
        return False
    return event.wait(backoff)


def run_retried(
    policy: RetryPolicy,
    errors: ErrorTable,
    what: str,
    attempt: Callable[[], T],
    where: str | None = None,
) -> T:
    """``attempt()`` until it succeeds, fails for good (``errors.transient`` says no), the
    policy's tries are used up or the thread's tries are stopped (``no_retries_after``); a
    failure comes out as ``errors.mapped`` makes it (a StoreError passes through as it is)."""
    for tried in range(1, policy.attempts + 1):
        try:
            return attempt()
        except Exception as exc:
            # (the backoff is waited out here, only before another try)
            if (
                not errors.transient(exc)
                or tried == policy.attempts
                or _stopped(policy.backoff_seconds(tried))
            ):
                if isinstance(exc, StoreError):
                    raise
                mapped = errors.mapped(exc, what, tried, where)
                if type(mapped) is StoreError and errors.transient(exc):  # (tries used up)
                    mapped = StoreUnavailableError(str(mapped))
                raise mapped from exc
    raise AssertionError("unreachable")
