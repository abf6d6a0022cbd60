"""A small forwarding HTTP proxy on loopback (aiohttp) that records every request it
carries: what tests point HTTP_PROXY / HTTPS_PROXY at to check that a client really goes
through the proxy the environment names, and what it sends (a session token's header).

A request in absolute form (``GET http://host:port/path``, what a client sends to a
proxy) goes to the URL it names; one in origin form (``GET /path``) to ``upstream``, so the
same proxy can also stand in front of a server as its endpoint. Headers pass unchanged but
the hop-by-hop ones (the Host header too, so SigV4 signatures still match). No CONNECT:
the test server speaks plain http.

``resign`` (a key and secret the server knows): for a server that refuses session tokens
it did not issue (SeaweedFS), each request signed with a session token has its signature
checked here (SigV4, botocore's signer, over the headers the client signed: the token
among them, or ``signature_ok`` is False), then the token is taken off and the request
signed again without it before it goes on."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import yarl
from aiohttp import web

from tests.faultproxy import OnItsOwnLoop, end_to_end, forward, relay


@dataclass(frozen=True)
class Seen:
    method: str
    url: str  # as the client asked for it: absolute when it spoke to us as a proxy
    headers: dict[str, str]  # names lower-cased
    signature_ok: bool | None = None  # resign: the client's signature checked (token signed)


def _signed_names(authorization: str) -> list[str]:
    return authorization.partition("SignedHeaders=")[2].partition(",")[0].split(";")


def _check_and_resign(
    method: str, url: str, headers: dict[str, str], body: bytes, key: str, secret: str
) -> tuple[bool, dict[str, str]]:
    """Whether the client's SigV4 signature (with its session token) is right, and the
    headers signed again without the token."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config
    from botocore.credentials import Credentials

    lower = {k.lower(): v for k, v in headers.items()}
    auth = lower["authorization"]
    scope = auth.partition("Credential=")[2].partition(",")[0].split("/")
    region = scope[2]
    names = _signed_names(auth)
    token = lower.get("x-amz-security-token")
    signer = S3SigV4Auth(Credentials(key, secret, token), "s3", region)
    signed = AWSRequest(method, url, headers={n: lower[n] for n in names if n in lower}, data=body)
    signed.context["timestamp"] = lower["x-amz-date"]
    canonical = signer.canonical_request(signed)
    expected = signer.signature(signer.string_to_sign(signed, canonical), signed)
    ok = (
        "x-amz-security-token" in names
        and set(names) <= set(lower)
        and auth.endswith(f"Signature={expected}")
    )
    drop = {"authorization", "x-amz-security-token", "x-amz-date"}
    again = AWSRequest(
        method, url, headers={k: v for k, v in headers.items() if k.lower() not in drop}, data=body
    )
    again.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    S3SigV4Auth(Credentials(key, secret), "s3", region).add_auth(again)
    return ok, dict(again.headers.items())


class ForwardingProxy(OnItsOwnLoop):
    def __init__(
        self, upstream: str | None = None, *, resign: tuple[str, str] | None = None
    ) -> None:
        self.upstream = upstream.rstrip("/") if upstream else None
        self.resign = resign
        self.seen: list[Seen] = []
        super().__init__()

    def __enter__(self) -> ForwardingProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def requests(self, method: str | None = None) -> list[Seen]:
        return [s for s in list(self.seen) if method is None or s.method == method]

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=120)
        )
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        target = request.raw_path if request.raw_path.startswith("/") else str(request.url)
        absolute = not request.raw_path.startswith("/")
        if not absolute and self.upstream is None:
            return web.Response(status=400, text="not a proxy request")
        url = target if absolute else f"{self.upstream}{target}"
        headers = end_to_end(request.headers)
        signature_ok = None
        if self.resign is not None and "x-amz-security-token" in {k.lower() for k in headers}:
            signature_ok, headers = _check_and_resign(
                request.method, url, headers, body, *self.resign
            )
        self.seen.append(
            Seen(
                request.method,
                target,
                {k.lower(): v for k, v in request.headers.items()},
                signature_ok,
            )
        )
        assert self._session is not None
        target_url = yarl.URL(url, encoded=True)  # as the client encoded it: signed that way
        up = await forward(self._session, request.method, target_url, headers, body)
        return await relay(request, up)
