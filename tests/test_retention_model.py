"""Retention as a state machine (hypothesis): random pushes (to one or both tiers), pins,
unpins, crashed pushes (orphan packs), crashed retention runs and full runs across two
real local-store tiers. After every step, every step still committed in a tier pulls
byte-exact, the newest step and pinned steps are never lost, demotion never drops a step
the colder tier should keep, and no unreferenced pack outlives two GC cycles."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import tree_bytes, write_file
from transfer.engine import PullPlan, TransferOptions, pull, push
from transfer.engine.catalog import list_checkpoints, open_catalog
from transfer.format import layout
from transfer.retention import Tier, TierPolicy, apply_plan, make_plan, pin, take_inventory, unpin
from transfer.retention.plan import EXPIRE, delete_step
from transfer.retention.repack import RepackPolicy
from transfer.store.local import LocalStore

JOB, NODE = "m", "n0"
OPTS = TransferOptions(chunk_size=64 << 10, part_size=256 << 10, pack_size=1 << 20)
CHUNKS_PER_FILE = 3
POLICIES = (TierPolicy(keep_last=2), TierPolicy(keep_last=3, keep_every=4))


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="ferry-model-"))
        self.loop = asyncio.new_event_loop()
        self.stores = []
        for name in ("hot", "cold"):
            (self.root / name).mkdir()
            self.stores.append(LocalStore(self.root / name))
        for s in self.stores:
            self.run(open_catalog(s, create=True))
        self.content: dict[int, dict[str, bytes]] = {}
        self.step = 0
        self.in_tier: list[set[int]] = [set(), set()]  # steps each tier received
        self.pinned: dict[int, set[int]] = {}  # step -> tiers holding it when pinned
        self.unreferenced_after_last_gc: list[set[str]] = [set(), set()]

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- actions -------------------------------------------------------------------------

    @rule(
        seed=st.integers(0, 2**16), changed=st.integers(0, 2 * CHUNKS_PER_FILE), both=st.booleans()
    )
    def push_step(self, seed: int, changed: int, both: bool) -> None:
        """A new save: the previous one with ``changed`` chunks rewritten (deltas and
        dedupe both happen). Pushed to the hot tier; to the cold one too unless that push
        'failed' (then only demotion can bring it there)."""
        rng = random.Random(seed)
        self.step += 1
        prev = self.content.get(self.step - 1) or {
            f"__{i}_0.distcp": rng.randbytes(CHUNKS_PER_FILE * OPTS.chunk_size) for i in range(2)
        }
        files = {k: bytearray(v) for k, v in prev.items()}
        for _ in range(changed):
            name = rng.choice(sorted(k for k in files if k.endswith(".distcp")))
            at = rng.randrange(CHUNKS_PER_FILE) * OPTS.chunk_size + rng.randrange(OPTS.chunk_size)
            files[name][at] ^= 1 + rng.randrange(255)
        files_b = {k: bytes(v) for k, v in files.items()} | {".metadata": f"{self.step}".encode()}
        self.content[self.step] = files_b
        src = self.root / "src" / f"step_{self.step}"
        for name, data in files_b.items():
            write_file(src / name, data)
        for tier in (0, 1) if both else (0,):
            self.run(push(self.stores[tier], src, job=JOB, step=self.step, node=NODE, options=OPTS))
            self.in_tier[tier].add(self.step)

    @precondition(lambda self: self.step > 0)
    @rule(data=st.data())
    def pin_step(self, data: st.DataObject) -> None:
        step = data.draw(st.integers(1, self.step))
        holding = {t for t in (0, 1) if step in self._committed(t)}
        if holding:
            for s in self.stores:
                self.run(pin(s, JOB, step, "sched", ttl_s=3600))
            self.pinned[step] = holding | self.pinned.get(step, set())

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin_step(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.pinned)))
        for s in self.stores:
            self.run(unpin(s, JOB, step, "sched"))
        del self.pinned[step]

    @rule(tier=st.integers(0, 1), size=st.integers(1, 200_000))
    def crashed_push(self, tier: int, size: int) -> None:
        """A push killed after a pack landed: a pack no manifest will ever reference."""
        pack_id = secrets.token_hex(16)
        self.run(self.stores[tier].put(layout.pack_key(pack_id), secrets.token_bytes(size)))

    @rule()
    def crashed_retention(self) -> None:
        """A run killed right after expiring one step (no GC, lease left to expire)."""
        tiers = self._tiers()
        plan = self.run(make_plan(tiers, now=time.time()))
        for tier, tplan, inv in zip(tiers, plan.tiers, plan.inventories, strict=True):
            doomed = [a for a in tplan.actions if a.action == EXPIRE]
            if doomed:
                self.run(delete_step(tier.store, inv, doomed[0].job, doomed[0].step))
                break
        self.check_retained_steps_pull_byte_exact()

    @rule(repacking=st.booleans())
    def retention(self, repacking: bool) -> None:
        tiers = self._tiers()
        before = [self._committed(t) for t in (0, 1)]
        policy = RepackPolicy(min_dead=0.2, options=OPTS) if repacking else None
        plan = self.run(make_plan(tiers, now=time.time(), repacking=policy))
        self.run(apply_plan(plan, tiers, grace_s=0.0, holder="model"))
        assert [t.errors for t in plan.tiers] == [[], []]
        after = [self._committed(t) for t in (0, 1)]
        # a step that left the hot tier is in the cold tier, or the cold policy drops it
        cold_keeps = {a.step for a in plan.tiers[0].actions if a.action != EXPIRE}
        for step in before[0] - after[0]:
            if step in cold_keeps:
                assert step in after[1], (step, after)
        # GC: what was unreferenced after the previous run is gone (or referenced again)
        for t in (0, 1):
            inv = self.run(take_inventory(self.stores[t], now=time.time()))
            present, referenced = set(inv.pack_sizes), inv.referenced()
            assert not (self.unreferenced_after_last_gc[t] & present) - referenced
            self.unreferenced_after_last_gc[t] = present - referenced
        self.check_retained_steps_pull_byte_exact()

    # -- invariants ------------------------------------------------------------------------

    def _tiers(self) -> list[Tier]:
        return [Tier(s, p) for s, p in zip(self.stores, POLICIES, strict=True)]

    def _committed(self, tier: int) -> set[int]:
        return {c.step for c in self.run(list_checkpoints(self.stores[tier], JOB))}

    def check_retained_steps_pull_byte_exact(self) -> None:
        """Called after every action that deletes anything (pushes and pins cannot break a
        committed step; pulling everything after each of them would only cost time)."""
        for t in (0, 1):
            for step in self._committed(t):
                dest = self.root / "pulled" / f"{t}-{step}-{secrets.token_hex(3)}"
                self.run(pull(self.stores[t], dest, PullPlan(JOB, step), options=OPTS))
                assert tree_bytes(dest) == self.content[step], (t, step)
                shutil.rmtree(dest)

    @invariant()
    def newest_and_pinned_steps_stay(self) -> None:
        for t in (0, 1):
            committed = self._committed(t)
            if self.in_tier[t]:
                assert max(self.in_tier[t] | committed) in committed
            for step, holding in self.pinned.items():
                if t in holding:
                    assert step in committed, (t, step)


TestRetentionMachine = RetentionMachine.TestCase
TestRetentionMachine = pytest.mark.slow(TestRetentionMachine)
# FERRY_MODEL_EXAMPLES=500 for a long run; CI runs the default.
TestRetentionMachine.settings = settings(
    max_examples=int(os.environ.get("FERRY_MODEL_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
)
