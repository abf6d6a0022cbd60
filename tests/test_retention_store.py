"""Retention against real stores (local and the test S3 server): expiry, demotion, pins,
the lease, and mark-and-sweep GC that never deletes what a retained step or a running push
still needs."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from tests.conftest import (
    init_test_store,
    make_checkpoint,
    open_test_store,
    random_bytes,
    run,
    tree_bytes,
    write_file,
)
from tests.harness import WatchingStore
from transfer.engine import PullPlan, pull, push, verify
from transfer.engine.catalog import list_checkpoints
from transfer.errors import FerryError
from transfer.format import layout
from transfer.options import TransferOptions
from transfer.retention import (
    DEMOTE,
    EXPIRE,
    KEEP,
    GcBusyError,
    RetentionError,
    Tier,
    TierPolicy,
    apply_plan,
    gc_lease,
    make_plan,
    pin,
    take_inventory,
    unpin,
)
from transfer.retention.repack import RepackPolicy
from transfer.store.base import ObjectInfo, Store

JOB, NODE = "train", "n0"


def _ckpt(root: Path, seed: int) -> Path:
    """Two shards and a .metadata, all unique to ``seed`` (no chunk shared across seeds)."""
    write_file(root / "__0_0.distcp", random_bytes(600_000, seed))
    write_file(root / "__1_0.distcp", random_bytes(300_017, seed + 1000))
    write_file(root / ".metadata", b"metadata-" + str(seed).encode())
    return root


async def _push_steps(store: Store, tmp: Path, seeds: dict[int, int]) -> dict[int, Path]:
    dirs = {}
    for step, seed in seeds.items():
        d = _ckpt(tmp / f"step_{step}", seed)
        await push(store, d, job=JOB, step=step, node=NODE)
        dirs[step] = d
    return dirs


async def _retention(
    tiers: list[Tier], *, grace: float = 0.0, now: float | None = None, dry_run: bool = False
):  # type: ignore[no-untyped-def]
    plan = await make_plan(tiers, now=time.time() if now is None else now)
    return await apply_plan(plan, tiers, grace_s=grace, holder="test", dry_run=dry_run)


async def _packs(store: Store) -> set[str]:
    return {k for o in await store.list(layout.PACKS_PREFIX) if (k := layout.parse_pack_key(o.key))}


async def _steps(store: Store) -> list[int]:
    return sorted({c.step for c in await list_checkpoints(store, JOB)})


async def _assert_pulls(store: Store, dirs: dict[int, Path], tmp: Path) -> None:
    for step in await _steps(store):
        dest = tmp / f"pulled-{step}-{time.monotonic_ns()}"
        await pull(store, dest, PullPlan(JOB, step))
        assert tree_bytes(dest) == tree_bytes(dirs[step]), step


def test_without_grace_one_run_frees_what_it_expires(store_url: str, tmp_path: Path) -> None:
    """Issue 14: with no grace period (no push writes to the store) the packs a run's own
    expiries release go in that same run, and its dry run says exactly what will go."""

    async def go() -> None:
        store = open_test_store(store_url)
        try:
            dirs = await _push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3, 4: 4})
            before = await _packs(store)
            tiers = [Tier(store, TierPolicy(keep_last=2))]

            dry = await _retention(tiers, dry_run=True)
            assert [a.action for a in dry.tiers[0].actions] == [EXPIRE, EXPIRE, KEEP, KEEP]
            assert await _steps(store) == [1, 2, 3, 4] and await _packs(store) == before
            would = dry.tiers[0].gc
            assert would is not None and would.dry_run and len(would.deleted_packs) >= 1
            assert "gc: would delete" in dry.table()

            done = await _retention(tiers)
            assert await _steps(store) == [3, 4]
            gc = done.tiers[0].gc
            assert gc is not None and sorted(gc.deleted_packs) == sorted(would.deleted_packs)
            assert gc.freed_bytes == would.freed_bytes > 0 and gc.marked_packs == 0
            assert await _packs(store) == before - set(gc.deleted_packs)
            await _assert_pulls(store, dirs, tmp_path)
            assert (await verify(store)).ok
        finally:
            await store.close()

    run(go())


def test_without_grace_an_orphan_pack_is_marked_first(local_url: str, tmp_path: Path) -> None:
    """A pack nobody referenced when the run began may be a running push's upload: even
    without grace it is only marked, and the next run deletes it."""

    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1})
        orphan = layout.new_pack_id()
        await store.put(layout.pack_key(orphan), b"left by a crashed push")
        tiers = [Tier(store, TierPolicy(keep_last=1))]
        first = await _retention(tiers)
        assert first.tiers[0].gc is not None and first.tiers[0].gc.deleted_packs == []
        assert orphan in await _packs(store)
        second = await _retention(tiers)
        assert second.tiers[0].gc is not None and second.tiers[0].gc.deleted_packs == [orphan]
        assert orphan not in await _packs(store) and await _steps(store) == [1]

    run(go())


def test_grace_period_delays_deletion(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1, 2: 2})
        tiers = [Tier(store, TierPolicy(keep_last=1))]
        t0 = time.time()
        await _retention(tiers, grace=600, now=t0)
        before = await _packs(store)
        later = await _retention(tiers, grace=600, now=t0 + 599)
        assert later.tiers[0].gc is not None and later.tiers[0].gc.deleted_packs == []
        assert await _packs(store) == before
        done = await _retention(tiers, grace=600, now=t0 + 601)
        assert done.tiers[0].gc is not None and done.tiers[0].gc.deleted_packs
        assert await _packs(store) < before

    run(go())


def test_delta_chain_survives_expiry_of_its_bases(store_url: str, tmp_path: Path) -> None:
    """Step k+1 is stored as deltas against k: expiring every older step must keep the
    packs its chain decodes from (through the manifest's bases table)."""

    async def go() -> None:
        store = open_test_store(store_url)
        try:
            src = make_checkpoint(tmp_path / "step_1", seed=7, shard_bytes=900_000)
            dirs = {1: src}
            await push(store, src, job=JOB, step=1, node=NODE)
            for step in (2, 3, 4):
                d = tmp_path / f"step_{step}"
                d.mkdir()
                for f in dirs[step - 1].rglob("*"):
                    if f.is_file():
                        target = d / f.relative_to(dirs[step - 1])
                        target.parent.mkdir(parents=True, exist_ok=True)
                        data = bytearray(f.read_bytes())
                        for i in range(0, len(data), 4096):  # a small change everywhere
                            data[i] ^= step
                        target.write_bytes(bytes(data))
                dirs[step] = d
                result = await push(store, d, job=JOB, step=step, node=NODE)
                assert result.chunks_delta > 0
            tiers = [Tier(store, TierPolicy(keep_last=1))]
            for _ in range(3):
                await _retention(tiers)
            assert await _steps(store) == [4]
            await _assert_pulls(store, dirs, tmp_path)
        finally:
            await store.close()

    run(go())


def test_pins_in_the_store_protect_until_they_expire(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3})
        tiers = [Tier(store, TierPolicy(keep_last=1))]
        await pin(store, JOB, 1, "scheduler", ttl_s=60)
        plan = await _retention(tiers)
        assert await _steps(store) == [1, 3]
        assert [a.reason for a in plan.tiers[0].actions if a.step == 1] == ["pinned"]
        await unpin(store, JOB, 1, "scheduler")
        await _retention(tiers)
        assert await _steps(store) == [3]
        # an expired pin protects nothing and is cleaned up
        await pin(store, JOB, 3, "dead-client", ttl_s=1)
        await _retention(tiers, now=time.time() + 5)
        assert not [o for o in await store.list(layout.PINS_PREFIX)]

    run(go())


