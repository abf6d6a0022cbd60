"""A small async client for the agent's RPC (used by the tests and examples/scale_down.py)."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from agent.rpc.tls import client_context

#: the longest one status request of ``wait_prefetch`` is held by the agent (at most its
#: WAIT_SECONDS, agent/rpc/routes/prefetch.py)
LONG_POLL_SECONDS = 20.0


class BadTokenError(ValueError):
    """The token given is no bearer token (a config file read as the token file?)."""


class RpcError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


_HOST_PORT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}/?")


class FerryClient:
    """One agent's RPC. Over https:// the agent is verified against ``ca_file`` (a PEM
    bundle: the agents' tls_ca_file; None: the system store) and ``cert_file`` (with
    ``key_file``, unless the key is in it) is presented to an agent that requires a client
    certificate (``tls_client_auth``). A URL without a scheme is https:// when either is
    given, else http://."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        ca_file: Path | str | None = None,
        cert_file: Path | str | None = None,
        key_file: Path | str | None = None,
    ) -> None:
        if "://" not in base_url:  # "node-b:7070", as people write it
            if not _HOST_PORT.fullmatch(base_url):  # ("ckpt/store" was asked of host "ckpt")
                raise ValueError(
                    f"agent URL {base_url!r} is not an agent's address: http://HOST:PORT "
                    "(or HOST:PORT)"
                )
            base_url = f"{'https' if ca_file or cert_file else 'http'}://{base_url}"
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"agent URL {base_url!r} is not http:// or https://")
        if not token or not token.isprintable() or any(c.isspace() for c in token):
            # (a config file given as the token file: aiohttp's "Forbidden control character
            # detected in headers. Potential header injection attack." named neither)
            raise BadTokenError(
                "not a bearer token (one word of printable characters): is it the agent's "
                "token_file, holding the token alone?"
            )
        self.base_url = base_url.rstrip("/")
        verify: ssl.SSLContext | bool = True
        if self.base_url.startswith("https://"):
            verify = client_context(ca_file, cert_file, key_file)
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=verify),
        )

    async def __aenter__(self) -> FerryClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        async with self._session.request(method, self.base_url + path, **kwargs) as resp:
            try:
                doc = await resp.json(content_type=None)
            except ValueError:
                doc = {"error": await resp.text()}
            if resp.status >= 400:
                raise RpcError(resp.status, str(doc.get("error", doc)))
            return doc

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/healthz")  # type: ignore[no-any-return]

    async def checkpoints(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/checkpoints")  # type: ignore[no-any-return]

    async def estimate(
        self,
        job: str,
        step: int | str = "latest",
        *,
        gpus: int = 1,
        gpu_hour_price: float = 0,
        layout: tuple[int, list[int]] | None = None,
    ) -> dict[str, Any]:
        """What a prefetch here would cost; ``layout``: of the share those ranks read."""
        params = {
            "job": job,
            "step": str(step),
            "gpus": str(gpus),
            "gpu_hour_price": str(gpu_hour_price),
        }
        if layout is not None:
            params["layout"] = f"{layout[0]}:{','.join(map(str, layout[1]))}"
        return await self._call("GET", "/v1/estimate", params=params)  # type: ignore[no-any-return]

    async def prefetch(
        self,
        job: str,
        step: int | str = "latest",
        deadline_s: float | None = None,
        fanout: tuple[list[str], str] | None = None,
        layout: tuple[int, list[int]] | None = None,
        fanout_layouts: dict[str, tuple[int, list[int]]] | None = None,
    ) -> str:
        """Start a prefetch; ``fanout``: (every member's agent URL, this agent's URL) of a
        fan-out restore (send the same members to each); ``layout``: (world size, ranks
        this node will run): only the share those ranks read; ``fanout_layouts``: each
        fan-out member's layout, by URL (send the same to each)."""
        body: dict[str, Any] = {"job": job, "step": step}
        if layout is not None:
            body["layout"] = {"world_size": layout[0], "ranks": list(layout[1])}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        if fanout is not None:
            body["fanout"] = {"members": list(fanout[0]), "me": fanout[1]}
            if fanout_layouts:
                body["fanout"]["layouts"] = {
                    url: {"world_size": w, "ranks": list(r)}
                    for url, (w, r) in fanout_layouts.items()
                }
        return str((await self._call("POST", "/v1/prefetch", json=body))["id"])

    async def prefetch_status(self, prefetch_id: str, wait: float = 0.0) -> dict[str, Any]:
        """``wait``: the agent answers once the prefetch has ended, or after that long."""
        params = {"wait": f"{wait:.3f}"} if wait > 0 else None
        doc = await self._call("GET", f"/v1/prefetch/{prefetch_id}", params=params)
        return doc  # type: ignore[no-any-return]

    async def cancel_prefetch(self, prefetch_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/prefetch/{prefetch_id}")  # type: ignore[no-any-return]

    async def wait_prefetch(
        self, prefetch_id: str, within_s: float = 600.0, poll: float = 0.1
    ) -> dict[str, Any]:
        """Until the prefetch is ready, failed or cancelled; returns its final state. Each
        request is a long poll (``?wait=``: the agent answers when the prefetch ends, or
        after LONG_POLL_SECONDS); an agent that answers a poll early without an end (one
        from before the long poll) is asked again every ``poll`` seconds."""
        deadline = time.monotonic() + within_s
        longest = min(LONG_POLL_SECONDS, 0.8 * (self._session.timeout.total or 30.0))
        while True:
            wait, asked = max(0.0, min(longest, deadline - time.monotonic())), time.monotonic()
            status = await self.prefetch_status(prefetch_id, wait)
            if status["state"] in ("ready", "failed", "cancelled"):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefetch {prefetch_id} still {status['state']}")
            if time.monotonic() - asked < wait:
                await asyncio.sleep(poll)

    async def standby(
        self, job: str, layout: tuple[int, list[int]] | None = None
    ) -> dict[str, Any]:
        """Make the node a standby for ``job``: it copies each new durable step at once
        (``layout``: only the share those ranks of that world size will read)."""
        body = None
        if layout is not None:
            body = {"layout": {"world_size": layout[0], "ranks": list(layout[1])}}
        return await self._call("PUT", f"/v1/standby/{job}", json=body)  # type: ignore[no-any-return]

    async def pin(self, job: str, step: int, ttl_s: float = 3600) -> dict[str, Any]:
        body = {"job": job, "step": step, "ttl_s": ttl_s}
        return await self._call("POST", "/v1/pins", json=body)  # type: ignore[no-any-return]

    async def unpin(self, job: str, step: int) -> dict[str, Any]:
        params = {"job": job, "step": str(step)}
        return await self._call("DELETE", "/v1/pins", params=params)  # type: ignore[no-any-return]

    async def retention(self, *, dry_run: bool = False) -> dict[str, Any]:
        """The last retention report (``dry_run``: a fresh plan that changes nothing)."""
        query = "?dry_run=1" if dry_run else ""
        doc: dict[str, Any] = await self._call("GET", f"/v1/retention{query}")
        return doc

    async def run_retention(self) -> dict[str, Any]:
        doc: dict[str, Any] = await self._call("POST", "/v1/retention/run")
        return doc
