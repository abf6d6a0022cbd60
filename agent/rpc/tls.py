"""TLS for the agent: its listener's certificate, and the verified contexts of the calls it
and its clients make (docs/SECURITY.md).

With ``tls_cert_file`` and ``tls_key_file`` set the agent serves HTTPS only. Both files are
re-read when they change (their mtimes, sizes and inodes, looked at on every new connection),
so a rotated certificate needs no restart: the TLS handshake of the first connection after
the change already presents the new one (the listener's context hands each connection the
newest context, ``sni_callback``, before the certificate is chosen), connections open before
it keep theirs. A pair that does not load (a key written before its certificate) is not
used: the old one is served until the pair loads.

Outgoing calls (peers, fan-out members, standby replication, estimates' probes) verify the
server against ``tls_ca_file`` (the system store when unset), host name or IP included, and
present the agent's own certificate, which a listener with ``tls_client_auth = true``
requires of every client but a health probe (``/healthz``; the handshake asks for a
certificate and refuses one that does not chain to ``tls_ca_file``, the RPC refuses a
request that came without one: agent/rpc/middleware.py). ``client_context`` is the same
verification for agent/rpc/client.py (``ferry estimate``, examples/scale_down.py).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path

from transfer.errors import FerryError

log = logging.getLogger(__name__)

#: (mtime_ns, size, inode) of each file a context was made from; None: missing
_Stamp = tuple[tuple[int, int, int] | None, ...]


class TlsError(FerryError):
    """The TLS files are missing, unreadable or do not make a usable context."""


def client_context(
    ca_file: Path | str | None = None,
    cert_file: Path | str | None = None,
    key_file: Path | str | None = None,
) -> ssl.SSLContext:
    """A context that verifies servers against ``ca_file`` (a PEM bundle; None: the system
    store), host names and IP addresses included, and presents ``cert_file`` (and
    ``key_file``, unless the key is in the certificate's file) when given."""
    try:
        return _client_context(ca_file, cert_file, key_file)
    except OSError as exc:  # (ssl.SSLError is one)
        raise TlsError(f"cannot load TLS files: {_reason(exc)}") from None


def _client_context(
    ca_file: Path | str | None, cert_file: Path | str | None, key_file: Path | str | None
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        ctx.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
    return ctx


def _server_context(cert: Path, key: Path, ca: Path | None, client_auth: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_auth:
        assert ca is not None  # (config: tls_client_auth needs tls_ca_file)
        ctx.load_verify_locations(cafile=str(ca))
        # asked for in every handshake, verified when sent; a request that came without one
        # is refused by the RPC, all but /healthz (a kubelet's probe presents none)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def https_url(url: str) -> str:
    """``url`` with ``http://`` made ``https://`` (an agent serving TLS serves nothing else)."""
    return "https://" + url[len("http://") :] if url.startswith("http://") else url


class AgentTls:
    """The agent's TLS material: its listener's context and its outgoing calls' context,
    both made again when a file they come from changes. Thread-safe (peer connections are
    made in worker threads, handshakes on the event loop)."""

    def __init__(
        self,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        ca_file: Path | None = None,
        *,
        client_auth: bool = False,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise TlsError("tls_cert_file and tls_key_file go together: set both or neither")
        if client_auth and (cert_file is None or ca_file is None):
            raise TlsError("tls_client_auth needs tls_cert_file, tls_key_file and tls_ca_file")
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self.client_auth = client_auth
        self._files = tuple(p for p in (cert_file, key_file, ca_file) if p is not None)
        self._lock = threading.Lock()
        self._stamp = _stamp(self._files)
        self._failed: _Stamp | None = None  # a change that did not load (logged once)
        try:
            self._server, self._client = self._make()
        except OSError as exc:  # (ssl.SSLError is one)
            raise TlsError(f"cannot load TLS files: {_reason(exc)}") from None
        # the listener's context: each handshake gets the newest one (_hello)
        self._listener = self._server
        if self._listener is not None:
            self._listener.sni_callback = self._hello

    @property
    def serving(self) -> bool:
        """Whether the listener serves TLS (and only TLS)."""
        return self.cert_file is not None

    def server_context(self) -> ssl.SSLContext | None:
        """The listener's context (None: plain HTTP)."""
        return self._listener

    def client_context(self) -> ssl.SSLContext:
        """The context of an outgoing call now: verifies against ``tls_ca_file`` and
        presents this agent's certificate when it has one."""
        return self._current()[1]

    def origin(self, url: str) -> str:
        """Where to connect for a peer named ``url``: https when this agent serves TLS (a
        fleet serves TLS or not as one; the scheduler may still name members http://)."""
        return https_url(url) if self.serving else url

    # -- reloading -----------------------------------------------------------------------

    def _make(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
        server = None
        if self.cert_file is not None and self.key_file is not None:
            server = _server_context(self.cert_file, self.key_file, self.ca_file, self.client_auth)
        return server, _client_context(self.ca_file, self.cert_file, self.key_file)

    def _current(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
        if not self._files:
            return self._server, self._client
        stamp = _stamp(self._files)
        with self._lock:
            if stamp != self._stamp and stamp != self._failed:
                try:
                    self._server, self._client = self._make()
                except OSError as exc:  # (ssl.SSLError is one)
                    self._failed = stamp  # retried when the files change again
                    log.warning("TLS files changed but do not load (%s): still serving the "
                                "previous certificate", _reason(exc))  # fmt: skip
                else:
                    self._stamp, self._failed = stamp, None
                    log.info("TLS files changed: reloaded %s", ", ".join(map(str, self._files)))
            return self._server, self._client

    def _hello(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        """(Every handshake, before the certificate is chosen.) Hand the connection the
        newest context, made again first if a file changed."""
        try:
            server = self._current()[0]
            if server is not None and server is not ctx:
                conn.context = server
        except Exception:  # never fail a handshake over this: it keeps the context it has
            log.exception("TLS reload check failed")


def _stamp(files: tuple[Path, ...]) -> _Stamp:
    out: list[tuple[int, int, int] | None] = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    return " ".join(str(exc).split()) or type(exc).__name__