def test_unreadable_manifest_stops_retention_before_any_delete(
    local_url: str, tmp_path: Path
) -> None:
    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3})
        before = sorted(o.key for o in await store.list(""))
        await store.put(layout.manifest_key(JOB, 9, "other"), b'{"format": "ckpt-ferry-manif')
        with pytest.raises(RetentionError, match="deletes nothing"):
            await _retention([Tier(store, TierPolicy(keep_last=1))])
        after = sorted(o.key for o in await store.list(""))
        assert [k for k in after if "other" not in k] == before

    run(go())


def test_lease_keeps_two_runs_apart_and_expires(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1, 2: 2})
        tiers = [Tier(store, TierPolicy(keep_last=1))]
        async with gc_lease(store, "other-node"):
            plan = await _retention(tiers)
            assert "already running" in plan.tiers[0].errors[0]
            assert await _steps(store) == [1, 2]
            with pytest.raises(GcBusyError):
                async with gc_lease(store, "third"):
                    pass
        # a lease left by a dead run (expired) is broken
        dead = {"holder": "dead", "expires_at": time.time() - 1}
        await store.put(layout.GC_LOCK_KEY, json.dumps(dead).encode())
        plan = await _retention(tiers)
        assert plan.tiers[0].errors == [] and await _steps(store) == [2]
        assert not await store.exists(layout.GC_LOCK_KEY)

    run(go())


