"""End to end: ``ferry agent`` as real processes on loopback, against real tiers.

A training job's save is picked up by the node's watcher and pushed; the scheduler's
scale-down (examples/scale_down.py) prefetches it onto the survivors, peer to peer and as a
delta; a real PyTorch DCP save loads back on another node; an agent SIGKILLed in the middle
of a push resumes it; a SIGTERM drains an in-flight prefetch without leaving partial data.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness import REPO, Node, assert_same_tree, make_node, reserve_port, rpc, running
from transfer.engine import PullPlan, TransferOptions, list_checkpoints, pull, push
from transfer.store import StoreOptions, open_store

MiB = 1 << 20
JOB = "llm"
OPTS = TransferOptions(chunk_size=1 * MiB, part_size=5 * MiB, pack_size=10 * MiB)


# ---------------------------------------------------------------------------------------------
# helpers: checkpoint trees, the scheduler's scale-down (agent processes, their RPC: harness)


def save_like_dcp(step_dir: Path, shards: dict[str, np.ndarray]) -> Path:
    """Shards first, then ``.metadata`` (temp file + rename), as DCP's FileSystemWriter does."""
    step_dir.mkdir(parents=True)
    for name, array in shards.items():
        (step_dir / name).write_bytes(array.tobytes())
    tmp = step_dir / ".metadata.tmp"
    tmp.write_bytes(json.dumps({k: [str(v.dtype), v.size] for k, v in shards.items()}).encode())
    os.replace(tmp, step_dir / ".metadata")
    return step_dir


def tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def committed_steps(url: str, job: str) -> list[tuple[int, str]]:
    async def go() -> list[tuple[int, str]]:
        store = open_store(url, StoreOptions())
        try:
            return [(c.step, c.node) for c in await list_checkpoints(store, job)]
        finally:
            await store.close()

    return asyncio.run(go())


def scale_down(
    tmp_path: Path, survivors: list[Node], *extra: str
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(REPO / "examples" / "scale_down.py"), "--job", JOB, *extra]
    argv += ["--survivors", *(n.url for n in survivors), "--token-file", str(tmp_path / "token")]
    argv += ["--timeout", "60", "--poll", "0.2"]
    env = dict(survivors[0].env)
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=90)


def prefetch_ids(stdout: str) -> dict[str, str]:
    """node -> prefetch id, from scale_down's 'prefetching: b=<id>, c=<id>' line."""
    line = re.search(r"^prefetching: (.*)$", stdout, re.MULTILINE)
    assert line, stdout
    return dict(part.split("=", 1) for part in line.group(1).split(", "))


# ---------------------------------------------------------------------------------------------
# 1. scheduler scale-down onto two survivors, then a delta onto one


