"""Soak (issue 29, "a daemon that grows forever"): one real ``ferry agent`` process serves
2,000 prefetches of small steps through its RPC (prefetches of other steps restored into
its hot dir, repeated prefetches of steps it holds, and standby replications of each new
step pushed to its store), and what it holds stays flat: its RSS, the prefetch records it
keeps (``Prefetcher.HISTORY``), /metrics, its fds and threads, and its hot dir (hot
retention, ``hot_keep_last``). docs/RELIABILITY.md, "Bounded state", lists the bounds.

The other tests here are what the soak found, each small enough for the fast tier: a
prefetch whose base hot retention evicted mid-restore, counters of /metrics that went
down once the oldest records were forgotten, and what a restore looked like kept after
its directory was evicted (two settles of one directory at once: tests/test_settle.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from agent.daemon.config import RetentionSettings
from agent.node import hotretention
from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import HotDir
from agent.node.journal import Journal
from agent.node.prefetch import Prefetcher, PrefetchJob, PrefetchLinks, State
from agent.node.protected import ProtectedSteps, StepHolds
from agent.node.retention_loop import RetentionRunner
from agent.rpc.metrics import Metrics
from tests.conftest import open_test_store
from tests.harness import TOKEN, Node, agent, make_node, running
from transfer.engine import TransferOptions, push
from transfer.format import layout
from transfer.store import open_store
from transfer.store.base import Store

JOB = "llm"
TOTAL = 2_000  # prefetch records: RPC prefetches and standby replications
MARKS = (500, 1_000, 1_500, 2_000)  # sampled once this many records were made
HISTORY = Prefetcher.HISTORY  # 1,000, as docs/openapi.yaml says
#: older steps (milestones: the store keeps every 1,000th), prefetched again and again
SEEDS = tuple(range(1_000, 10_001, 1_000))
FIRST_NEW = 10_001  # the steps pushed during the soak, each replicated by the standby
#: the agent's retention: the hot dir keeps its newest two steps; the store its newest three
#: and its milestones (each run also collects the packs of expired steps)
RETENTION = """
[retention]
interval_seconds = 0.5
grace_seconds = 2
hot_keep_last = 2

[[retention.tiers]]
keep_last = 3
keep_every = 1000
"""
POLL = 0.02  # seconds between looks at the unfinished prefetches of a batch
OPTS = TransferOptions(chunk_size=64 << 10, part_size=256 << 10, pack_size=1 << 20)
KiB, MiB = 1 << 10, 1 << 20
#: RSS the agent may gain between the 1,000 and the 2,000 marks. Measured: 0.6-0.8 MiB alone
#: (the allocator settling; 0.2 MiB from 1,500 on), but 1.5-1.7 MiB with the machine's other
#: core busy (a CPU hog, or the suite's other worker): 1.52 and 1.58 MiB at 811cf57, whose CI
#: passed, 1.61-1.74 MiB at 4beef01 (2026-12-06), so 1.5 MiB failed on load, not on a leak.
#: The same soak with every record kept (HISTORY raised to 10**9, so each prefetch leaves its
#: record and task behind, ~1.7 KiB) gains 2.5 MiB there: a leak of an object of a few KiB
#: per prefetch adds 2-5 MiB, above this bound.
RSS_GROWTH_KIB = 2_048


def step_files(root: Path, step: int, size: int = 4 * KiB) -> Path:
    """A tiny DCP-shaped save: two shards and a .metadata (about 6 KB by default)."""
    rng = random.Random(step)
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(rng.randbytes(size))
    (d / "__1_0.distcp").write_bytes(rng.randbytes(size // 2))
    (d / ".metadata").write_bytes(b"dcp-" + str(step).encode())
    return d


async def push_step(store_url: str, src: Path, step: int, size: int = 4 * KiB) -> None:
    store = open_store(store_url)
    try:
        await push(store, step_files(src, step, size), job=JOB, step=step, node="a", options=OPTS)
    finally:
        await store.close()


@dataclass
class Sample:
    records: int
    rss_kib: int
    threads: int
    fds: int
    metrics_bytes: int
    metrics_series: int
    #: prefetch records the agent keeps, by state (ferry_prefetch_total)
    remembered: dict[str, int]
    counters: dict[str, float]  # ferry_prefetch_bytes_total, ferry_prefetch_seconds_total
    standby_bytes: int  # GET /v1/standby
    checkpoints_bytes: int  # GET /v1/checkpoints (the store's steps, and which are here)
    checkpoints_steps: int
    hot_steps: int  # step directories in the hot dir
    oldest_known: bool  # GET /v1/prefetch/{the first id} answers 200 (else 404)
    newest_known: bool


def _proc(pid: int) -> tuple[int, int, int]:
    """VmRSS (KiB), threads and open fds of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    assert rss and threads, status
    return int(rss.group(1)), int(threads.group(1)), len(os.listdir(f"/proc/{pid}/fd"))


