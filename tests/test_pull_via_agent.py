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
import threading
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
        # the flags the agent takes reach it: a node's part, a knob only pushes read
        got = ferry_pull(s3_url, tmp_path / "k2", "--step", "40", "--node", "zz", "--zstd-level",
                         "9", "--json", sock=sock, env=wrong)  # fmt: skip
        assert got.returncode == 1 and "zz" in json.loads(got.stdout)["error"], got.stdout
        # its errors are the pull's own, with the same exit codes
        got = ferry_pull(s3_url, tmp_path / "x", "--step", "99", "--json", sock=sock)
        assert got.returncode == 1
        error = json.loads(got.stdout)
        assert error["error_type"] == "CheckpointNotFoundError", error
        assert "steps there: 20, 40" in error["error"]
        got = ferry_pull(s3_url, tmp_path / "x", "--world-size", "2", sock=sock)
        assert got.returncode == 2 and "--world-size W and --ranks" in got.stderr
        # a bad value of a knob only pushes read is the usage error it is in a pull here
        got = ferry_pull(s3_url, tmp_path / "x", "--zstd-level", "1000", sock=sock)
        assert got.returncode == 2 and "zstd" in got.stderr, got.stderr
        assert not (tmp_path / "x").exists()
    assert node.logs(tail=10**6).count("local_pull ") == 5


def test_the_agents_own_copy_of_an_earlier_step_is_the_base_when_the_caller_gives_none(
    tmp_path: Path, s3_url: str, series: list[Path]
) -> None:
    """The agent's hot dir holds step 20 (as training saved it there): a pull of step 40
    through the agent reads what it can there, as its prefetches do, and fetches the rest;
    a base the caller names is used as named."""
    node, sock = agent_on(tmp_path, s3_url, FERRY_QUIET_SECONDS="3600")
    shutil.copytree(series[0], node.hot / "llm" / series[0].name)
    with running(node):
        cold = ferry_pull(s3_url, tmp_path / "cold", "--step", "40", "--json", sock=None)
        got = ferry_pull(s3_url, tmp_path / "k1", "--step", "40", "--json", sock=sock)
        assert got.returncode == 0, got.stderr + node.logs()
        doc = json.loads(got.stdout)
        assert doc["through_agent"] == str(sock)
        assert doc["base_dir"] == str(node.hot / "llm" / series[0].name)
        assert doc["chunks_local"] + doc["bases_local"] > 0, doc
        assert doc["bytes_transferred"] < json.loads(cold.stdout)["bytes_transferred"]
        assert tree_bytes(tmp_path / "k1") == tree_bytes(series[1])
        # the step itself held: nothing to fetch at all
        got = ferry_pull(s3_url, tmp_path / "k", "--step", "20", "--json", sock=sock)
        doc = json.loads(got.stdout)
        assert doc["bytes_transferred"] == 0 and doc["chunks_local"] > 0, doc
        assert tree_bytes(tmp_path / "k") == tree_bytes(series[0])
        # "latest" is the store's (40): the base is taken at or before it, not a newer save
        # of this node's that is not in the store yet
        shutil.copytree(series[1], node.hot / "llm" / "step_000060")
        got = ferry_pull(s3_url, tmp_path / "latest", "--json", sock=sock)
        doc = json.loads(got.stdout)
        assert doc["step"] == 40 and doc["base_dir"] == str(node.hot / "llm" / series[0].name)
        # the caller's own base wins (an empty one: everything fetched)
        (tmp_path / "step_000010").mkdir()
        got = ferry_pull(s3_url, tmp_path / "k2", "--step", "40", "--json", "--base-dir",
                         str(tmp_path / "step_000010"), sock=sock)  # fmt: skip
        doc = json.loads(got.stdout)
        assert doc["base_dir"] == str(tmp_path / "step_000010") and doc["chunks_local"] == 0


