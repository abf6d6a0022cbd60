"""What the in-process benchmarks share: a SeaweedFS server on loopback with the AWS
environment pointing at it, and real agents (aiohttp apps) started in this process."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from agent.daemon.config import load_config
from agent.rpc.app import create_app
from agent.rpc.appkeys import TLS
from agent.rpc.client import FerryClient
from bench._env import reproduce_command
from tests.s3server import S3Endpoint, S3Server

TOKEN = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def loopback_s3(prefix: str, bind: str = "127.0.0.1") -> Iterator[tuple[Path, S3Endpoint]]:
    """A scratch directory and a running S3 server (its credentials in the environment);
    both are gone afterwards. ``bind``: the server's listening address (0.0.0.0: a client
    in a network namespace reaches it too, bench/shaped_link.py)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    server = S3Server(work / "s3", bind=bind)
    ep = server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID=ep.access_key, AWS_SECRET_ACCESS_KEY=ep.secret_key,
        AWS_ENDPOINT_URL=ep.url, AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    try:
        yield work, ep
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def run_main(
    module: str,
    argv: Sequence[str] | None,
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace, S3Endpoint], Any],
    report: Callable[[Any], str],
) -> None:
    """A loopback benchmark's ``main``: print the command that reproduces it, run it against
    a fresh server, print its report."""
    args = parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    print(reproduce_command([sys.executable, "-m", module, *argv]), flush=True)
    with loopback_s3(f"ferry-{module.rsplit('.', 1)[-1]}-") as (_work, ep):
        doc = run(args, ep)
    print(report(doc), flush=True)


@asynccontextmanager
async def agent(node: str, hot: Path, tier: str, **env: str) -> AsyncIterator[FerryClient]:
    """An agent on a free loopback port with ``FERRY_*`` settings ``env``; yields a client.
    With ``FERRY_TLS_CERT_FILE`` (and the rest) it serves HTTPS and the client verifies it
    against ``FERRY_TLS_CA_FILE``, presenting the agent's own certificate (for mTLS)."""
    port = free_port()
    config = {
        "FERRY_NODE": node,
        "FERRY_HOT_DIR": str(hot),
        "FERRY_TIERS": tier,
        "FERRY_LISTEN": f"127.0.0.1:{port}",
        "FERRY_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
        **env,
    }
    app = create_app(load_config(None, config), TOKEN)
    tls = app[TLS].server_context()
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    cert = {"ca_file": env.get("FERRY_TLS_CA_FILE"), "cert_file": env.get("FERRY_TLS_CERT_FILE"),
            "key_file": env.get("FERRY_TLS_KEY_FILE")} if tls else {}  # fmt: skip
    try:
        async with FerryClient(url, TOKEN, timeout=900, **cert) as client:
            yield client
    finally:
        await runner.cleanup()