def test_demotion_copies_first_and_never_loses_the_only_copy(
    local_url: str, s3_url: str, tmp_path: Path
) -> None:
    async def go() -> None:
        hot, cold = open_test_store(local_url), open_test_store(s3_url)
        try:
            dirs = await _push_steps(hot, tmp_path, {1: 1, 2: 2, 3: 3})
            await push(cold, dirs[1], job=JOB, step=1, node=NODE)  # 2 never reached cold
            tiers = [Tier(hot, TierPolicy(keep_last=1)), Tier(cold, TierPolicy(keep_last=5))]
            plan = await _retention(tiers)
            assert [a.action for a in plan.tiers[0].actions] == [DEMOTE, DEMOTE, KEEP]
            assert plan.tiers[0].errors == []
            assert await _steps(hot) == [3]
            assert await _steps(cold) == [1, 2]  # 2 was copied before it left hot
            await _assert_pulls(cold, dirs, tmp_path)
            await _assert_pulls(hot, dirs, tmp_path)
        finally:
            await cold.close()

    run(go())


def test_the_colder_tier_forecasts_the_steps_demoted_into_it(
    local_url: str, tmp_path: Path
) -> None:
    """A dry run with a colder tier said "0 B -> 0 B once done" for a colder store about to
    receive two steps: its forecast now counts them (the packs they reference above, copied
    whole), and it is what the real run leaves there; a step it holds already is not
    counted again (demoting it only expires it above)."""

    cold_url = init_test_store(str(tmp_path / "cold"))

    async def go() -> None:
        hot, cold = open_test_store(local_url), open_test_store(cold_url)
        dirs = await _push_steps(hot, tmp_path, {1: 1, 2: 2, 3: 3})
        await push(cold, dirs[1], job=JOB, step=1, node=NODE)  # 1 is there already
        tiers = [Tier(hot, TierPolicy(keep_last=1)), Tier(cold, TierPolicy())]
        before = (await take_inventory(cold, now=time.time())).total_bytes()
        dry = await _retention(tiers, dry_run=True)
        colder = dry.tiers[1]
        assert (colder.steps_demoted_in, colder.bytes_demoted_in > 0) == (1, True)
        assert colder.bytes_after == before + colder.bytes_demoted_in
        assert "1 step demoted in" in dry.table() and colder.gc is not None
        assert "would wait out the grace period" in dry.table()  # (a forecast, said as one)
        assert colder.gc.bytes_stored is None and colder.bytes_stored is None  # nothing measured
        assert colder.bytes_awaiting_gc is None  # (was 0 where the text counted packs waiting)
        done = await _retention(tiers)
        assert await _steps(cold) == [1, 2]
        assert done.tiers[1].bytes_stored == colder.bytes_after

    run(go())