def test_scheduler_scale_down_onto_two_survivors(s3_url: str, tmp_path: Path) -> None:
    ports = {name: reserve_port() for name in "abc"}
    urls = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    nodes = {
        name: make_node(
            tmp_path,
            name,
            [s3_url],
            port=ports[name],
            FERRY_PEERS=",".join(u for other, u in urls.items() if other != name),
            FERRY_STANDBY_POLL_SECONDS="0.2",
        )
        for name in "abc"
    }
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    rng = np.random.default_rng(20)
    shards = {
        "__0_0.distcp": rng.standard_normal(2 * MiB, dtype=np.float32),  # 8 MiB
        "__1_0.distcp": rng.standard_normal(3 * MiB // 2 + 7, dtype=np.float32),  # ~6 MiB
    }
    with running(a, b, c):
        # the training job on node A saves; A's watcher pushes it
        k20 = save_like_dcp(a.hot / JOB / "step_000020", shards)
        (row,) = a.wait_durable(JOB, 20)
        assert row["tier"] == s3_url and row["node"] == "a"
        assert committed_steps(s3_url, JOB) == [(20, "a")]

        first = scale_down(tmp_path, [b, c])
        assert first.returncode == 0, first.stdout + first.stderr
        assert "COMMIT scale-down" in first.stdout
        assert set(prefetch_ids(first.stdout)) == {"b", "c"}
        for survivor in (b, c):
            assert_same_tree(survivor.hot / JOB / "step_000020", k20)

        # the next save differs in a few floats (two chunks); A pushes it as a delta
        changed = {k: v.copy() for k, v in shards.items()}
        changed["__0_0.distcp"][[10, 5000, 100_000]] += np.float32(1e-3)
        changed["__1_0.distcp"][[3, 77]] *= np.float32(0.5)
        k40 = save_like_dcp(a.hot / JOB / "step_000040", changed)
        (row,) = a.wait_durable(JOB, 40)
        assert row["result"]["base_step"] == 20, row

        second = scale_down(tmp_path, [b])
        assert second.returncode == 0, second.stdout + second.stderr
        assert "COMMIT scale-down" in second.stdout
        assert_same_tree(b.hot / JOB / "step_000040", k40)
        assert not (c.hot / JOB / "step_000040").exists()

        # what B and C restored is never pushed back as their own part
        assert committed_steps(s3_url, JOB) == [(20, "a"), (40, "a")]
        assert b.pushes() == [] and c.pushes() == []

        status = rpc(b.url, "prefetch_status", prefetch_ids(second.stdout)["b"])
        assert status["state"] == "ready" and status["step"] == 40, status
        total = tree_size(k40)
        moved = sum(status["bytes_by_source"].values())
        # B held step 20: only the two changed 1 MiB chunks (or their deltas) moved
        assert 0 < moved <= 2 * MiB + 64 * 1024, status
        assert moved < total // 5, (moved, total)
        assert status["chunks_local"] >= total // MiB - 2, status

        # ahead of the next decision the scheduler makes C a standby: A's next save is
        # copied there as soon as it is durable, and the scale-down finds it waiting
        ahead = scale_down(tmp_path, [c], "--register-standby")
        assert ahead.returncode == 0 and "standby for" in ahead.stdout, ahead.stdout
        changed["__0_0.distcp"][[7]] -= np.float32(1e-3)
        k60 = save_like_dcp(a.hot / JOB / "step_000060", changed)
        a.wait_durable(JOB, 60)
        deadline = time.monotonic() + 60
        while rpc(c.url, "_call", "GET", "/v1/standby")["jobs"][0]["replicated_step"] != 60:
            assert time.monotonic() < deadline, "step 60 never reached the standby"
            time.sleep(0.1)
        third = scale_down(tmp_path, [c])
        assert third.returncode == 0 and "COMMIT scale-down" in third.stdout, third.stdout
        assert re.search(r"\breplica\b", third.stdout), third.stdout
        assert_same_tree(c.hot / JOB / "step_000060", k60)


# ---------------------------------------------------------------------------------------------
# 2. a real PyTorch DCP save on node A loads bit-exactly from node B's prefetched copy


def test_torch_dcp_through_the_agents(local_url: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")

    def model_and_opt() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 256)
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model: Any, opt: Any, steps: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            loss = model(torch.randint(0, 256, (8, 16), generator=gen)).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    a = make_node(tmp_path, "a", [local_url])
    b = make_node(tmp_path, "b", [local_url], FERRY_PEERS=a.url)
    with running(a, b):
        model, opt = model_and_opt()
        train(model, opt, 20, seed=1)
        src = a.hot / JOB / "step_000020"
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)))
        assert (src / ".metadata").is_file()
        a.wait_durable(JOB, 20)

        done = rpc(b.url, "prefetch_and_wait", JOB, 20, within_s=60)
        assert done["state"] == "ready", done
        dest = Path(done["dest"])
        assert dest == b.hot / JOB / "step_000020"
        assert_same_tree(dest, src)

        fresh, fresh_opt = model_and_opt()
        train(fresh, fresh_opt, 1, seed=99)  # materialise optimizer state to load into
        loaded = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(dest)))
        fresh.load_state_dict(loaded["model"])
        fresh_opt.load_state_dict(loaded["optim"])

        want = model.state_dict()
        assert set(fresh.state_dict()) == set(want)
        for name, tensor in want.items():
            assert torch.equal(fresh.state_dict()[name], tensor), name
        want_opt, got_opt = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        assert set(got_opt) == set(want_opt) and want_opt
        for pid, moments in want_opt.items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got_opt[pid][key], moments[key]), (pid, key)


# ---------------------------------------------------------------------------------------------
# 3. SIGKILL in the middle of a push: the restarted agent resumes it from its journal