def test_what_the_agent_does_not_serve_is_pulled_here_after_a_line(
    tmp_path: Path,
    s3_url: str,
    s3_proxy,
    series: list[Path],  # type: ignore[no-untyped-def]
) -> None:
    node, sock = agent_on(tmp_path, s3_url)
    with running(node):
        other = s3_url.rstrip("/") + "-not-a-tier"
        got = ferry_pull(other, tmp_path / "a", sock=sock)
        assert got.returncode == 1  # pulled here: that store does not exist
        assert "is not a tier of this agent" in got.stderr and "pulling here" in got.stderr
        # the same bucket and prefix behind another endpoint is another store to the agent
        got = ferry_pull(s3_url, tmp_path / "p", "--step", "20", "--endpoint-url", s3_proxy.url,
                         sock=sock)  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert "is a tier of this agent at the S3 endpoint" in got.stderr, got.stderr
        assert "through the agent" not in got.stdout and s3_proxy.stats.by_method["GET"] > 0
        got = ferry_pull(s3_url, tmp_path / "b", "--step", "20", "--window", "4", sock=sock)
        assert got.returncode == 0, got.stderr
        assert "--window given: pulling here" in got.stderr
        assert "through the agent" not in got.stdout
        assert tree_bytes(tmp_path / "b") == tree_bytes(series[0])
    got = ferry_pull(s3_url, tmp_path / "c", "--step", "20", sock=sock)  # the agent stopped
    assert got.returncode == 0, got.stderr
    assert "no agent of this user answers at FERRY_LOCAL_SOCKET=" in got.stderr
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
        # the socket serves the pull alone: the rest of the API needs the token, over TCP
        assert _over_socket(sock, "GET", "/v1/checkpoints")[0] == 403
        assert not (tmp_path / "d").exists()
        if os.geteuid() != 0:
            return  # (another user's connection needs root to make: the next test fakes it)
        sock.chmod(0o666)  # (as if the mode had been widened: the kernel's word still decides)
        got = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(sock), body], capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert got.stdout.startswith("403 ") and "agent's own user" in got.stdout
        assert not (tmp_path / "d").exists()


def test_the_middleware_refuses_every_other_uid_on_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uid check without root: the agent's uid made another than this process's."""
    from aiohttp import web

    from agent.rpc import middleware
    from agent.rpc.appkeys import REFUSALS
    from agent.rpc.auth import Refusals

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def go() -> list[int]:
        app = web.Application(middlewares=[middleware.auth_middleware])
        app[REFUSALS] = Refusals()
        app.add_routes([web.post("/v1/pull", ok), web.get("/v1/checkpoints", ok)])
        runner = web.AppRunner(app)
        await runner.setup()
        path = tmp_path / "s.sock"
        await web.UnixSite(runner, str(path)).start()
        try:
            codes = [
                (await asyncio.to_thread(_over_socket, path, "POST", "/v1/pull"))[0],
                (await asyncio.to_thread(_over_socket, path, "GET", "/v1/checkpoints"))[0],
            ]
            monkeypatch.setattr(middleware.os, "geteuid", lambda: os.getuid() + 1)
            codes.append((await asyncio.to_thread(_over_socket, path, "POST", "/v1/pull"))[0])
            return codes
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == [200, 403, 403]


def _over_socket(path: Path, method: str, route: str, body: str = "{}") -> tuple[int, str]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(f"{method} {route} HTTP/1.0\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                  f"\r\n{body}".encode())  # fmt: skip
        data = b"".join(iter(lambda: s.recv(65536), b""))
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), rest.decode()


#: connects to the socket as user nobody, asks for a pull, prints the status and the body
_AS_NOBODY = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
body = sys.argv[2].encode()
head = b"POST /v1/pull HTTP/1.0\\r\\nHost: x\\r\\nContent-Length: %d\\r\\n\\r\\n"
s.sendall(head % len(body) + body)
data = b"".join(iter(lambda: s.recv(65536), b""))
head, _, rest = data.partition(b"\\r\\n\\r\\n")
print(head.split(b" ")[1].decode(), rest.decode())
"""


