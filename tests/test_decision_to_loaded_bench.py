"""The decision-to-loaded benchmark (bench/decision_to_loaded.py) must not rot: one run of
every case on a tiny real DCP series (two 4 MiB saves, the second a small step from the
first); only behaviour is asserted (every case fetched and loaded the right tensors), never
a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_case_fetches_and_loads_the_next_step(tmp_path: Path) -> None:
    from bench import decision_to_loaded
    from bench.write_path import tensor_digest

    series = tmp_path / "series"
    gen = torch.Generator().manual_seed(32)
    state = {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(4)}  # 4 MiB
    dcp.save(state, checkpoint_id=str(series / "step_000010"), no_dist=True)
    state = {name: t + 1e-3 * torch.randn(t.shape, generator=gen) for name, t in state.items()}
    dcp.save(state, checkpoint_id=str(series / "step_000020"), no_dist=True)

    out = tmp_path / "results"
    argv = [str(series), "--runs", "1", "--settle-limit", "0.5", "--out-dir", str(out)]
    assert decision_to_loaded.main(argv) == 0

    doc = json.loads((out / "decision_to_loaded.json").read_text())
    assert doc["k1"] == "step_000020"
    assert doc["reference_digest"] == tensor_digest(state)  # what the loads were checked by
    assert sorted(r["case"] for r in doc["rows"]) == sorted(decision_to_loaded.CASES)
    by_case = {r["case"]: r for r in doc["rows"]}
    streamed = decision_to_loaded.STREAMED
    for row in doc["rows"]:
        assert row["loaded_bytes"] == 4 * 256 * 1024 * 4, row
        assert row["load"] > 0 and row["total"] >= row["load"], row
        assert row["fetch"] > 0 if row["case"] not in streamed else row["fetch"] == 0, row
    for case in streamed:  # the load fetched: the store's bytes, none from the held k for
        assert by_case[case]["moved"] > 0, by_case[case]  # the empty node
    assert by_case["FerryReader holding k"]["moved"] < by_case["FerryReader, empty node"]["moved"]
    assert by_case["standby"]["satisfied_by"] == "replica"
    assert by_case["standby"]["moved"] == 0
    assert by_case["prefetch holding k"]["satisfied_by"] == "restored"
    assert by_case["prefetch, empty node"]["satisfied_by"] == "restored"
    md = (out / "decision_to_loaded.md").read_text()
    for case in decision_to_loaded.CASES:
        assert f"| {case} |" in md


def test_cases_filter_keeps_the_plain_tool_for_the_ratios() -> None:
    from bench import decision_to_loaded as d2l

    assert d2l.chosen_cases(None) == d2l.CASES
    picked = d2l.chosen_cases("prefetch, via its agent")
    assert picked == (
        "prefetch holding k",
        "prefetch, empty node",
        d2l.PLAIN,
        d2l.SYNCED,
        d2l.VIA_AGENT + " holding k",
        d2l.VIA_AGENT + ", cold",
    )
    assert d2l.chosen_cases("nothing like it") == ()
    with pytest.raises(SystemExit):  # a usage error, not an empty run
        d2l.parse_args(["series", "--cases", "nothing like it"])


@pytest.mark.timeout(120)
def test_prefetch_wait_small_step_is_a_save_a_push_takes(tmp_path: Path) -> None:
    """bench/prefetch_wait.py's 1 MB step: a push refused its first form (shards with no
    ``.metadata``), and the bench stopped at its first push."""
    import asyncio

    from bench.prefetch_wait import small_step
    from transfer.engine import push
    from transfer.engine.dcp import metadata_trouble
    from transfer.store import StoreOptions, open_store

    save = tmp_path / "save"
    dcp.save({"w": torch.randn(1 << 19)}, checkpoint_id=str(save), no_dist=True)  # 2 MiB
    step = small_step(save, tmp_path / "small")
    assert metadata_trouble(step) is None  # what `ferry push` checks first
    (tmp_path / "store").mkdir()

    async def push_it() -> int:
        store = open_store(str(tmp_path / "store"), StoreOptions())
        try:
            return (await push(store, step, job="j", step=1, node="n")).bytes_raw
        finally:
            await store.close()

    pushed = asyncio.run(push_it())
    assert 1 << 20 <= pushed < (1 << 20) + (64 << 10)  # the MiB and its .metadata