def test_sigkilled_agent_resumes_its_push(local_url: str, tmp_path: Path) -> None:
    a = make_node(tmp_path, "a", [local_url])
    rng = np.random.default_rng(3)
    with running(a):
        src = save_like_dcp(
            a.hot / JOB / "step_000020",
            {
                f"__{r}_0.distcp": rng.standard_normal(10_000_000, dtype=np.float32)
                for r in range(3)
            },
        )
        deadline = time.monotonic() + 30
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = [r for r in a.pushes() if r["step"] == 20]
            if rows:
                break
            time.sleep(0.02)
        assert rows, f"the watcher never staged the checkpoint:\n{a.logs()}"
        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        (row,) = rows
        caught_in_flight = row["state"] == "staged"
        if caught_in_flight:
            # killed before its commit: the manifest (written last) is not there
            assert committed_steps(local_url, JOB) == []
        else:  # the push beat the poll; the rest still checks the final state
            assert row["state"] == "durable", row

        a.start()  # same env, same state dir: the journal resumes what was staged
        (row,) = a.wait_durable(JOB, 20)
        assert row["path"] == str(src)
        if caught_in_flight:
            assert row["attempts"] >= 1 and row["result"]["bytes_raw"] == tree_size(src)
        assert committed_steps(local_url, JOB) == [(20, "a")]

    async def restore(dest: Path) -> None:
        store = open_store(local_url, StoreOptions())
        try:
            await pull(store, dest, PullPlan(JOB, 20), options=OPTS)
        finally:
            await store.close()

    out = tmp_path / "restored"
    asyncio.run(restore(out))
    assert_same_tree(out, src)
    leftovers = [
        p.relative_to(local_url).as_posix()
        for p in (Path(local_url) / "manifests").rglob("*")
        if ".tmp-" in p.name or "staging" in p.name
    ]
    assert not leftovers


# ---------------------------------------------------------------------------------------------
# 4. SIGTERM while a prefetch runs: drain, exit 0, no partial checkpoint and no staging


@pytest.mark.parametrize("drain_seconds", [20, 0])
def test_sigterm_drains_an_inflight_prefetch(
    local_url: str, tmp_path: Path, drain_seconds: int
) -> None:
    rng = np.random.default_rng(4)
    src = save_like_dcp(
        tmp_path / "node-a" / JOB / "step_000020",
        {f"__{r}_0.distcp": rng.standard_normal(12_500_000, dtype=np.float32) for r in range(2)},
    )  # 100 MB

    async def publish() -> None:
        store = open_store(local_url, StoreOptions())
        try:
            await push(store, src, job=JOB, step=20, node="a", options=OPTS)
        finally:
            await store.close()

    asyncio.run(publish())
    # one range in flight and one worker: the prefetch takes long enough to be interrupted
    b = make_node(
        tmp_path,
        "b",
        [local_url],
        FERRY_DRAIN_SECONDS=str(drain_seconds),
        FERRY_TRANSFER_WINDOW="1",
        FERRY_TRANSFER_WORKERS="1",
    )
    dest = b.hot / JOB / "step_000020"
    with running(b):
        pid = rpc(b.url, "prefetch", JOB, 20)
        deadline = time.monotonic() + 30
        while True:
            status = rpc(b.url, "prefetch_status", pid)
            moving = status["state"] == "running" and status["bytes_done"] > 0
            if moving or status["state"] in ("ready", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.02)
        assert status["state"] in ("running", "ready"), status
        assert b.proc is not None
        began = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        rc = b.proc.wait(drain_seconds + 15)
        took = time.monotonic() - began
        assert rc == 0, b.logs()
        assert took < drain_seconds + 5, (took, b.logs())
        assert "draining" in b.logs()

    if dest.exists():
        assert_same_tree(dest, src)
    job_dir = b.hot / JOB
    stray = [p.name for p in job_dir.iterdir() if p != dest] if job_dir.exists() else []
    stray = [n for n in stray if n != ".step_000020.ferry-unsynced"]  # (settle.py's marker)
    if not dest.exists():  # cut off by the drain: nothing partial, its staging kept...
        assert len(stray) <= 1 and all(".ferry-staging-" in n for n in stray), stray
        with running(b):  # ...for the prefetch after the restart, which resumes from it
            status = rpc(b.url, "prefetch_and_wait", JOB, 20, within_s=120)
        assert status["state"] == "ready", status
        assert_same_tree(dest, src)
        stray = [p.name for p in job_dir.iterdir() if p != dest and "unsynced" not in p.name]
    assert not stray, stray  # nothing left beside the checkpoint
    if drain_seconds == 20 and status["bytes_done"] < status["bytes_total"]:
        # 100 MB from a local store take far less than 20 s: the drain let it finish
        assert dest.is_dir(), b.logs()