def test_a_caller_that_goes_away_cancels_the_agents_pull_and_the_next_resumes_it(
    tmp_path: Path,
    s3_url: str,
    s3_proxy,
    series: list[Path],  # type: ignore[no-untyped-def]
) -> None:
    node, sock = agent_on(tmp_path, s3_url, FERRY_ENDPOINT_URL=s3_proxy.url)
    flags = ("--step", "20", "--endpoint-url", s3_proxy.url)
    with running(node):
        s3_proxy.stall_seconds = 3.0
        s3_proxy.set_faults(1.0, ("stall",), only="/packs/")  # the step's data: every read
        argv = [sys.executable, "-m", "agent", "pull", s3_url, str(tmp_path / "gone"), "--job",
                "llm", *flags]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "FERRY_LOCAL_SOCKET": str(sock)}
        cli = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not list(tmp_path.glob(".gone.ferry-staging-*")):  # (the pull has begun)
            assert time.monotonic() < deadline, node.logs()
            time.sleep(0.05)
        cli.send_signal(signal.SIGINT)
        assert cli.wait(10) == 130, cli.stderr.read() if cli.stderr else ""
        while "local_pull_cancelled" not in node.logs(tail=10**6):
            assert time.monotonic() < deadline, node.dump()
            time.sleep(0.05)
        s3_proxy.set_faults(0.0)
        # at once: the agent's pull may still be cleaning up; this one waits for it, then
        # takes up the staging it left, as a pull here would
        got = ferry_pull(s3_url, tmp_path / "gone", *flags, sock=sock)
        assert got.returncode == 0 and "through the agent" in got.stdout, got.stderr
        assert tree_bytes(tmp_path / "gone") == tree_bytes(series[0])
        assert not list(tmp_path.glob(".gone.ferry-staging-*"))  # (none left behind)
    assert "ERROR" not in node.logs(tail=10**6)  # (a caller gone is no error of the agent's)


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_an_agent_stopping_mid_pull_leaves_it_to_the_caller(
    how: str,
    tmp_path: Path,
    s3_url: str,
    s3_proxy,  # type: ignore[no-untyped-def]
    series: list[Path],
) -> None:
    node, sock = agent_on(tmp_path, s3_url, FERRY_ENDPOINT_URL=s3_proxy.url,
                          FERRY_DRAIN_SECONDS="2")  # fmt: skip
    with running(node):
        s3_proxy.stall_seconds = 2.0
        s3_proxy.set_faults(1.0, ("stall",), only="/packs/")
        argv = [sys.executable, "-m", "agent", "pull", s3_url, str(tmp_path / "d"), "--job",
                "llm", "--step", "20", "--endpoint-url", s3_proxy.url]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "FERRY_LOCAL_SOCKET": str(sock)}
        cli = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
        deadline = time.monotonic() + 20
        while not list(tmp_path.glob(".d.ferry-staging-*")):
            assert time.monotonic() < deadline, node.logs()
            time.sleep(0.05)
        assert node.proc is not None
        if how == "killed":
            node.proc.kill()
            assert node.proc.wait(30) == -signal.SIGKILL
        else:
            node.proc.send_signal(signal.SIGTERM)
            while "local_pull_cancelled" not in node.logs(tail=10**6):
                assert time.monotonic() < deadline, node.logs()
                time.sleep(0.05)
        s3_proxy.set_faults(0.0)
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        said = "the agent is stopping" if how == "stopped" else "without an answer"
        assert said in err and "pulling here" in err, err
        assert "through the agent" not in out
        assert tree_bytes(tmp_path / "d") == tree_bytes(series[0])
        assert node.proc.wait(30) in (0, -signal.SIGKILL)


