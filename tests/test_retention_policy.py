"""Retention policy: which steps each rule keeps, what is never dropped, and the units."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.retention.policy import (
    IN_PROGRESS,
    KEEP_EVERY,
    KEEP_LAST,
    NEWEST,
    PINNED,
    PROTECTED,
    StepFacts,
    TierPolicy,
    fit_budget,
    parse_duration,
    parse_size,
    select,
)

NOW = 1_000_000.0
DAY = 86400.0


def facts(*steps: int, incomplete: tuple[int, ...] = (), pinned: tuple[int, ...] = ()) -> list:
    # step s was written s days before NOW's epoch offset: bigger step, newer
    return [StepFacts(s, s not in incomplete, NOW - (100 - s) * DAY, s in pinned) for s in steps]


def test_keep_last_keeps_the_newest_complete_steps() -> None:
    kept = select(facts(1, 2, 3, 4, 5), TierPolicy(keep_last=2), NOW)
    assert kept == {5: NEWEST, 4: KEEP_LAST}


def test_keep_every_keeps_milestones_beside_keep_last() -> None:
    kept = select(facts(*range(1, 13)), TierPolicy(keep_last=1, keep_every=5), NOW)
    assert kept == {12: NEWEST, 10: KEEP_EVERY, 5: KEEP_EVERY}


def test_max_age_expires_even_milestones_but_never_the_newest() -> None:
    # steps 1..5 are 99..95 days old
    kept = select(facts(1, 2, 3, 4, 5), TierPolicy(keep_every=1, max_age_s=96.5 * DAY), NOW)
    assert kept == {5: NEWEST, 4: KEEP_EVERY}
    kept = select(facts(1, 2, 3), TierPolicy(max_age_s=1.0), NOW)
    assert kept == {3: NEWEST}


def test_pinned_and_in_progress_steps_are_never_dropped() -> None:
    steps = facts(1, 2, 3, 4, 5, incomplete=(5, 2), pinned=(1,))
    kept = select(steps, TierPolicy(keep_last=1), NOW)
    # 4 is the newest complete; 5 (incomplete, newer) may still be uploading; 2 is an
    # abandoned incomplete step and goes; 1 is pinned
    assert kept == {5: IN_PROGRESS, 4: NEWEST, 1: PINNED}


def test_no_count_rule_keeps_everything() -> None:
    assert set(select(facts(1, 2, 3), TierPolicy(), NOW)) == {1, 2, 3}
    assert TierPolicy().keeps_everything


def test_budget_drops_oldest_unprotected_first_across_jobs() -> None:
    kept = {("a", 1): KEEP_LAST, ("b", 2): KEEP_LAST, ("a", 3): NEWEST, ("b", 4): NEWEST}
    created = {("a", 1): 1.0, ("b", 2): 2.0, ("a", 3): 3.0, ("b", 4): 4.0}

    def size(keys: frozenset) -> int:
        return 10 * len(keys)

    assert set(fit_budget(kept, 30, size, created)) == {("b", 2), ("a", 3), ("b", 4)}
    # protected steps stay even when the tier cannot fit
    assert set(fit_budget(kept, 5, size, created)) == {("a", 3), ("b", 4)}


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 60), st.booleans(), st.booleans(), st.floats(0, 50 * DAY)),
        max_size=25,
        unique_by=lambda t: t[0],
    ),
    keep_last=st.none() | st.integers(1, 6),
    keep_every=st.none() | st.integers(1, 10),
    max_age=st.none() | st.floats(1.0, 60 * DAY),
)
def test_invariants_hold_for_any_policy(
    steps: list, keep_last: int | None, keep_every: int | None, max_age: float | None
) -> None:
    all_facts = [StepFacts(s, done, NOW - age, pin) for s, done, pin, age in steps]
    policy = TierPolicy(keep_last, keep_every, max_age)
    kept = select(all_facts, policy, NOW)
    assert set(kept) <= {f.step for f in all_facts}
    complete = sorted((f.step for f in all_facts if f.complete), reverse=True)
    newest = complete[0] if complete else None
    for f in all_facts:
        if f.pinned or newest is None or f.step >= newest:
            assert kept[f.step] in PROTECTED, f  # never dropped, whatever the rules say
    young = {f.step for f in all_facts if max_age is None or NOW - f.created <= max_age}
    if keep_last is not None:
        assert set(complete[:keep_last]) & young <= set(kept)
    if keep_every is not None:
        assert {s for s in complete if s % keep_every == 0} & young <= set(kept)
    dropped_ok = {f.step for f in all_facts} - set(kept)
    assert all(not f.pinned for f in all_facts if f.step in dropped_ok)


def test_units() -> None:
    assert parse_duration("90s") == 90 and parse_duration("30d") == 30 * DAY
    assert parse_duration(12) == 12 and parse_duration("2w") == 14 * DAY
    assert parse_duration("0", allow_zero=True) == 0
    assert parse_size("2TiB") == 2 << 40 and parse_size("500MB") == 500_000_000
    assert parse_size(1024) == 1024
    for bad in ("", "-1d", "5 parsecs", "0", "inf", True):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError, match="positive integer"):
        TierPolicy(keep_last=0)
