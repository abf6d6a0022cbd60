"""The store's connection pool fits the window transfers run with: the configured one,
shrunk by ``memory_mib`` (TransferSettings.to_options), at both front doors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from agent.cli.run import _store_options, build_parser
from agent.daemon.config import load_config
from agent.rpc.app import _tiers
from agent.rpc.appkeys import CONFIG, TIERS
from transfer.engine.catalog import init_store
from transfer.options import MiB, TransferOptions
from transfer.store import open_store

#: 40 parts configured; 512 MiB with one worker leaves (512 - 8 - 3 x 2 x 4) / (2 x 8) = 30
SHRUNK = {"window": "40", "workers": "1", "memory_mib": "512"}


def test_the_cli_pool_follows_the_window_memory_mib_leaves() -> None:
    flags = [x for k, v in SHRUNK.items() for x in (f"--{k.replace('_', '-')}", v)]
    args = build_parser().parse_args(["pull", "s", "d", "--job", "j", *flags])
    assert _store_options(args).pool_size == 30 + 4  # not 40 + 4
    plain = build_parser().parse_args(["pull", "s", "d", "--job", "j", "--window", "40"])
    assert _store_options(plain).pool_size == 44
    assert _store_options(build_parser().parse_args(["ls", "s"])).pool_size == 16 + 4


def test_the_agent_pool_follows_the_window_memory_mib_leaves(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    env = {f"FERRY_TRANSFER_{k.upper()}": v for k, v in SHRUNK.items()}
    env |= {"FERRY_HOT_DIR": str(tmp_path / "hot"), "FERRY_TIERS": str(store_dir)}
    config = load_config(None, env)
    assert config.transfer.window == 40 and config.transfer_options().window == 30

    async def tier_threads() -> int:
        made = open_store(str(store_dir))
        await init_store(made)
        await made.close()
        app = web.Application()
        app[CONFIG] = config
        tiers = _tiers(app)
        await anext(tiers)
        try:
            ((_, store),) = app[TIERS]
            return int(store.threads.size)  # type: ignore[attr-defined]
        finally:
            await tiers.aclose()

    assert asyncio.run(tier_threads()) == 30 + 4  # one per pooled connection; not 40 + 4


def test_a_budget_too_small_says_the_least_that_fits() -> None:
    """The refusal names the smallest budget that would run, and that budget runs (one
    part in flight); a MiB less is refused with the same figure."""
    options = TransferOptions(workers=2)
    with pytest.raises(ValueError, match=r"need at least (\d+) MiB") as refused:
        options.within_budget(10 * MiB)
    least = int(refused.value.args[0].rsplit("at least ", 1)[1].split()[0])
    assert options.within_budget(least * MiB).window == 1
    with pytest.raises(ValueError, match=f"at least {least} MiB"):
        options.within_budget((least - 1) * MiB)
