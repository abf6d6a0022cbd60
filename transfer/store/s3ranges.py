"""The S3 ranged GETs of a restore, received straight into the caller's buffer.

Why not obstore here (it serves every other read, s3objects.py): obstore assembles each
reply into a buffer of its own, which the reader then copies into its reused one, two
passes over every byte on top of the kernel's. Here each reader thread keeps one
keep-alive ``http.client`` connection (a second while its stream is open and it reads a
delta's base on the side) and the socket's bytes land, GIL released, in the
caller's buffer (``readinto``). ``python -m bench.s3_clients`` (2026-12-03, SeaweedFS on
loopback, 2 cores, 1 GiB from 4 threads, two runs of 5 rounds): client CPU 0.49-0.53 s per
GB in 8 MiB ranges against obstore's 0.93-0.95 and botocore's 0.93-0.95, 0.65-0.70 in 64
MiB ranges against 1.53-1.75 and 1.13, at the highest MB/s of the three in both.
A reply can also be read piece by piece
(``open`` -> ``RangeBody.fill``), so a reader takes a long range in one request without a
buffer the size of it: fewer, longer requests cost the server less per byte.

Used when the credentials are static (key and secret given, or in the environment, a
session token included) and the environment names no proxy for the endpoint
(s3config.proxy_for); otherwise (profiles, credential_process, SSO, IMDS; a proxy) the
reads stay on obstore, which takes botocore's chain and the proxy
(tests/test_s3_transports.py). Failures leave as the types the client's error table
knows (s3errors.py): an error reply as ReplyError (status and S3 error code), a reply cut
short as ShortBodyError, no reply as ConnectionError or TimeoutError, each in one line.
"""

from __future__ import annotations

import html
import http.client
import os
import re
import ssl
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit

from transfer.errors import StoreError
from transfer.keepalive import KeptConnections
from transfer.store.base import RangeStream
from transfer.store.s3config import proxy_for
from transfer.store.s3errors import ReplyError, ShortBodyError, range_length
from transfer.store.sigv4 import Credentials, canonical_path, sign

_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{1,300})</Message>")
_RANGE_START = re.compile(r"bytes (\d+)-")
_ERROR_BODY_MAX = 64 << 10


