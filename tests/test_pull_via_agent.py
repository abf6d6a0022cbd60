"""`ferry pull` handed to the node's agent over its local socket (agent/cli/viaagent.py,
agent/rpc/routes/pull.py): a real ``ferry agent`` process, a real S3 server, the CLI as a
user runs it.

What a pull through the agent must do: the same bytes as a pull here, proven done by the
agent (the CLI's own credentials are wrong); the same errors and exit codes; a store the
agent does not serve, no agent, or a tuning flag: pulled here after one line; only the
agent's own user on the socket, never over TCP; a caller that goes away cancels it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import adamw_series, tree_bytes
from tests.harness import REPO, TOKEN, Node, make_node, push_series, running

pytestmark = pytest.mark.usefixtures("s3_env")


def ferry_pull(
    url: str,
    dest: Path,
    *flags: str,
    sock: Path | None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI's pull of job llm, as a user runs it (with FERRY_LOCAL_SOCKET when ``sock``)."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    run_env["PYTHONPATH"] = str(REPO)  # (run from another directory: a relative path's test)
    if sock is not None:
        run_env["FERRY_LOCAL_SOCKET"] = str(sock)
    run_env.update(env or {})
    argv = [sys.executable, "-m", "agent", "pull", url, str(dest), "--job", "llm", *flags]
    return subprocess.run(
        argv, env=run_env, capture_output=True, text=True, timeout=120, cwd=cwd or REPO
    )


@pytest.fixture
def series(tmp_path: Path, s3_url: str) -> list[Path]:
    dirs = adamw_series(tmp_path / "saves", 2, mib=2)
    asyncio.run(push_series(s3_url, dirs))
    return dirs


def agent_on(tmp_path: Path, url: str, **extra: str) -> tuple[Node, Path]:
    sock = tmp_path / "run" / "agent.sock"
    return make_node(tmp_path, "a", [url], FERRY_LOCAL_SOCKET=str(sock), **extra), sock


def test_a_pull_through_the_agent_is_the_agents_and_restores_the_step_exactly(
    tmp_path: Path, s3_url: str, series: list[Path]
) -> None:
    node, sock = agent_on(tmp_path, s3_url)
    wrong = {"AWS_SECRET_ACCESS_KEY": "not-the-key"}  # (only the agent can read the store)
    with running(node):
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        got = ferry_pull(s3_url, tmp_path / "k", "--step", "20", "--json", sock=sock, env=wrong)
        assert got.returncode == 0, got.stderr + node.logs()
        doc = json.loads(got.stdout)
        assert doc["through_agent"] == str(sock) and doc["step"] == 20
        assert tree_bytes(tmp_path / "k") == tree_bytes(series[0])
        # holding k: the base is read from this node's disk, by the agent (an absolute path
        # made of a relative one: the agent's working directory is not the caller's)
        got = ferry_pull(s3_url, Path("k1"), "--step", "40", "--base-dir", "k", sock=sock,
                         env=wrong, cwd=tmp_path)  # fmt: skip
        assert got.returncode == 0, got.stderr + node.logs()
        assert "through the agent at" in got.stdout and "chunks reused" in got.stdout
        assert tree_bytes(tmp_path / "k1") == tree_bytes(series[1])
        # its errors are the pull's own, with the same exit codes
        got = ferry_pull(s3_url, tmp_path / "x", "--step", "99", "--json", sock=sock)
        assert got.returncode == 1
        error = json.loads(got.stdout)
        assert error["error_type"] == "CheckpointNotFoundError", error
        assert "steps there: 20, 40" in error["error"]
        got = ferry_pull(s3_url, tmp_path / "x", "--world-size", "2", sock=sock)
        assert got.returncode == 2 and "--world-size W and --ranks" in got.stderr
        assert not (tmp_path / "x").exists()
    assert node.logs(tail=10**6).count("local_pull ") == 4


def test_what_the_agent_does_not_serve_is_pulled_here_after_a_line(
    tmp_path: Path, s3_url: str, series: list[Path]
) -> None:
    node, sock = agent_on(tmp_path, s3_url)
    with running(node):
        other = s3_url.rstrip("/") + "-not-a-tier"
        got = ferry_pull(other, tmp_path / "a", sock=sock)
        assert got.returncode == 1  # pulled here: that store does not exist
        assert "is not a tier of this agent" in got.stderr and "pulling here" in got.stderr
        got = ferry_pull(s3_url, tmp_path / "b", "--step", "20", "--window", "4", sock=sock)
        assert got.returncode == 0, got.stderr
        assert "--window given: pulling here" in got.stderr
        assert "through the agent" not in got.stdout
        assert tree_bytes(tmp_path / "b") == tree_bytes(series[0])
    got = ferry_pull(s3_url, tmp_path / "c", "--step", "20", sock=sock)  # the agent stopped
    assert got.returncode == 0, got.stderr
    assert "no agent answers at FERRY_LOCAL_SOCKET=" in got.stderr
    assert tree_bytes(tmp_path / "c") == tree_bytes(series[0])


def test_only_the_agents_own_user_on_its_socket_may_ask_for_a_pull(
    tmp_path: Path, s3_url: str, series: list[Path]
) -> None:
    # (a directory another user may enter: pytest's own are the user's alone)
    public = Path(tempfile.mkdtemp(prefix="ferry-sock-"))
    public.chmod(0o755)
    sock = public / "agent.sock"
    node = make_node(tmp_path, "a", [s3_url], FERRY_LOCAL_SOCKET=str(sock))
    with running(node), contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, public, True)
        body = json.dumps({"store_url": s3_url, "dest_dir": str(tmp_path / "d"), "job": "llm"})
        request = urllib.request.Request(node.url + "/v1/pull", body.encode(), method="POST")
        request.add_header("Authorization", f"Bearer {TOKEN}")
        with pytest.raises(urllib.error.HTTPError) as refused:  # over TCP, even with the token
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
        assert "local socket" in json.loads(refused.value.read())["error"]
        assert not (tmp_path / "d").exists()
        if os.geteuid() != 0:
            return  # (another user's connection needs root to make)
        sock.chmod(0o666)  # (as if the mode had been widened: the kernel's word still decides)
        got = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(sock)], capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert got.stdout.startswith("403 ") and "agent's own user" in got.stdout


#: connects to the socket as user nobody and prints the status line and body of a GET
_AS_NOBODY = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b"GET /v1/checkpoints HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
data = b"".join(iter(lambda: s.recv(65536), b""))
head, _, body = data.partition(b"\\r\\n\\r\\n")
print(head.split(b" ")[1].decode(), body.decode())
"""