def test_an_agent_that_stopped_as_its_pull_ended_leaves_the_check_to_the_caller(
    tmp_path: Path, s3_url: str, series: list[Path]
) -> None:
    """The agent's pull renamed the step into place as the agent stopped: it answers
    ``AgentStoppedAfterPull`` without counts. The CLI said "pulled" with none; now it pulls
    here, which finds the step whole, every chunk checked, and says so with its counts.
    (That race cannot be made to order: a stand-in of the agent's own user gives the
    answer on the socket, after the step was pulled into place.)"""
    dest = tmp_path / "d"
    assert ferry_pull(s3_url, dest, "--step", "20", sock=None).returncode == 0
    sock = tmp_path / "run" / "agent.sock"
    sock.parent.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    sock.chmod(0o600)
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1 << 16)  # (the request: one read holds it)
            line = {"error": "the agent stopped as its pull ended: it is whole there",
                    "type": "AgentStoppedAfterPull"}  # fmt: skip
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/x-ndjson\r\n\r\n"
                         + json.dumps(line).encode() + b"\n")  # fmt: skip

    stand_in = threading.Thread(target=answer)
    stand_in.start()
    try:
        got = ferry_pull(s3_url, dest, "--step", "20", "--json", sock=sock)
    finally:
        stand_in.join(30)
        server.close()
    assert got.returncode == 0, got.stderr
    assert "stopped as its pull ended" in got.stderr and "checking" in got.stderr, got.stderr
    doc = json.loads(got.stdout)
    assert doc["already_there"] is True and doc["bytes_transferred"] == 0, doc
    assert doc["chunks_total"] > 0 and "through_agent" not in doc
    assert tree_bytes(dest) == tree_bytes(series[0])


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
        last = got.stderr.strip().splitlines()[-1]  # (one line: the agent's start-up log before)
        assert "Traceback" not in got.stderr and last.startswith("ferry agent: error: local_socket")
        assert sock.exists()  # (still the first agent's)
        open_dir = tmp_path / "open"
        open_dir.mkdir(mode=0o777)
        open_dir.chmod(0o777)  # (past the umask: anyone may write in it)
        third = make_node(tmp_path / "2", "c", [s3_url],
                          FERRY_LOCAL_SOCKET=str(open_dir / "a.sock"))  # fmt: skip
        got = subprocess.run([sys.executable, "-m", "agent", "agent"], env=third.env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert got.returncode == 1 and "other users may write into" in got.stderr, got.stderr
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(30) == 0
        assert not sock.exists()  # (an agent that stops removes its socket)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("s3://bkt/p", "s3://bkt/p/", True),
        ("s3://bkt/p", "s3://bkt/p-other", False),
        ("s3://bkt/p", "s3://other/p", False),
        ("gs://bkt/x/../p", "gs://bkt/p", False),  # (not local: compared exactly)
        ("/tmp/store", "file:///tmp/store", True),
        ("/tmp/store/", "/tmp/x/../store", True),
        ("file://otherhost/tmp/store", "/tmp/store", False),  # (a host: not this node's)
        ("file://localhost/tmp/a%20b", "/tmp/a b", True),  # (as open_store reads them)
        ("file://../tmp/store", "/tmp/store", False),
        ("file:///tmp/gs:/bkt/p", "gs://bkt/p", False),
        ("relative/store", "/tmp/relative/store", False),  # (the CLI sends absolute paths)
        # an agent's own relative tier: from its working directory, as its pushes take it
        ("rel/store", os.path.join(os.getcwd(), "rel/store"), True),
    ],
)
def test_which_store_urls_name_the_same_tier(a: str, b: str, same: bool) -> None:
    from agent.rpc.routes.pull import same_store

    assert same_store(a, b) is same and same_store(b, a) is same


def test_the_destination_is_seen_through_existing_names_only(tmp_path: Path) -> None:
    """What the caller sends the agent to compare: a missing name is climbed past, a link
    that leads nowhere is not (the agent could see it lead somewhere)."""
    from agent.cli.viaagent import nearest_dir

    st = tmp_path.stat()
    assert nearest_dir(str(tmp_path / "a" / "b" / "dest")) == [str(tmp_path), st.st_dev, st.st_ino]
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        nearest_dir(str(tmp_path / "link" / "dest"))


def test_pulls_into_one_destination_take_turns_and_leave_no_lock_behind() -> None:
    from agent.rpc.limits import DestLocks

    async def go() -> None:
        locks, order = DestLocks(), []

        async def pull(name: str, hold: float) -> None:
            assert await locks.acquire("/d/k", 5.0)
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")
            locks.release("/d/k")

        await asyncio.gather(pull("a", 0.05), pull("b", 0.01), pull("c", 0.0))
        assert order == ["a in", "a out", "b in", "b out", "c in", "c out"]
        assert await locks.acquire("/d/k", 1.0)
        assert not await locks.acquire("/d/k", 0.05)  # (taken: the caller is told)
        locks.release("/d/k")
        assert len(locks) == 0  # (forgotten once nobody holds or waits)

    asyncio.run(go())