def _series(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@dataclass
class Driver:
    """The scheduler's side: the agent's RPC over one keep-alive session."""

    node: Node
    session: aiohttp.ClientSession
    outcomes: dict[str, int] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        async with self.session.request(method, self.node.url + path, **kw) as r:
            assert r.status < 400, (r.status, await r.text())
            return await r.json()

    async def prefetches(self, steps: list[int | str]) -> None:
        """Ask for all of them at once and wait until each is ready (polling the newest
        until it is finished, then the others: they finish about in order)."""
        pending = []
        for step in steps:
            body = {"job": JOB, "step": step}
            pending.append((await self.call("POST", "/v1/prefetch", json=body))["id"])
        self.ids += pending
        deadline = time.monotonic() + 60
        while pending:
            await asyncio.sleep(POLL)
            for pid in pending[::-1]:
                doc: dict[str, Any] = await self.call("GET", f"/v1/prefetch/{pid}")
                if doc["state"] in ("queued", "running"):
                    if time.monotonic() > deadline:
                        await self.stuck(pending)
                    break
                assert doc["state"] == "ready", f"{doc}\n{self.node.logs()}"
                self._count(doc["satisfied_by"])
                pending.remove(pid)

    async def stuck(self, pending: list[str]) -> None:
        """Fail with what the agent was doing and what each unfinished prefetch says (the
        dump first: with its loop blocked, the agent would not answer)."""
        dump = await asyncio.to_thread(self.node.dump)
        docs = []
        for pid in pending:
            async with asyncio.timeout(5):
                docs.append(await self.call("GET", f"/v1/prefetch/{pid}"))
        pytest.fail(f"prefetches unfinished after 60 s: {docs}\n{dump}")

    async def replicated(self, step: int) -> None:
        """Until the standby replicated ``step`` (one background prefetch)."""
        deadline = time.monotonic() + 60
        while True:
            entry: dict[str, Any] = (await self.call("GET", "/v1/standby"))["jobs"][0]
            if entry["replicated_step"] == step:
                last = entry["last_replication"]
                assert last is not None and last["state"] == "ready", entry
                self._count("standby:" + last["satisfied_by"])
                return
            assert time.monotonic() < deadline, f"{step} never replicated: {entry}"
            await asyncio.sleep(0.01)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def known(self, pid: str) -> bool:
        async with self.session.get(f"{self.node.url}/v1/prefetch/{pid}") as r:
            assert r.status in (200, 404), r.status
            return r.status == 200

    async def sample(self, records: int) -> Sample:
        assert self.node.proc is not None
        async with self.session.get(self.node.url + "/metrics") as r:
            text = await r.text()
        series = _series(text)
        remembered = {  # by state
            k.split('"')[1]: int(v)
            for k, v in series.items()
            if k.startswith("ferry_prefetch_total")
        }
        counters = {
            k.split("{")[0]: v
            for k, v in series.items()
            if k.startswith(("ferry_prefetch_bytes_total", "ferry_prefetch_seconds_total"))
        }
        async with self.session.get(self.node.url + "/v1/standby") as r:
            standby = len(await r.read())
        async with self.session.get(self.node.url + "/v1/checkpoints") as r:
            listing = await r.read()
        steps = len(json.loads(listing)["jobs"][JOB])
        rss, threads, fds = _proc(self.node.proc.pid)
        hot = [p for p in (self.node.hot / JOB).iterdir() if p.name.startswith("step_")]
        first, last = await self.known(self.ids[0]), await self.known(self.ids[-1])
        return Sample(
            records, rss, threads, fds, len(text.encode()), len(series), remembered, counters,
            standby, len(listing), steps, len(hot), first, last,
        )  # fmt: skip


async def soak(node: Node, store_url: str, src: Path) -> tuple[list[Sample], Driver]:
    """TOTAL prefetch records on ``node`` (running), in rounds of ten: a new step pushed and
    replicated by the standby, then nine RPC prefetches at once: "latest" (the replica)
    three times, a seed step three times (one restores it if hot retention evicted it
    since, the others find it held), another seed step three times."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        d = Driver(node, session)
        await d.call("PUT", f"/v1/standby/{JOB}")
        await d.replicated(SEEDS[-1])
        samples: list[Sample] = []
        records, r = 1, 0
        while records < TOTAL:
            new = FIRST_NEW + r
            await push_step(store_url, src, new)
            await d.replicated(new)
            again, other = SEEDS[r % len(SEEDS)], SEEDS[(r * 3 + 1) % len(SEEDS)]
            await d.prefetches(["latest"] * 3 + [again] * 3 + [other] * 3)
            records, r = records + 10, r + 1
            if len(samples) < len(MARKS) and records >= MARKS[len(samples)]:
                samples.append(await d.sample(records))
        return samples, d


def _why_left(job_dir: Path, left: list[str], hot: dict[str, Any]) -> str:
    """What the last retention run said of the step directories it left (and what they
    hold): the message of a failure that only shows under load."""
    out = []
    for name in left:
        said = [(h["action"], h["reason"]) for h in hot["steps"] if h["path"].endswith(name)]
        files = sorted(p.name for p in (job_dir / name).iterdir())
        out.append(f"{name}: plan {said or 'did not list it'}; files {files}")
    return "; ".join(out) + f"; evicted {[Path(p).name for p in hot['evicted']]}"


def soak_node(tmp_path: Path, store_url: str, **extra: str) -> Node:
    node = make_node(
        tmp_path,
        "b",
        [store_url],
        FERRY_STANDBY_POLL_SECONDS="0.02",
        FERRY_STANDBY_MAX_RATE="0",
        FERRY_PREFETCH_CONCURRENCY="4",
        **extra,
    )
    config = tmp_path / "ferry-b.toml"
    config.write_text(RETENTION)
    node.args = ["--config", str(config)]
    return node


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_agent_serving_2000_prefetches_and_replications_stays_flat(
    local_url: str, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    for step in SEEDS:  # before the agent starts: it refuses a tier that is not a store yet
        asyncio.run(push_step(local_url, src, step))
    node = soak_node(tmp_path, local_url)
    began = time.monotonic()
    with running(node):
        samples, driver = asyncio.run(soak(node, local_url, src))

        async def evict_now() -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with (
                aiohttp.ClientSession(headers=headers) as s,
                s.post(node.url + "/v1/retention/run") as r,
            ):
                assert r.status == 200, await r.text()
                return dict(await r.json())

        report = asyncio.run(evict_now())
    took = time.monotonic() - began
    for s in samples:
        print(s)
    print(driver.outcomes, f"{took:.1f} s")

    assert [s.records for s in samples] == [501, 1_001, 1_501, 2_001]
    assert sum(driver.outcomes.values()) == 2_001
    assert driver.outcomes["standby:restored"] == 201  # each new step, replicated
    assert driver.outcomes["replica"] == 600  # "latest": found here, restored and untouched
    assert driver.outcomes["restored"] > 100 and driver.outcomes["held"] > 600
    _500, m1000, m1500, m2000 = samples
    for s in samples:
        # every record is finished, and no more than HISTORY of them are kept
        assert sum(s.remembered.values()) == s.remembered["ready"] == min(s.records, HISTORY)
        # (record 1 is the standby's first replication; the first RPC prefetch, record 2)
        assert s.newest_known and s.oldest_known == (s.records <= HISTORY + 1)
        # hot retention: the newest two, and what came since its last run (at most every
        # seed and a few replicas; without it, a replica more each round: 200 at the end)
        assert s.hot_steps <= len(SEEDS) + 8, s
        # tier retention: the milestones, the newest three, and what came since its last run
        # or is pinned by a prefetch (without it: a step more each round, 210 at the end)
        assert s.checkpoints_steps <= len(SEEDS) + 8, s
    for before, after in itertools.pairwise(samples):
        for name, value in before.counters.items():
            assert after.counters[name] > value, (name, before, after)  # counters never drop
    for s in (m1500, m2000):  # the history is full: nothing grows but the counters' digits
        assert s.metrics_series == m1000.metrics_series
        assert abs(s.metrics_bytes - m1000.metrics_bytes) <= 32, (m1000, s)
        assert abs(s.standby_bytes - m1000.standby_bytes) <= 16, (m1000, s)
        # threads: the event loop's default executor grows lazily up to its cap (asyncio's
        # min(32, cpus + 4)) as load peaks, so a busy machine adds a few late (CI: 23 -> 26
        # between two samples); a leak adds one or more per prefetch, hundreds here
        pool = min(32, (os.cpu_count() or 1) + 4)
        assert s.fds <= m1000.fds + 2 and s.threads <= m1000.threads + pool, (m1000, s)
    assert m2000.rss_kib - m1000.rss_kib <= RSS_GROWTH_KIB, (m1000, m2000)
    # once retention has run, the hot dir holds the newest two steps and nothing else
    assert report["hot"]["errors"] == [] and report["errors"] == []
    left = sorted(p.name for p in (node.hot / JOB).iterdir() if not p.name.startswith("."))
    assert left == [
        f"step_{FIRST_NEW + 198:06d}",
        f"step_{FIRST_NEW + 199:06d}",
    ], _why_left(node.hot / JOB, left, report["hot"])


# ---------------------------------------------------------------------------------------------
# what the soak found, one test each


@dataclass
class RestoredHere:
    """A local store holding ``stored`` steps and an in-process prefetcher that restored
    ``here`` of them into its hot dir, with the hot retention of an agent beside it
    (keep_last 2: a restored step beyond the newest two is evicted, the tier holds it)."""

    store: Store
    hot: HotDir
    journal: Journal
    holds: StepHolds
    prefetcher: Prefetcher
    retention: RetentionRunner

    @classmethod
    async def make(cls, tmp: Path, stored: list[int], here: list[int]) -> RestoredHere:
        (tmp / "store").mkdir()
        store = open_test_store(str(tmp / "store"))
        hot = HotDir(tmp / "hot", ".metadata")
        journal, holds = Journal(tmp / "journal.sqlite3", "b"), StepHolds()
        links = PrefetchLinks(holds=holds, on_restore=journal.record_restored)
        prefetcher = Prefetcher(hot, [("t", store)], OPTS, BandwidthMeter(), links=links)
        retention = RetentionRunner(
            RetentionSettings(hot_keep_last=2), node="b", hot_dir=hot, tiers=[("t", store)],
            journal=journal, protected=ProtectedSteps(holds, pins=set, busy=set),
            metrics=Metrics(),
        )  # fmt: skip
        made = cls(store, hot, journal, holds, prefetcher, retention)
        for step in stored:
            await push(store, step_files(tmp / "src", step), job=JOB, step=step, node="a",
                       options=OPTS)  # fmt: skip
        for step in here:
            record = await made.prefetched(step)
            assert record.state is State.READY, record.error
        return made

    async def prefetched(self, step: int) -> PrefetchJob:
        record = self.prefetcher.submit(JOB, step, None)
        assert record.task is not None
        await record.task
        return record

    def steps_here(self) -> list[int]:
        return sorted(c.step for c in self.hot.checkpoints(JOB))


def test_hot_retention_never_evicts_the_base_of_a_restore_in_progress(tmp_path: Path) -> None:
    """A prefetch of an older step restores it against the newest older step here (its
    base). It chose the base, then read the base's manifests from the store before it took
    its hold: hot retention, running then, evicted the base (beyond keep_last, held by the
    tier), and the restore failed with "base directory ... does not exist"."""

    async def go() -> tuple[RestoredHere, dict[str, Any], PrefetchJob]:
        on = await RestoredHere.make(tmp_path, stored=[1, 2, 8, 9], here=[1, 8, 9])
        reading, go_on = asyncio.Event(), asyncio.Event()
        get, base_manifest = on.store.get, layout.manifest_key(JOB, 1, "a")

        async def get_pausing_once(key: str, start: int | None = None, end: int | None = None):  # type: ignore[no-untyped-def]
            if key == base_manifest and not reading.is_set():  # the restore of step 2 reads
                reading.set()  # its base's manifest: hot retention runs now
                await go_on.wait()
            return await get(key, start, end)

        on.store.get = get_pausing_once  # type: ignore[method-assign]
        restoring = asyncio.create_task(on.prefetched(2))  # its base: step 1
        await reading.wait()
        report = await on.retention.run_once()
        go_on.set()
        record = await restoring
        await on.store.close()
        return on, report, record

    on, report, record = asyncio.run(go())
    on.journal.close()
    assert record.state is State.READY and record.satisfied_by == "restored", record.error
    decided = {s["step"]: (s["action"], s["reason"]) for s in report["hot"]["steps"]}
    assert decided[1] == ("keep", "in use or pinned")
    assert on.steps_here() == [1, 2, 8, 9]


def test_a_step_that_comes_into_use_while_hot_retention_evicts_is_kept(tmp_path: Path) -> None:
    """Hot retention checked the holds once, before its first eviction, then evicted step
    after step (each in a thread): a prefetch that found a step here and held it meanwhile
    lost it. Each step is checked just before it goes, and renamed away on the event loop
    right after the check."""

    async def go() -> tuple[RestoredHere, dict[str, Any]]:
        on = await RestoredHere.make(tmp_path, stored=[1, 2, 8, 9], here=[1, 2, 8, 9])
        released = asyncio.Event()

        async def prefetch_of_step_1() -> None:
            # it lists the hot dir and holds step 1 once retention took step 2 away (retention
            # evicts the newest first), before retention gets to step 1
            while on.hot.step_path(JOB, 2).exists():  # noqa: ASYNC110 (at every turn of the loop)
                await asyncio.sleep(0)
            with on.holds.hold((JOB, 1)):
                await released.wait()

        using = asyncio.create_task(prefetch_of_step_1())
        report = await on.retention.run_once()
        released.set()
        await using
        await on.store.close()
        return on, report

    on, report = asyncio.run(go())
    on.journal.close()
    assert report["hot"]["errors"] == ["llm step 1 came into use; kept"]
    assert on.steps_here() == [1, 8, 9]


def test_a_step_restored_again_while_its_eviction_is_removed_stays_a_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hot retention forgot an evicted step's journal rows after its directory was removed
    (in a thread): a prefetch that restored the step again meanwhile lost its "restored
    here" record, so the restore counted as this node's own save, "not in any colder tier
    yet", kept for good (the soak, under load: a seed step left in the hot dir). The rows
    go as the directory is renamed away, before the removal."""
    removing, release = threading.Event(), threading.Event()

    def slow_rmtree(path: Path, *args: Any) -> None:
        removing.set()
        release.wait(30)
        shutil.rmtree(path, *args)

    async def go() -> RestoredHere:
        on = await RestoredHere.make(tmp_path, stored=[1, 8, 9], here=[1, 8, 9])
        monkeypatch.setattr(hotretention, "shutil", SimpleNamespace(rmtree=slow_rmtree))
        evicting = asyncio.create_task(on.retention.run_once())
        while not removing.is_set():  # noqa: ASYNC110 (step 1 is hidden, its removal waits)
            await asyncio.sleep(0.01)
        record = await on.prefetched(1)  # not here any more: restored again
        assert record.state is State.READY and record.satisfied_by == "restored", record
        release.set()
        report = await evicting
        assert report["hot"]["errors"] == []
        assert on.journal.is_restored(JOB, 1)
        again = await on.retention.run_once()  # a restore the tier holds: evicted again
        assert [Path(p).name for p in again["hot"]["evicted"]] == ["step_000001"], again["hot"]
        await on.store.close()
        return on

    on = asyncio.run(go())
    on.journal.close()
    assert on.steps_here() == [8, 9]


def test_prefetch_counters_never_go_down_when_records_are_forgotten(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ferry_prefetch_bytes_total and ferry_prefetch_seconds_total (counters) were summed
    over the records the agent still keeps: once the oldest finished ones were forgotten
    (HISTORY), they went down. And ferry_prefetch_total (a gauge by state) kept its last
    count for a state no record was in any more (queued 1 forever)."""
    monkeypatch.setattr(Prefetcher, "HISTORY", 2)

    async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        async with session.get(url + "/metrics") as r:
            return _series(await r.text())

    async def go() -> None:
        for step in range(1, 6):
            await push_step(local_url, tmp_path / "src", step)
        await push_step(local_url, tmp_path / "src", 6, size=8 * MiB)  # restores for a while
        await push_step(local_url, tmp_path / "src", 7)  # (5 is held by then: no slot waited)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        env = {"FERRY_PREFETCH_CONCURRENCY": "1"}
        async with (
            agent(tmp_path / "hot", [local_url], "b", extra_env=env) as url,
            aiohttp.ClientSession(headers=headers) as s,
        ):

            async def prefetch(step: int) -> str:
                async with s.post(url + "/v1/prefetch", json={"job": JOB, "step": step}) as r:
                    return str((await r.json())["id"])

            async def finished(pid: str) -> dict[str, Any]:
                while True:
                    async with s.get(f"{url}/v1/prefetch/{pid}") as r:
                        doc: dict[str, Any] = await r.json()
                    if doc["state"] not in ("queued", "running"):
                        assert doc["state"] == "ready", doc
                        return doc
                    await asyncio.sleep(0.01)

            moved, took = 0, 0.0
            for step in range(1, 6):
                doc = await finished(await prefetch(step))
                moved, took = moved + sum(doc["bytes_by_source"].values()), took + doc["seconds"]
            tier = f'ferry_prefetch_bytes_total{{direction="in",source="tier:{local_url}"}}'
            seen = await metrics(s, url)
            assert seen[tier] == moved > 5 * 5 * KiB  # all five, not the two kept
            assert seen["ferry_prefetch_seconds_total"] == pytest.approx(took, abs=0.01)
            big, small = await prefetch(6), await prefetch(7)  # one slot: one waits
            during = await metrics(s, url)
            assert during['ferry_prefetch_total{state="queued"}'] >= 1
            await finished(big)
            await finished(small)
            after = await metrics(s, url)
            assert after[tier] > seen[tier]
            states = {k: v for k, v in after.items() if k.startswith("ferry_prefetch_total")}
            want = {st.value: 2 if st is State.READY else 0 for st in State}
            assert states == {f'ferry_prefetch_total{{state="{k}"}}': v for k, v in want.items()}

    asyncio.run(go())


def test_what_a_restore_looked_like_is_forgotten_once_it_is_evicted(tmp_path: Path) -> None:
    """The prefetcher keeps what each restore looked like once verified (so a later
    prefetch of it need not re-hash it): one entry per step it ever restored, kept after hot
    retention evicted the step, so a standby replicating every new step grew forever."""

    async def go() -> RestoredHere:
        on = await RestoredHere.make(tmp_path, stored=list(range(1, 9)), here=[])
        for step in range(1, 9):
            assert (await on.prefetched(step)).state is State.READY
            await on.retention.run_once()  # keeps the newest two
        assert (await on.prefetched(8)).satisfied_by == "held"  # the next prefetch
        await on.store.close()
        return on

    on = asyncio.run(go())
    on.journal.close()
    assert on.steps_here() == [7, 8]
    assert sorted(on.prefetcher._restored) == [(JOB, 7), (JOB, 8)]


def test_prefetches_of_one_step_changed_since_its_restore_all_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's CI failure (one prefetch "queued" for good): prefetches of one step asked
    at once each checked, on its own thread, whether the step was still as restored; it
    was not (touched, or being evicted), so each forgot the restore's record, and the
    second to forget it raised KeyError: its task died and its record stayed queued. (The
    first two checks wait for each other, so the two are at once every time.)"""
    import agent.node.prefetch as prefetch_module

    check, both = prefetch_module.check_unchanged, threading.Barrier(2, timeout=10)
    calls = itertools.count()

    def checks_together(*args: Any, **kwargs: Any) -> None:
        if next(calls) < 2:
            both.wait()
        check(*args, **kwargs)

    async def go() -> list[PrefetchJob]:
        on = await RestoredHere.make(tmp_path, stored=[1, 2], here=[1, 2])
        monkeypatch.setattr(prefetch_module, "check_unchanged", checks_together)
        for p in (on.hot.step_path(JOB, 2)).iterdir():  # same bytes, another mtime
            os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
        records = [on.prefetcher.submit(JOB, 2, None) for _ in range(6)]
        await asyncio.gather(*(r.task for r in records if r.task is not None))
        await on.store.close()
        on.journal.close()
        return records

    records = asyncio.run(go())
    assert [(r.state, r.satisfied_by) for r in records] == [(State.READY, "held")] * 6, [
        r.error for r in records
    ]


def test_a_prefetch_that_meets_a_bug_fails_saying_so_and_never_stays_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a prefetch's task raises, its record ends: a scheduler polling it would
    otherwise wait for good (the KeyError above left one "queued"). A bug cannot be caused
    for real, so one is put in."""

    async def go() -> PrefetchJob:
        on = await RestoredHere.make(tmp_path, stored=[1], here=[])

        async def broken(self: Prefetcher, record: PrefetchJob) -> None:
            raise KeyError(("llm", 1))

        monkeypatch.setattr(Prefetcher, "_fetch", broken)
        record = await on.prefetched(1)
        await on.store.close()
        on.journal.close()
        return record

    record = asyncio.run(go())
    assert record.state is State.FAILED and record.finished is not None
    assert record.error == "internal error (a bug): KeyError: ('llm', 1)"
    assert record.ended.is_set()