def test_the_forecast_leaves_out_packs_an_earlier_demotion_copied(
    local_url: str, tmp_path: Path
) -> None:
    """Steps sharing a file (deduped into one pack) demoted in two runs: the second copies
    only the packs the colder tier lacks, and its forecast says so (it counted every pack
    the step references: 2.10 MB forecast, 1.20 MB stored, a review's trial)."""
    cold_url = init_test_store(str(tmp_path / "cold"))
    shared = random_bytes(600_000, 7)

    def save(step: int) -> Path:
        d = tmp_path / f"save_{step}"
        write_file(d / "__0_0.distcp", shared)  # the same in every step: one pack, deduped
        write_file(d / "__1_0.distcp", random_bytes(300_017, step))
        write_file(d / ".metadata", b"m%d" % step)
        return d

    async def go() -> None:
        hot, cold = open_test_store(local_url), open_test_store(cold_url)
        tiers = [Tier(hot, TierPolicy(keep_last=2)), Tier(cold, TierPolicy())]
        for step in (1, 2, 3):
            await push(hot, save(step), job=JOB, step=step, node=NODE)
        await _retention(tiers)  # step 1 goes down, with the shared pack
        await push(hot, save(4), job=JOB, step=4, node=NODE)
        dry = (await _retention(tiers, dry_run=True)).tiers[1]
        assert dry.steps_demoted_in == 1
        done = await _retention(tiers)
        assert await _steps(cold) == [1, 2]
        assert done.tiers[1].bytes_stored == dry.bytes_after

    run(go())


def test_demotion_to_an_unreachable_tier_keeps_the_step(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        hot = open_test_store(local_url)
        gone = tmp_path / "cold"
        gone.mkdir()
        cold = open_test_store(str(gone))
        dirs = await _push_steps(hot, tmp_path, {1: 1, 2: 2})
        gone.rmdir()  # the NFS mount went away
        tiers = [Tier(hot, TierPolicy(keep_last=1)), Tier(cold, TierPolicy())]
        plan = await _retention(tiers)
        assert "not safely in" in plan.tiers[0].errors[0]
        assert await _steps(hot) == [1, 2]
        await _assert_pulls(hot, dirs, tmp_path)

    run(go())


def test_budget_expires_oldest_until_the_tier_fits(local_url: str, tmp_path: Path) -> None:
    async def go() -> None:
        store = open_test_store(local_url)
        await _push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3, 4: 4})
        one_step = (await make_plan([Tier(store, TierPolicy())], now=time.time())).tiers[0]
        per_step = one_step.bytes_before // 4
        plan = await _retention([Tier(store, TierPolicy(budget_bytes=int(per_step * 2.5)))])
        assert await _steps(store) == [3, 4]
        assert plan.tiers[0].bytes_after <= per_step * 2.5 and not plan.tiers[0].over_budget
        tiny = await _retention([Tier(store, TierPolicy(budget_bytes=1))])
        assert await _steps(store) == [4] and tiny.tiers[0].over_budget

    run(go())