class HttpRanges:
    """Ranged GETs of one bucket, callable from many threads at once (each thread keeps
    its idle connections for its next requests: one, or two while a stream is open and a
    read happens beside it). Each call is one attempt: the caller's retry policy decides
    about another."""

    def __init__(
        self,
        endpoint_url: str | None,
        bucket: str,
        creds: Credentials,
        region: str,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        if endpoint_url:  # path-style, as for every custom endpoint
            url = urlsplit(endpoint_url)
            scheme, self._netloc = url.scheme, url.netloc
            self._prefix = url.path.rstrip("/") + "/" + bucket + "/"
        else:  # AWS itself, virtual-hosted
            scheme, self._netloc = "https", f"{bucket}.s3.{region}.amazonaws.com"
            self._prefix = "/"
        self.url = f"{scheme}://{self._netloc}"
        self._creds = creds
        self._region = region
        self._read_timeout = read_timeout
        self._conns = KeptConnections(
            connect_timeout,
            lambda: ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE")),
        )

    def _take(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """A connection for one request (this thread's idle one unless ``fresh``), and
        whether it was kept from an earlier request; failures to connect in one line."""
        try:
            conn, reused = self._conns.take(self.url, fresh)
        except TimeoutError:
            raise TimeoutError(f"no connection within the connect timeout to {self.url}") from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            msg = f"Could not connect to the endpoint URL: {self.url} ({reason})"
            raise ConnectionError(msg) from None
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)
        return conn, reused

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        self._conns.give_back(self.url, conn)

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        self._conns.drop(conn)

    def close(self) -> None:
        self._conns.close()

    # -- requests -----------------------------------------------------------------------

    def read_into(self, full_key: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the object's bytes from ``start``; how many it had there."""
        if not len(buf):
            return 0
        with self.open(full_key, start, start + len(buf)) as body:
            return body.fill(buf)

    def open(self, full_key: str, start: int, end: int) -> RangeBody:
        """The reply to a GET of bytes ``start``..``end`` (end exclusive), its body unread."""
        path = canonical_path(self._prefix + full_key)
        headers = {"range": f"bytes={start}-{end - 1}"}
        what = f"get {full_key}"
        for fresh in (False, True):  # a kept connection the server closed: once more, anew
            conn, reused = self._take(fresh)
            try:
                signed = sign("GET", self._netloc, path, headers, self._creds, self._region)
                conn.request("GET", path, headers=signed)
                reply = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                if reused and isinstance(exc, (ConnectionError, http.client.HTTPException)):
                    continue
                raise self._no_reply(exc) from None
            return self._checked(conn, reply, start, end, what)
        raise AssertionError("unreachable")

    def _no_reply(self, exc: BaseException) -> Exception:
        if isinstance(exc, TimeoutError):
            return TimeoutError(f"no reply within the read timeout from {self.url}")
        return ConnectionError(f"the connection closed before a reply from {self.url}")

    def _checked(
        self,
        conn: http.client.HTTPConnection,
        reply: http.client.HTTPResponse,
        start: int,
        end: int,
        what: str,
    ) -> RangeBody:
        if reply.status not in (200, 206):
            try:
                text = reply.read(_ERROR_BODY_MAX)
            except (OSError, http.client.HTTPException):
                text = b""
            self._drop(conn)
            code = _CODE.search(text)
            message = _MESSAGE.search(text)
            name = code.group(1).decode(errors="replace") if code else reply.reason
            said = html.unescape(message.group(1).decode(errors="replace")) if message else None
            detail = f": {said}" if said else ""
            raise ReplyError(
                reply.status, f"{name} ({reply.status}){detail}", code=name, detail=said
            )
        got_start = 0
        if reply.status == 206:
            content_range = reply.getheader("Content-Range", "")
            match = _RANGE_START.match(content_range)
            got_start = int(match.group(1)) if match else -1
            announced = range_length(content_range)
            if announced is not None and reply.length is not None and reply.length < announced:
                self._drop(conn)  # a middlebox cut the body and its Content-Length
                raise ShortBodyError(f"{what}: {reply.length} bytes for the range {content_range}")
        if got_start != start:
            self._drop(conn)
            raise StoreError(f"{what}: asked for bytes from {start}, got from {got_start}")
        return RangeBody(self, conn, reply, end - start, what)


class RangeBody:
    """A ranged reply's body, read in order into the caller's buffers; the connection goes
    back for reuse only when the body was read to its end."""

    def __init__(
        self,
        owner: HttpRanges,
        conn: http.client.HTTPConnection,
        reply: http.client.HTTPResponse,
        wanted: int,
        what: str,
    ) -> None:
        self._owner = owner
        self._conn: http.client.HTTPConnection | None = conn
        self._reply = reply
        self._what = what
        # what the reply holds of the range asked for (less at the object's end)
        self.remaining = min(wanted, reply.length if reply.length is not None else wanted)

    def fill(self, view: memoryview) -> int:
        """Read the next ``len(view)`` bytes of the body into ``view`` (fewer only where the
        object ends); a body that stops early is a ShortBodyError."""
        want = min(len(view), self.remaining)
        got = 0
        try:
            while got < want:
                n = self._reply.readinto(view[got:want])
                if not n:
                    break
                got += n
        except TimeoutError:
            self._close()
            raise TimeoutError(f"{self._what}: no byte within the read timeout") from None
        except (OSError, http.client.HTTPException):
            self._close()
            raise ShortBodyError(f"{self._what}: the body stopped after {got} bytes") from None
        self.remaining -= got
        if got < want:
            self._close()
            raise ShortBodyError(f"{self._what}: the body stopped after {got} bytes")
        return got

    def _close(self) -> None:
        if self._conn is not None:
            self._owner._drop(self._conn)
            self._conn = None

    def __enter__(self) -> RangeBody:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(failed=kind is not None)

    def release(self, failed: bool = False) -> None:
        """Done with the body: a connection whose reply was read to its end stays for the
        next request; any other is closed."""
        if self._conn is None:
            return
        if not failed and self.remaining == 0 and self._reply.read(1) == b"":
            conn, self._conn = self._conn, None
            self._owner._give_back(conn)
            return
        self._close()


T = TypeVar("T")
Retrying = Callable[[Callable[[], T]], T]  # the client's retry policy around one attempt


class ResumingStream(RangeStream):
    """A ranged read taken piece by piece, each piece retried by the client's policy; a
    retry asks again from the first byte not yet delivered, so a connection lost half way
    costs the rest of the range, not all of it."""

    def __init__(
        self, ranges: HttpRanges, full_key: str, start: int, end: int, retrying: Retrying[int]
    ) -> None:
        self._ranges = ranges
        self._key = full_key
        self._pos = start
        self._end = end
        self._retrying = retrying
        self._body: RangeBody | None = None

    def fill(self, buf: memoryview) -> int:
        want = min(len(buf), self._end - self._pos)
        if want <= 0:
            return 0
        got = self._retrying(lambda: self._attempt(buf[:want]))
        self._pos += got
        if got < want:  # the object ended before the range: nothing more will come
            self._end = self._pos
        return got

    def _attempt(self, view: memoryview) -> int:
        try:
            if self._body is None:
                self._body = self._ranges.open(self._key, self._pos, self._end)
            got = self._body.fill(view)
        except BaseException:
            self.close()
            raise
        if got < len(view):
            self.close()
        return got

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.release()


def make_ranges(
    endpoint_url: str | None,
    bucket: str,
    key: str | None,
    secret: str | None,
    region: str,
    connect_timeout: float,
    read_timeout: float,
) -> HttpRanges | None:
    """This client's ranged reads, or None where they stay on obstore: credentials from
    anywhere but static settings or the environment (obstore takes botocore's whole
    chain), an HTTP proxy the environment names for the endpoint (obstore goes through
    it), or an AWS bucket whose name has dots (no virtual-hosted TLS name for it)."""
    token = None
    if not (key and secret):
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        token = os.environ.get("AWS_SESSION_TOKEN") or None
    if not (key and secret):
        return None
    if not endpoint_url and "." in bucket:  # AWS serves these path-style only: obstore's
        return None
    if proxy_for(endpoint_url or f"https://{bucket}.s3.{region}.amazonaws.com") is not None:
        return None
    creds = Credentials(key, secret, token)
    return HttpRanges(endpoint_url, bucket, creds, region, connect_timeout, read_timeout)
