"""Agent processes for the prefetch scenarios, and measuring one prefetch through the RPC.

Each agent is a real ``ferry agent`` process (as deployed). A prefetch is timed from the
POST to the moment its status says ready (polled every 20 ms); its CPU seconds are the
agent's utime + stime over that span and its peak RSS the agent's high-water mark over it
(reset just before, through ``/proc/PID/clear_refs``; without that, Linux only knows the
peak since the process started).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._env import ferry_command
from bench._measure import proc_cpu_seconds
from tests.s3server import _pdeathsig_hook

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5\n")
    except OSError:
        return False
    return True


@dataclass
class Agent:
    name: str
    hot: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: the address it listens on, and what its command runs under (``ip netns exec NS``:
    #: an agent behind a shaped link, bench.decision_to_loaded --link)
    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        scheme = "https" if self.env.get("FERRY_TLS_CERT_FILE") else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def _tls(self) -> ssl.SSLContext | None:
        """Over TLS: verified against the agent's CA, presenting its own certificate (which
        an agent with ``tls_client_auth`` requires)."""
        if not self.env.get("FERRY_TLS_CERT_FILE"):
            return None
        ctx = ssl.create_default_context(cafile=self.env.get("FERRY_TLS_CA_FILE"))
        ctx.load_cert_chain(self.env["FERRY_TLS_CERT_FILE"], self.env["FERRY_TLS_KEY_FILE"])
        return ctx

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {TOKEN}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30, context=self._tls()) as resp:
            return json.loads(resp.read())

    def start(self, log: Path, within: float = 60.0) -> None:
        self.launch(log)
        self.wait_healthy(log, within)

    def launch(self, log: Path) -> None:
        self.hot.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "FERRY_LISTEN": f"{self.host}:{self.port}"}
        with log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [*self.wrap, *ferry_command(), "agent"],
                env=env,
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                # dies with the benchmark even when that is SIGKILLed (a CI timeout)
                preexec_fn=_pdeathsig_hook(),
            )

    def wait_healthy(self, log: Path, within: float = 60.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + within
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"agent {self.name} exited: {log.read_text()[-3000:]}")
            try:
                if self.call("GET", "/healthz")["node"] == self.name:
                    return
            except (OSError, urllib.error.URLError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"agent {self.name} not healthy: {log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def wait_pushes_settled(self, job: str, step: int, within: float = 300.0) -> None:
        """Let the watcher see (job, step), which just appeared in the hot dir, and finish
        pushing it: it would otherwise compete with the measured prefetch. (Waiting only
        for "no row still pending" returned before the watcher had even seen the step, and
        the agent waits ``quiet_seconds`` before a push: the push ran during the prefetch.)"""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            rows = self.call("GET", "/v1/pushes")["pushes"]
            seen = any((r["job"], r["step"]) == (job, step) for r in rows)
            if seen and all(r["state"] in ("durable", "failed") for r in rows):
                return
            time.sleep(0.1)
        raise SystemExit(f"agent {self.name}: pushes still running after {within}s")

    def prefetch(self, job: str, step: int) -> dict[str, Any]:
        """Run one prefetch to completion; returns its status plus the measurements."""
        assert self.proc is not None
        pid = self.proc.pid
        reset = reset_peak_rss(pid)
        cpu0 = proc_cpu_seconds(pid)
        t0 = time.perf_counter()
        pid_ = self.call("POST", "/v1/prefetch", {"job": job, "step": step})["id"]
        while True:
            status: dict[str, Any] = self.call("GET", f"/v1/prefetch/{pid_}")
            if status["state"] in ("ready", "failed", "cancelled"):
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        cpu1 = proc_cpu_seconds(pid)
        if status["state"] != "ready":
            raise SystemExit(f"prefetch on {self.name} ended {status['state']}: {status}")
        return {
            "status": status,
            "seconds": seconds,
            "cpu": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            "peak_rss_mb": peak_rss_mb(pid) if reset else None,
        }


def agent_env(
    base: dict[str, str],
    name: str,
    hot: Path,
    tier: str,
    endpoint: str,
    token_file: Path,
    peers: list[str],
) -> dict[str, str]:
    """``base``: the environment with the S3 credentials."""
    env = {k: v for k, v in base.items() if not k.startswith("FERRY_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        FERRY_NODE=name,
        FERRY_HOT_DIR=str(hot),
        FERRY_TIERS=tier,
        FERRY_PEERS=",".join(peers),
        FERRY_TOKEN_FILE=str(token_file),
        FERRY_ENDPOINT_URL=endpoint,
    )
    return env