def test_a_caller_that_goes_away_cancels_the_agents_pull(
    tmp_path: Path,
    s3_url: str,
    s3_proxy,
    series: list[Path],  # type: ignore[no-untyped-def]
) -> None:
    node, sock = agent_on(tmp_path, s3_url, FERRY_ENDPOINT_URL=s3_proxy.url)
    with running(node):
        s3_proxy.stall_seconds = 4.0
        s3_proxy.set_faults(1.0, ("stall",))  # every request: the pull hangs at its first
        argv = [sys.executable, "-m", "agent", "pull", s3_url, str(tmp_path / "gone"), "--job",
                "llm", "--step", "20", "--endpoint-url", s3_proxy.url]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "FERRY_LOCAL_SOCKET": str(sock)}
        cli = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while "local_pull " not in node.logs(tail=10**6):
            assert time.monotonic() < deadline, node.logs()
            time.sleep(0.05)
        cli.send_signal(signal.SIGINT)
        assert cli.wait(10) == 130, cli.stderr.read() if cli.stderr else ""
        while "local_pull_cancelled" not in node.logs(tail=10**6):
            assert time.monotonic() < deadline, node.dump()
            time.sleep(0.1)
        assert not (tmp_path / "gone").exists()
        s3_proxy.set_faults(0.0)
        got = ferry_pull(s3_url, tmp_path / "after", "--step", "20", "--endpoint-url",
                         s3_proxy.url, sock=sock)  # fmt: skip
        assert got.returncode == 0 and "through the agent" in got.stdout, got.stderr
        assert tree_bytes(tmp_path / "after") == tree_bytes(series[0])


def test_a_stale_socket_is_replaced_a_live_one_kept_and_a_stopping_agent_removes_its_own(
    tmp_path: Path, s3_url: str
) -> None:
    node, sock = agent_on(tmp_path, s3_url)
    sock.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # (left by an agent that died: nobody listens on it)
    stale.close()
    with running(node):
        (tmp_path / "2").mkdir()
        second = make_node(tmp_path / "2", "b", [s3_url], FERRY_LOCAL_SOCKET=str(sock))
        got = subprocess.run([sys.executable, "-m", "agent", "agent"], env=second.env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert got.returncode == 1
        assert f"local_socket {sock}: another agent serves there" in got.stderr
        assert sock.exists()  # (still the first agent's)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(30) == 0
        assert not sock.exists()  # (an agent that stops removes its socket)