def test_a_budget_over_delta_coded_steps_expires_only_what_it_must(
    local_url: str, tmp_path: Path
) -> None:
    """Each step delta-coded against the one before (most bytes of every chunk unchanged):
    a budget that expiring the oldest step meets, once repacking re-encodes what the next
    step needed of it, expires that step alone. It expired every step but the newest
    (their chain kept the oldest pack, so by whole packs nothing shrank), then said the
    tier was over budget at a fifth of it (found by a newcomer's trial)."""

    def step_files(root: Path, step: int) -> Path:
        data = bytearray(random_bytes(600_000, 1))
        rng = random.Random(step)
        for i in rng.sample(range(len(data)), len(data) // 3):  # a third of the bytes change
            data[i] = rng.randrange(256)
        write_file(root / "__0_0.distcp", bytes(data))
        write_file(root / ".metadata", b"metadata-" + str(step).encode())
        return root

    async def go() -> None:
        store = open_test_store(local_url)
        dirs = {}
        for step in range(1, 6):
            dirs[step] = step_files(tmp_path / f"step_{step}", step)
            await push(store, dirs[step], job=JOB, step=step, node=NODE)
        repacking = RepackPolicy(options=TransferOptions(workers=2))
        tiers = [Tier(store, TierPolicy(keep_last=4))]
        forecast = (await make_plan(tiers, now=time.time(), repacking=repacking)).tiers[0]
        assert forecast.bytes_after > forecast.bytes_before * 0.6  # step 1 is not all of it
        budget = [Tier(store, TierPolicy(budget_bytes=forecast.bytes_after + 1_000))]
        plan = await make_plan(budget, now=time.time(), repacking=repacking)
        plan = await apply_plan(plan, budget, grace_s=0, holder="test")
        assert await _steps(store) == [2, 3, 4, 5]
        assert not plan.tiers[0].over_budget
        assert sum(o.size for o in await store.list("")) <= forecast.bytes_after + 1_000
        await _assert_pulls(store, dirs, tmp_path)

    run(go())


def test_retention_removes_the_leases_of_killed_pushes_and_keeps_live_ones(
    store_url: str, tmp_path: Path
) -> None:
    """A push killed outright leaves its lease, which only the next push of its part would
    break: a newcomer's trial found them under locks/push/ after retention had aborted the
    killed push's uploads, and every retention run lists them all. Retention removes the
    expired ones and those of a process of this host that is gone; a live one stays."""
    import socket
    import subprocess

    from transfer.engine.pushlease import holder_identity

    gone = subprocess.Popen(["true"])
    gone.wait()  # (a pid of this host that no process has now)
    now = time.time()
    leases = {
        layout.push_lock_key(JOB, 1, "expired"): {**holder_identity(), "expires_at": now - 1},
        layout.push_lock_key(JOB, 1, "killed"): {
            "host": socket.gethostname(),
            "pid": gone.pid,
            "expires_at": now + 100,
        },
        layout.push_lock_key(JOB, 1, "live"): {**holder_identity(), "expires_at": now + 100},
    }

    async def go() -> None:
        store = open_test_store(store_url)
        try:
            await _push_steps(store, tmp_path, {1: 1})
            for key, doc in leases.items():
                await store.put(key, json.dumps(doc).encode())
            plan = await _retention([Tier(store, TierPolicy(keep_last=1))])
            gc = plan.tiers[0].gc
            assert gc is not None and (gc.running_pushes, gc.lapsed_leases) == (1, 2)
            left = [o.key for o in await store.list(layout.PUSH_LOCKS_PREFIX)]
            assert left == [layout.push_lock_key(JOB, 1, "live")]
        finally:
            await store.close()

    run(go())


class _GatedStore(WatchingStore):
    """The real store, with one call held until the test opens the gate: the push has read
    its dedupe index and uploaded its packs, and is about to check its reused packs
    ("head") or to commit its manifest ("manifest")."""

    def __init__(self, inner: Store, gate_on: str) -> None:
        super().__init__(inner)
        self.gate_on = gate_on
        self.at_gate = asyncio.Event()
        self.gate = asyncio.Event()

    async def _wait(self, what: str) -> None:
        if what == self.gate_on and not self.gate.is_set():
            self.at_gate.set()
            await self.gate.wait()

    async def head(self, key: str) -> ObjectInfo:
        if key.startswith(layout.PACKS_PREFIX):
            await self._wait("head")
        return await super().head(key)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        if key.startswith(layout.MANIFESTS_PREFIX):
            await self._wait("manifest")
        await super().put(key, data, create_only=create_only)


@pytest.mark.parametrize(
    ("grace", "gate_on", "lease"),
    [(3600.0, "manifest", True), (0.0, "head", True), (0.0, "head", False)],
)
def test_push_racing_gc_loses_nothing(
    store_url: str, tmp_path: Path, grace: float, gate_on: str, lease: bool
) -> None:
    """Step 3 is step 1's content again, so the push reuses step 1's packs; retention
    expires step 1 and sweeps twice while the push waits. With a grace period longer than
    the push, nothing is deleted and the push commits; with none, retention sees the push's
    lease and deletes nothing while it runs, so it commits too. A push without a lease (a
    writer from before leases, here: its lease removed by hand) loses its packs, and its
    last check before committing fails it cleanly. Either way every committed step
    verifies and pulls byte-exact."""

    async def go() -> None:
        store = open_test_store(store_url)
        try:
            dirs = await _push_steps(store, tmp_path, {1: 1, 2: 2})
            dirs[3] = _ckpt(tmp_path / "step_3", seed=1)
            gated = _GatedStore(store, gate_on)
            pushing = asyncio.create_task(push(gated, dirs[3], job=JOB, step=3, node=NODE))
            await asyncio.wait_for(gated.at_gate.wait(), 30)
            if not lease:
                await store.delete(layout.push_lock_key(JOB, 3, NODE))
            tiers = [Tier(store, TierPolicy(keep_last=1))]
            first = await _retention(tiers, grace=grace)
            await _retention(tiers, grace=grace)
            assert await _steps(store) == [2]
            assert first.tiers[0].gc is not None
            assert first.tiers[0].gc.running_pushes == (1 if lease else 0)
            gated.gate.set()
            if lease:
                result = await pushing
                assert result.chunks_new == 0  # really reused step 1's packs
                assert await _steps(store) == [2, 3]
            else:
                with pytest.raises(FerryError, match="was deleted while it ran"):
                    await pushing
                assert await _steps(store) == [2]
            assert (await verify(store)).ok
            await _assert_pulls(store, dirs, tmp_path)
        finally:
            await store.close()

    run(go())


def test_dead_bytes_in_kept_packs_are_reported(local_url: str, tmp_path: Path) -> None:
    """A pack stays whole while any chunk in it is referenced: step 2 reuses step 1's small
    shared file, so step 1's pack (and its big shard) stays after step 1 expires; the plan
    says how many of its bytes nothing uses."""

    async def go() -> None:
        store = open_test_store(local_url)
        for step in (1, 2):
            d = tmp_path / f"s{step}"
            write_file(d / "big.bin", random_bytes(500_000, step))
            write_file(d / "shared.txt", b"the same in every step\n" * 10)
            await push(store, d, job=JOB, step=step, node=NODE)
        plan = await make_plan([Tier(store, TierPolicy(keep_last=1))], now=time.time())
        assert plan.tiers[0].dead_bytes_after == 500_000  # step 1's big.bin, stored raw
        assert "500000" not in plan.table() and "500.0 KB of it in packs" in plan.table()

    run(go())


def test_du_accounts_for_every_byte(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14: ``ferry du`` says per step what only it stores, what it shares (here the
    deduplicated file), what expiring it alone frees (whole packs only: step 1's pack also
    holds the chunk step 2 reuses), the garbage, and what keep-last policies free."""
    from agent.cli.run import main as ferry

    async def setup() -> dict[int, set[str]]:
        store = open_test_store(local_url)
        packs: dict[int, set[str]] = {}
        for step in (1, 2):
            d = tmp_path / f"s{step}"
            write_file(d / "big.bin", random_bytes(500_000, step))
            write_file(d / "shared.txt", b"the same in every step\n" * 10)
            seen = await _packs(store)
            await push(store, d, job=JOB, step=step, node=NODE)
            packs[step] = await _packs(store) - seen
        await store.put(layout.pack_key(layout.new_pack_id()), b"left by a crashed push")
        return packs

    packs = run(setup())
    sizes = {o.key: o.size for o in run(open_test_store(local_url).list(layout.PACKS_PREFIX))}
    pack_bytes = sum(sizes.values())
    step2_pack = sum(sizes[layout.pack_key(p)] for p in packs[2])

    assert ferry(["du", local_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in doc["steps"]}
    assert rows[1]["own_bytes"] == rows[2]["own_bytes"] == 500_000  # big.bin, stored raw
    assert 0 < rows[1]["shared_bytes"] == rows[2]["shared_bytes"] < 1000  # shared.txt, once
    assert rows[1]["frees_bytes"] == 0 and rows[2]["frees_bytes"] == step2_pack
    assert rows[1]["bytes_raw"] == rows[2]["bytes_raw"] == 500_000 + 230
    assert (doc["unreferenced_packs"], doc["unreferenced_bytes"]) == (1, 22)
    assert doc["dead_bytes"] == 0 and doc["pack_bytes"] == pack_bytes
    assert doc["live_bytes"] + doc["dead_bytes"] + doc["unreferenced_bytes"] == pack_bytes
    keep1 = doc["policies"][0]
    assert keep1["policy"] == "keep_last=1"
    # a run repacks (the CLI's default): step 1's pack is mostly dead, the chunk step 2 reuses
    # moves out, and the pack goes with step 1's manifest and the garbage
    assert 500_000 + 22 < keep1["frees_bytes"] < 500_000 + 22 + 2000

    assert ferry(["du", local_url, "--job", JOB]) == 0
    out = capsys.readouterr().out
    assert "500.0 KB" in out and "22 B in 1 unreferenced packs" in out
    # (the policies are store-wide under --job too: said so)
    assert "retention keep_last=1 in every job: the store " in out
    assert ferry(["du", local_url, "--job", "nope"]) == 1
    assert "no checkpoint of job 'nope'" in capsys.readouterr().err


def test_du_prints_sizes_in_the_units_push_and_ls_print(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29 (i): `ferry du` printed MiB where `push` and `ls` print MB. One formatter
    (transfer/units.py): the same bytes read the same in every command."""
    from agent.cli.run import main as ferry

    src = tmp_path / "step_000001"
    write_file(src / "big.bin", random_bytes(3_000_000, 1))
    assert ferry(["push", str(src), local_url, "--job", JOB, "--node", NODE]) == 0
    pushed = capsys.readouterr().out
    assert ferry(["ls", local_url]) == 0
    listed = capsys.readouterr().out
    assert ferry(["du", local_url]) == 0
    du = capsys.readouterr().out
    assert "3.0 MB" in pushed and "3.0 MB" in listed, (pushed, listed)
    (row,) = [line for line in du.splitlines() if line.startswith(JOB)]
    assert "3.0 MB" in row, du
    assert "iB" not in du and "MB" in du.splitlines()[0], du


def test_cli_plans_applies_and_reports_errors(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli.run import main as ferry

    store = open_test_store(local_url)
    run(_push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3}))
    assert ferry(["retention", local_url, "--keep-last", "1", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] and [a["action"] for a in doc["tiers"][0]["actions"]] == [
        EXPIRE,
        EXPIRE,
        KEEP,
    ]
    assert run(_steps(store)) == [1, 2, 3]
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "expire" in out and "gc: deleted 2 packs" in out and run(_steps(store)) == [3]
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    assert "gc: deleted 0 packs" in capsys.readouterr().out

    lease = {"holder": "someone", "expires_at": time.time() + 600}
    run(store.put(layout.GC_LOCK_KEY, json.dumps(lease).encode(), create_only=True))
    assert ferry(["retention", local_url, "--keep-last", "1"]) == 1
    assert "already running" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        ferry(["retention", local_url, "--max-age", "soon"])
    assert usage.value.code == 2


def test_ferry_pin_keeps_a_step_from_retention_until_unpinned(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pinning needs no running agent (issue 13): the CLI writes the same pin objects."""
    from agent.cli.run import main as ferry

    store = open_test_store(local_url)
    run(_push_steps(store, tmp_path, {1: 1, 2: 2, 3: 3}))
    where = [local_url, "--job", JOB]
    with pytest.raises(SystemExit) as too_long:  # a usage error, as --ttl 0 is
        ferry(["pin", *where, "--step", "1", "--ttl", "30d"])
    assert too_long.value.code == 2
    assert "a pin lasts at most 7 days, got '30d'" in capsys.readouterr().err
    assert ferry(["pin", *where, "--step", "1", "--ttl", "1d", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pinned"] and doc["holder"].startswith("cli-")
    assert 86000 < doc["expires_at"] - time.time() <= 86400
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    assert run(_steps(store)) == [1, 3]  # 2 expired, the pinned 1 kept
    assert ferry(["unpin", *where, "--step", "1"]) == 0
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    assert run(_steps(store)) == [3]
    capsys.readouterr()
    assert ferry(["pin", *where, "--step", "2"]) == 1  # expired: nothing to pin
    assert "no committed checkpoint" in capsys.readouterr().err
    # "latest", as ferry pull takes it (a newcomer was told "invalid int value"), in pin,
    # unpin and verify alike
    assert ferry(["pin", *where, "--step", "latest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    assert ferry(["verify", *where, "--step", "latest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == 1
    assert ferry(["unpin", *where, "--step", "latest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] is True
    with pytest.raises(SystemExit) as usage:
        ferry(["pin", *where, "--step", "soon"])
    assert usage.value.code == 2
