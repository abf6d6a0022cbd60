"""The agent's configuration loader and the migration/checkpoint-interval arithmetic."""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest

from agent.daemon.config import (
    AgentConfig,
    ConfigError,
    RetentionSettings,
    TransferSettings,
    _host_name,
    effective_config,
    example_toml,
    load_config,
)
from agent.node.estimate import (
    DEFAULT_RATES,
    DEFAULT_SPREAD,
    MAX_PROBE_MISS,
    PREFETCH_START_SECONDS,
    TIMING_JITTER_SECONDS,
    BandwidthMeter,
    MigrationEstimate,
    badput_fraction,
    badput_per_interruption,
    estimate_migration,
    optimal_interval,
    optimal_interval_steps,
)
from transfer.engine import TransferOptions
from transfer.options import StoreSettings, knobs

MiB = 1 << 20


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ferry.toml"
    path.write_text(text)
    return path


# --- config ---------------------------------------------------------------------------


def test_example_toml_loads_with_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # its paths are relative to where the agent starts
    (tmp_path / "ferry.token").write_text("t0ken")
    config = load_config(write(tmp_path, example_toml()), env={})
    assert config.node == _host_name()  # (commented out: one file serves every node)
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 7070)
    assert config.token_file == Path("ferry.token")
    assert config.hot_dir == Path("ckpt/hot")
    assert config.tiers == ("ckpt/store",)
    assert config.peers == () and config.expected_nodes == ()  # one node, as printed
    assert config.endpoint_url is None
    assert config.state_dir == Path("ckpt/hot/.ferry")
    assert config.quiet_seconds == 2.0 and config.log_format == "text"
    assert config.transfer == TransferSettings()  # the example shows the defaults
    assert config.store == StoreSettings()
    assert config.retention is None  # as printed it deletes nothing (its table is commented)


def _uncommented_retention(text: str) -> str:
    """The example with its [retention] table uncommented, as its comment says: one "# "
    off each line from "# [retention]" on."""
    head, sep, tail = text.partition("# [retention]\n")
    assert sep, "the example has no commented [retention] table"
    lines = (sep + tail).splitlines(keepends=True)
    return head + "".join(line[2:] if line.startswith("# ") else line[1:] for line in lines)


def test_example_toml_documents_every_key() -> None:
    text = example_toml()
    for f in [*fields(AgentConfig), *fields(TransferSettings), *fields(StoreSettings)]:
        if f.name not in ("transfer", "store", "retention", "sources"):  # tables; provenance
            assert f"\n{f.name} =" in text or f"\n# {f.name} =" in text, f.name
    retention = _uncommented_retention(text)
    assert "\n[retention]\n" in retention and "\n[[retention.tiers]]" in retention
    for f in fields(RetentionSettings):
        key = {
            "hot_budget_bytes": "hot_budget",
            "hot_min_free_bytes": "hot_min_free",
            "tiers": "[[retention.tiers]]",
        }.get(f.name, f.name)
        assert f"\n{key}" in retention or f"\n# {key}" in retention, key


def test_the_printed_config_deletes_nothing_as_the_readme_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 (11): the printed config had `[retention] hot_keep_last = 2` live, so an agent
    started from it evicted step 100 from the hot dir, while the README said "as printed ...
    is pushed" and "without the table nothing is ever deleted"."""
    import asyncio

    from agent.rpc.client import FerryClient
    from tests.harness import TOKEN, agent

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ferry.token").write_text(TOKEN)
    printed = example_toml()
    assert load_config(write(tmp_path, printed), env={}).retention is None
    assert not any(line.startswith("[retention") for line in printed.splitlines())
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    as_printed = readme[readme.index("As printed, a checkpoint") :].split(". ")[0]
    assert "nothing is ever deleted" in as_printed and "commented out" in as_printed
    assert "Without the table nothing is ever deleted" in readme
    # uncommented, as its comment says: the policy the README describes
    retention = load_config(write(tmp_path, _uncommented_retention(printed)), env={}).retention
    assert retention is not None and retention.hot_keep_last == 2
    assert retention.tier_policy(0).keep_last == 20

    async def started_from_it() -> dict[str, object]:
        (tmp_path / "ckpt" / "hot").mkdir(parents=True)
        (tmp_path / "ckpt" / "store").mkdir()
        async with (
            agent(tmp_path / "ckpt" / "hot", ["ckpt/store"], config_text=printed) as url,
            FerryClient(url, TOKEN) as client,
        ):
            return await client.retention()

    assert asyncio.run(started_from_it()) == {"enabled": False}


def test_retention_table_is_validated(tmp_path: Path) -> None:
    def load(text: str, env: dict[str, str] | None = None) -> RetentionSettings | None:
        path = tmp_path / "f.toml"
        path.write_text('hot_dir = "/h"\ntiers = ["/a", "/b"]\n' + text)
        return load_config(path, env=env or {}).retention

    assert load("") is None  # no table: the agent deletes nothing
    r = load(
        '[retention]\nhot_budget = "1GiB"\n[[retention.tiers]]\nkeep_last = 3\nmax_age = "2d"\n'
    )
    assert r is not None and r.hot_budget_bytes == 1 << 30 and r.hot_keep_last == 2
    assert r.tier_policy(0).keep_last == 3 and r.tier_policy(0).max_age_s == 2 * 86400
    assert r.tier_policy(1).keeps_everything
    env_only = load("", {"FERRY_RETENTION_GRACE_SECONDS": "60"})
    assert env_only is not None and env_only.grace_seconds == 60
    for bad, message in [
        ("[retention]\nhot_keep_last = 1\n", "at least 2"),
        ('[retention]\nhot_budget = "lots"\n', "retention.hot_budget"),
        ("[retention]\nbogus = 1\n", "retention.bogus"),
        ("[[retention.tiers]]\nkeep_last = 0\n", "keep_last: must be at least 1"),
        ('[[retention.tiers]]\nmax_age = "soon"\n', "tiers\\[0\\].max_age"),
        ("[[retention.tiers]]\nkeep_lats = 3\n", "keep_lats"),
        ("[[retention.tiers]]\n[[retention.tiers]]\n[[retention.tiers]]\n", "3 policies for 2"),
        ("[retention]\ndeep_verify = 1\n", "true or false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load(bad)


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "FERRY_NODE": "node-09",
        "FERRY_LISTEN": "0.0.0.0:8080",
        "FERRY_HOT_DIR": "/other",
        "FERRY_TIERS": " /mnt/a , s3://b/p ,",
        "FERRY_PEERS": "",  # an empty list variable clears the file's list
        "FERRY_DRAIN_SECONDS": "5",
        "FERRY_TRANSFER_WINDOW": "4",
        "FERRY_TOKEN_FILE": str(tmp_path / "token"),
    }
    (tmp_path / "token").write_text("t0ken")
    config = load_config(write(tmp_path, example_toml()), env=env)
    assert config.sources["node"] == "env FERRY_NODE"
    assert config.sources["commit_marker"] == "file"
    assert config.sources["transfer.window"] == "env FERRY_TRANSFER_WINDOW, over the file's"
    effective = {key: (value, source) for key, value, source in effective_config(config)}
    assert effective["node"] == ("node-09", "env FERRY_NODE")
    assert effective["standby_memory"][0] == "auto"  # (None in the config: said as set)
    # the S3 tiers' endpoint when endpoint_url is not set: botocore's variables, named
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert dict((k, (v, s)) for k, v, s in effective_config(config))["endpoint_url"] == (
        None,
        "default",
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.0.0.5:9000")
    effective = {key: (value, source) for key, value, source in effective_config(config)}
    assert effective["endpoint_url"] == ("http://10.0.0.5:9000", "env AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://me:s3cret@s3.internal:9000")  # (wins)
    effective = {key: (value, source) for key, value, source in effective_config(config)}
    assert effective["endpoint_url"] == ("https://***@s3.internal:9000", "env AWS_ENDPOINT_URL_S3")
    assert config.node == "node-09"
    assert config.listen_port == 8080
    assert config.hot_dir == Path("/other")
    assert config.tiers == ("/mnt/a", "s3://b/p")
    assert config.peers == ()
    assert config.drain_seconds == 5.0
    assert config.transfer_options().window == 4


def test_environment_alone_with_defaults() -> None:
    config = load_config(None, env={"FERRY_HOT_DIR": "/hot", "FERRY_EXPECTED_NODES": "a,b"})
    assert config.state_dir == Path("/hot/.ferry")
    assert config.expected_nodes == ("a", "b")
    assert config.commit_marker == ".metadata"
    assert config.max_body_bytes == MiB
    assert config.token_file is None and config.read_token() is None
    assert config.transfer_options() == TransferOptions()


def test_hot_dir_required() -> None:
    with pytest.raises(ConfigError, match="hot_dir"):
        load_config(None, env={})


def test_unknown_keys_rejected_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'hot_dri'"):
        load_config(write(tmp_path, 'hot_dri = "/x"\n'), env={})
    with pytest.raises(ConfigError, match=r"'transfer\.windw'"):
        load_config(write(tmp_path, 'hot_dir = "/x"\n[transfer]\nwindw = 3\n'), env={})


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ('hot_dir = "/x"\nprefetch_concurrency = "2"', {}, "prefetch_concurrency: expected an int"),
        ('hot_dir = "/x"\ntiers = "s3://b"', {}, "tiers: expected a list"),
        ('hot_dir = "/x"\n[transfer]\nworkers = true', {}, "transfer.workers: expected an int"),
        ('hot_dir = "/x"', {"FERRY_MAX_BODY_BYTES": "1MB"}, "FERRY_MAX_BODY_BYTES: expected an"),
        ("hot_dir = 3", {}, "hot_dir: expected a string"),
    ],
)
def test_wrong_types_rejected(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, toml + "\n"), env=env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FERRY_NODE": "../etc"}, "invalid FERRY_NODE name"),  # (the variable, not the key)
        ({"FERRY_EXPECTED_NODES": "a,a"}, "FERRY_EXPECTED_NODES: duplicate"),
        ({"FERRY_LISTEN": "7070"}, "FERRY_LISTEN: expected HOST:PORT"),
        ({"FERRY_LISTEN": "host:70000"}, "FERRY_LISTEN: expected HOST:PORT"),
        ({"FERRY_LISTEN": ":7070"}, "FERRY_LISTEN: expected HOST:PORT"),
        ({"FERRY_PEERS": "10.0.0.2:7070"}, "FERRY_PEERS: expected an http"),
        ({"FERRY_TIERS": "gs://bucket"}, "FERRY_TIERS: unsupported store URL"),
        ({"FERRY_COMMIT_MARKER": "a/b"}, "FERRY_COMMIT_MARKER: expected a file name"),
        ({"FERRY_PREFETCH_CONCURRENCY": "0"}, "FERRY_PREFETCH_CONCURRENCY: must be at least 1"),
        # (named as the [transfer] table's keys, in their unit: it said "chunk_size must be
        # within 4 KiB..64 MiB", a key that does not exist and a size that cannot be set)
        (
            {"FERRY_TRANSFER_PART_SIZE_MIB": "1"},
            r"^\[transfer\] part_size_mib must be at least chunk_size_mib$",
        ),
        (
            {"FERRY_TRANSFER_CHUNK_SIZE_MIB": "0"},
            r"^\[transfer\] chunk_size_mib must be within 1\.\.64$",
        ),
    ],
)
def test_bad_values_rejected(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, env={"FERRY_HOT_DIR": "/x", **env})


def test_ipv6_listen() -> None:
    config = load_config(None, env={"FERRY_HOT_DIR": "/x", "FERRY_LISTEN": "[::1]:0"})
    assert (config.listen_host, config.listen_port) == ("::1", 0)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "hot_dir = \n"), env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})


def test_token_file_read_stripped_and_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    token.chmod(0o600)
    env = {"FERRY_HOT_DIR": "/x", "FERRY_TOKEN_FILE": str(token)}
    with caplog.at_level(logging.WARNING):
        assert load_config(None, env=env).read_token() == "s3cret"
    assert not caplog.records

    token.chmod(0o640)  # group-readable: a Secret mounted with fsGroup; fine
    with caplog.at_level(logging.WARNING):
        load_config(None, env=env)
    assert not caplog.records

    token.chmod(0o644)  # readable by others: warned about, not refused
    with caplog.at_level(logging.WARNING):
        load_config(None, env=env)
    assert "readable by others" in caplog.text

    token.write_text(" \n")
    with pytest.raises(ConfigError, match="empty"):
        load_config(None, env=env)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(None, env={**env, "FERRY_TOKEN_FILE": str(tmp_path / "nope")})


def test_transfer_options_mapping(tmp_path: Path) -> None:
    toml = """hot_dir = "/x"
[transfer]
chunk_size_mib = 8
part_size_mib = 16
pack_size_mib = 64
window = 3
workers = 2
zstd_level = 0
max_chain = 7
delta_min_saving = 0.5
"""
    env = {"FERRY_TRANSFER_MAX_COLD_COST": "3"}
    options = load_config(write(tmp_path, toml), env=env).transfer_options()
    assert options == TransferOptions(
        chunk_size=8 * MiB,
        part_size=16 * MiB,
        pack_size=64 * MiB,
        window=3,
        workers=2,
        zstd_level=None,
        max_chain=7,
        delta_min_saving=0.5,
        max_cold_cost=3.0,
    )
    bad = toml.replace("delta_min_saving = 0.5", "delta_min_saving = 1.5")
    with pytest.raises(ConfigError, match="delta_min_saving must be within"):
        load_config(write(tmp_path, bad), env={})


def test_a_switch_in_the_transfer_table_is_true_or_false(tmp_path: Path) -> None:
    on = load_config(write(tmp_path, 'hot_dir = "/x"\n[transfer]\ndelta = true\n'), env={})
    assert on.transfer_options().delta is True
    off = load_config(None, env={"FERRY_HOT_DIR": "/x", "FERRY_TRANSFER_DELTA": "0"})
    assert off.transfer_options().delta is False
    with pytest.raises(ConfigError, match=r"transfer\.delta: expected true or false"):
        load_config(write(tmp_path, 'hot_dir = "/x"\n[transfer]\ndelta = 1\n'), env={})
    with pytest.raises(ConfigError, match="FERRY_TRANSFER_DELTA: expected true or false"):
        load_config(None, env={"FERRY_HOT_DIR": "/x", "FERRY_TRANSFER_DELTA": "maybe"})


@pytest.mark.parametrize(
    ("settings", "table"), [(TransferSettings, "transfer"), (StoreSettings, "store")]
)
def test_every_tunable_is_a_cli_flag_a_config_key_and_in_the_example(
    settings: type, table: str
) -> None:
    """Declared once (TransferSettings, StoreSettings): the CLI, the config's table, its
    FERRY_<TABLE>_* variables and the example all follow the declaration."""
    from agent.cli.run import build_parser

    example = example_toml()
    assert f"\n[{table}]\n" in example
    for knob in knobs(settings):
        flag = "--" + knob.name.replace("_", "-")
        if knob.kind is bool:  # a switch: --name / --no-name
            given, in_toml = (
                [flag if knob.default else "--no-" + flag[2:]],
                str(knob.default).lower(),
            )
        else:
            given, in_toml = [flag, str(knob.default)], str(knob.default)
            in_toml = f'"{in_toml}"' if knob.kind is str else in_toml
        args = build_parser().parse_args(["push", "d", "s", "--job", "j", *given])
        assert getattr(args, knob.name) == knob.default and isinstance(
            getattr(args, knob.name), knob.kind
        )
        assert f"{knob.name} = {in_toml}" in example, knob.name
        env = {
            "FERRY_HOT_DIR": "/x",
            f"FERRY_{table.upper()}_{knob.name.upper()}": in_toml.strip('"'),
        }
        config = load_config(None, env)
        assert getattr(getattr(config, table), knob.name) == knob.default
        assert config.sources[f"{table}.{knob.name}"].startswith("env FERRY_")
    for knob in knobs(settings):  # a choice outside its choices is refused at both doors
        if knob.choices:
            with pytest.raises(SystemExit):
                build_parser().parse_args(["push", "d", "s", "--job", "j", f"--{knob.name}", "x"])
            with pytest.raises(ConfigError, match=f"{table}.{knob.name}: 'x' is not one of"):
                load_config(
                    None, {"FERRY_HOT_DIR": "/x", f"FERRY_{table.upper()}_{knob.name.upper()}": "x"}
                )


# --- bandwidth and migration estimates ---------------------------------------------------


def test_meter_defaults_before_samples() -> None:
    meter = BandwidthMeter()
    assert meter.rate("local") == 1.0e9
    assert meter.rate("peer") == 0.5e9
    assert meter.rate("tier:s3://bucket/x") == 0.2e9
    assert not meter.measured("peer")
    assert meter.snapshot() == {}
    with pytest.raises(ValueError, match="unknown source"):
        meter.rate("carrier-pigeon")


def test_meter_measures_and_ignores_tiny_samples() -> None:
    meter = BandwidthMeter()
    assert not meter.record("peer", 512 * 1024, 1.0)  # too few bytes
    assert not meter.record("peer", 100 * MiB, 0.005)  # too short
    assert not meter.measured("peer")

    assert meter.record("peer", 100 * MiB, 1.0)
    assert meter.measured("peer")
    assert meter.rate("peer") == 100 * MiB
    assert meter.snapshot() == {"peer": 100 * MiB}
    assert meter.rate("tier:s3://b") == DEFAULT_RATES["tier"]  # other sources unaffected
    # a local re-hash has no request latency: a short one is a measurement too
    assert meter.record("local", 100 * MiB, 0.005) and meter.rate("local") == 20_000 * MiB


def test_meter_ewma_moves_toward_new_samples() -> None:
    meter = BandwidthMeter()
    meter.record("local", 100 * MiB, 1.0)
    meter.record("local", 200 * MiB, 1.0)
    assert meter.rate("local") == pytest.approx(0.3 * 200 * MiB + 0.7 * 100 * MiB)
    for _ in range(30):
        meter.record("local", 200 * MiB, 1.0)
    assert meter.rate("local") == pytest.approx(200 * MiB, rel=1e-3)


def test_estimate_range_follows_how_steady_a_source_has_been() -> None:
    """The range is the rate +- twice the spread of past samples: wide before two samples,
    narrow for a steady source, wide again once it turns erratic."""
    meter = BandwidthMeter()
    first = estimate_migration({"tier:x": 400 * MiB}, meter, bytes_total=1, gpus=1,
                               gpu_hour_price=0)  # fmt: skip
    assert first.seconds_low < first.seconds < first.seconds_high
    assert first.seconds_high / first.seconds == pytest.approx(2.0)  # DEFAULT_SPREAD 0.25
    for _ in range(12):
        meter.record("tier:x", 200 * MiB, 1.0)
    steady = estimate_migration({"tier:x": 400 * MiB}, meter, bytes_total=1, gpus=1,
                                gpu_hour_price=0)  # fmt: skip
    assert steady.seconds == pytest.approx(2.0)
    assert steady.seconds_high - steady.seconds_low < 0.05 * steady.seconds
    for rate in (100, 300, 100, 300, 100, 300):
        meter.record("tier:x", rate * MiB, 1.0)
    erratic = estimate_migration({"tier:x": 400 * MiB}, meter, bytes_total=1, gpus=1,
                                 gpu_hour_price=0)  # fmt: skip
    assert erratic.seconds_high - erratic.seconds_low > 0.5 * erratic.seconds
    assert erratic.seconds_low < erratic.seconds < erratic.seconds_high


def test_a_probe_rate_is_used_until_the_first_transfer_replaces_it() -> None:
    """A probe (a few chunks, no disk writes) runs faster than a restore: its rate stands
    in at first contact and is replaced, not averaged, by the first transfer's."""
    meter = BandwidthMeter()
    assert meter.record("tier:x", 300 * MiB, 1.0, provisional=True)
    assert meter.measured("tier:x") and meter.rate("tier:x") == 300 * MiB
    assert not meter.record("tier:x", 900 * MiB, 1.0, provisional=True)  # one probe only
    assert BandwidthMeter().record("tier:y", 8 * MiB, 0.004, provisional=True)  # small: counts
    meter.record("tier:x", 200 * MiB, 1.0)
    assert meter.rate("tier:x") == 200 * MiB  # replaced
    meter.record("tier:x", 100 * MiB, 1.0)
    assert meter.rate("tier:x") == pytest.approx(0.3 * 100 * MiB + 0.7 * 200 * MiB)
    assert not meter.record("tier:x", 900 * MiB, 1.0, provisional=True)


def test_a_first_transfer_far_from_its_probe_widens_the_range_until_a_second() -> None:
    """Before two transfers the spread is a default; where the first transfer lands further
    from its probe than that, the two disagree by as much, and the range reaches back to
    the probe's rate (the next transfer ran at it on loopback). A close probe changes
    nothing; a second transfer measures the spread itself."""

    def estimate(meter: BandwidthMeter) -> MigrationEstimate:
        return estimate_migration({"tier:x": 300 * MiB}, meter, bytes_total=1, gpus=1,
                                  gpu_hour_price=0)  # fmt: skip

    close = BandwidthMeter()
    close.record("tier:x", 210 * MiB, 1.0, provisional=True)
    close.record("tier:x", 200 * MiB, 1.0)
    assert close.spread("tier:x") == DEFAULT_SPREAD
    far = BandwidthMeter()
    far.record("tier:x", 400 * MiB, 1.0, provisional=True)
    far.record("tier:x", 200 * MiB, 1.0)
    assert far.spread("tier:x") == pytest.approx(1.0)
    assert estimate(far).seconds == estimate(close).seconds == pytest.approx(1.5)
    assert estimate(far).seconds_low <= 0.75 < estimate(close).seconds_low  # the probe's time
    far.record("tier:x", 200 * MiB, 1.0)
    assert far.spread("tier:x") == 0.0
    # a probe slower by as much counts as much; a wild one at most MAX_PROBE_MISS; the
    # disk's write probe not at all (it times a probe alone, a restore its writes beside
    # a fetch: they differ by design)
    slow, wild = BandwidthMeter(), BandwidthMeter()
    slow.record("tier:x", 100 * MiB, 1.0, provisional=True)
    slow.record("tier:x", 200 * MiB, 1.0)
    wild.record("tier:x", 5000 * MiB, 1.0, provisional=True)
    wild.record("tier:x", 200 * MiB, 1.0)
    wild.record("disk", 3000 * MiB, 1.0, provisional=True)
    wild.record("disk", 280 * MiB, 1.0)
    assert slow.spread("tier:x") == pytest.approx(1.0)
    assert wild.spread("tier:x") == MAX_PROBE_MISS and wild.spread("disk") == DEFAULT_SPREAD


def test_a_prefetch_that_moves_nothing_still_costs_its_start() -> None:
    """A replica's prefetch moves no byte but is not free: the fixed part is in the
    estimate and in its range (half to twice it, and at least TIMING_JITTER_SECONDS either
    side: one replica prefetch of 57 took 0.06 s where most took 0.02-0.03 s)."""
    meter = BandwidthMeter()
    est = estimate_migration({"local": 0}, meter, bytes_total=5, gpus=1, gpu_hour_price=0,
                             fixed_seconds=0.02)  # fmt: skip
    got = (est.seconds, est.seconds_low, est.seconds_high)
    assert got == pytest.approx((0.02, 0.0, 0.02 + TIMING_JITTER_SECONDS))
    est = estimate_migration({"local": 0}, meter, bytes_total=5, gpus=1, gpu_hour_price=0,
                             fixed_seconds=0.5)  # fmt: skip
    assert (est.seconds, est.seconds_low, est.seconds_high) == pytest.approx((0.5, 0.25, 1.0))


def test_migration_cost_and_cooldown() -> None:
    meter = BandwidthMeter()
    meter.record("peer", 1_000_000_000, 2.0)  # 0.5 GB/s, same as the default, but measured
    est = estimate_migration(
        {"peer": 1_000_000_000, "tier:s3://b": 400_000_000},
        meter,
        bytes_total=3_000_000_000,
        gpus=8,
        gpu_hour_price=2.5,
    )
    assert est.seconds == pytest.approx(2.0 + 2.0)  # sequential: 1 GB at 0.5 + 0.4 GB at 0.2
    assert est.bytes_missing == 1_400_000_000
    assert est.cost == pytest.approx(4.0 / 3600 * 8 * 2.5)
    assert est.cooldown_seconds == pytest.approx(304.0)
    doc = est.to_dict()
    assert doc["bytes_by_source"] == {"peer": 1_000_000_000, "tier:s3://b": 400_000_000}
    assert doc["cost"] == est.cost

    parallel = estimate_migration(
        {"peer": 1_000_000_000, "tier:s3://b": 400_000_000},
        meter,
        bytes_total=3_000_000_000,
        gpus=8,
        gpu_hour_price=2.5,
        parallel=True,
    )
    assert parallel.seconds == pytest.approx(2.0)


def test_migration_invalid_inputs() -> None:
    meter = BandwidthMeter()
    # more than the checkpoint's size is no error: a delta-coded step brings its bases
    more = estimate_migration({"tier:x": 10}, meter, bytes_total=5, gpus=1, gpu_hour_price=1.0)
    assert more.bytes_missing == 10 and more.bytes_total == 5
    with pytest.raises(ValueError):
        estimate_migration({"local": 1}, meter, bytes_total=5, gpus=-1, gpu_hour_price=1.0)
    with pytest.raises(ValueError):
        estimate_migration({"local": -1}, meter, bytes_total=5, gpus=1, gpu_hour_price=1.0)


# --- checkpoint interval -------------------------------------------------------------------


def test_badput_arithmetic() -> None:
    # 60 s saves every 1800 s, an interruption every 6 h costing a 120 s restart: Daly's
    # complete model, and Young's first order close to it where everything is << the MTBI
    exact = badput_fraction(60, 1800, 21600, restart_seconds=120)
    wall = 21600 * math.exp(120 / 21600) * math.expm1((1800 + 60) / 21600)
    assert exact == pytest.approx(1 - 1800 / wall)
    assert exact == pytest.approx(60 / 1800 + (120 + 900) / 21600, rel=0.05)
    assert badput_per_interruption(30, 100, 2.0) == pytest.approx(130.0)


@pytest.mark.parametrize(
    ("save", "interval", "mtbi", "restart"),
    [(600, 657, 360, 0), (60, 208, 360, 400), (6, 100_000, 7200, 0), (1, 1e9, 1, 0)],
)
def test_badput_is_a_fraction_where_the_first_order_passes_100_percent(
    save: float, interval: float, mtbi: float, restart: float
) -> None:
    """`ferry plan` printed "badput 182.57%" (a 600 s save against a 6 min MTBI) and 694%
    for an interval 14x the MTBI: Young's first order, out of its range. The complete
    model stays a fraction (1.0 once the rest rounds away: an interval 10^9 MTBIs long, no
    overflow), above what the save alone costs."""
    first_order = save / interval + (restart + interval / 2) / mtbi
    assert first_order > 1
    lost = badput_fraction(save, interval, mtbi, restart)
    assert save / (interval + save) < lost <= 1


@pytest.mark.parametrize(("save", "mtbi"), [(60.0, 21600.0), (5.0, 3600.0), (300.0, 86400.0)])
def test_optimal_interval_minimizes_badput(save: float, mtbi: float) -> None:
    best = optimal_interval(save, mtbi)
    assert best == pytest.approx((2 * save * mtbi) ** 0.5, rel=0.05)  # Young, to first order
    at_best = badput_fraction(save, best, mtbi, restart_seconds=30)
    for factor in (0.99, 1.01, 0.5, 0.9, 1.1, 2.0):
        assert at_best < badput_fraction(save, best * factor, mtbi, restart_seconds=30)


def test_optimal_interval_at_the_extremes() -> None:
    """A save far shorter than the MTBI: Young's to many digits (the search stopped at an
    absolute step of the MTBI's size before: 466 s for 44.7); a save 10^3 MTBIs long: no
    overflow (math.exp raised OverflowError; `ferry plan` printed a traceback)."""
    assert optimal_interval(1e-9, 1e12) == pytest.approx((2 * 1e-9 * 1e12) ** 0.5, rel=1e-6)
    assert 0 < optimal_interval(3600, 3.6) < 3.6
    assert optimal_interval_steps(3600, 2.0, 3.6) == 1


def test_optimal_interval_steps() -> None:
    # the complete model's optimum, 1570.2 s (Young's 1610 s): at 2 s per step 785.1 steps
    steps = optimal_interval_steps(60, 2.0, 21600)
    assert steps == 785
    for other in (steps - 1, steps + 1):
        assert badput_fraction(60, steps * 2.0, 21600) <= badput_fraction(60, other * 2.0, 21600)
    assert optimal_interval_steps(1, 1000.0, 100) == 1  # a step longer than the optimum


@pytest.mark.parametrize(
    "call",
    [
        lambda: badput_fraction(60, 0, 3600),
        lambda: badput_fraction(60, 100, -1),
        lambda: badput_fraction(-1, 100, 3600),
        lambda: badput_fraction(60, 100, float("nan")),
        lambda: optimal_interval(0, 3600),
        lambda: optimal_interval(60, 0),
        lambda: badput_per_interruption(60, 0, 1.0),
        lambda: optimal_interval_steps(60, 0, 3600),
        lambda: BandwidthMeter().record("peer", -1, 1.0),
    ],
)
def test_invalid_inputs_raise(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def test_the_store_settings_and_the_pool_reach_the_agent_as_the_cli(tmp_path: Path) -> None:
    """Both front doors size the store's pool to the window and choose the store settings
    the same way (the agent once had neither: a 32-connection pool and always crc32). The
    top-level ``checksum`` of configs written before the [store] table still counts."""
    from transfer.options import CHECKSUMS
    from transfer.store import StoreOptions

    base = {"FERRY_HOT_DIR": "/hot"}
    assert load_config(None, base).store.checksum == CHECKSUMS[0] == "crc32"
    config = load_config(None, {**base, "FERRY_CHECKSUM": "md5", "FERRY_TRANSFER_WINDOW": "40"})
    assert config.store.checksum == "md5"
    assert config.sources["store.checksum"] == "env FERRY_CHECKSUM"
    old = load_config(write(tmp_path, 'hot_dir = "/x"\nchecksum = "none"\n'), env={})
    assert old.store.checksum == "none" and old.sources["store.checksum"] == "file"
    with pytest.raises(ConfigError, match="checksum: 'sha1' is not one of crc32, md5, none"):
        load_config(None, {**base, "FERRY_CHECKSUM": "sha1"})
    with pytest.raises(ConfigError, match=r"checksum: set both at the top level and in \[store\]"):
        load_config(None, {**base, "FERRY_CHECKSUM": "md5", "FERRY_STORE_CHECKSUM": "none"})
    with pytest.raises(ConfigError, match="store: attempts must be at least 1"):
        load_config(None, {**base, "FERRY_STORE_ATTEMPTS": "0"})
    options = StoreOptions.for_window(config.transfer.window, settings=config.store)
    assert (options.pool_size, options.settings.checksum) == (44, "md5")
    assert StoreOptions.for_window(2).pool_size == 16  # never below the control calls' need


@pytest.mark.parametrize(
    "url", ["{tmp}/store", "file://{tmp}/store", "memory://settings-test", "s3://bucket/p"]
)
def test_open_store_gives_every_backend_the_settings_retry_policy(tmp_path: Path, url: str) -> None:
    """The one retry policy is made from StoreSettings by open_store, whichever backend the
    URL picks (a local or NFS store too), and its threads are as many as the options' pool
    (never the process's shared default executor); S3 also gets its checksum and timeouts."""
    from transfer.options import StoreSettings
    from transfer.store import StoreOptions, open_store

    settings = StoreSettings(
        checksum="md5", attempts=2, connect_timeout_seconds=3.0, read_timeout_seconds=7.0
    )
    store = open_store(url.format(tmp=tmp_path), StoreOptions("http://127.0.0.1:1", 5, settings))
    assert store.retry.attempts == 2  # type: ignore[attr-defined]
    threads = store._threads if url.startswith("s3://") else store.threads  # type: ignore[attr-defined]
    assert threads.size == 5
    if url.startswith("s3://"):
        assert store.checksum_kind == "md5"  # type: ignore[attr-defined]
        assert store.client.retry is store.retry  # type: ignore[attr-defined]
        assert (store.client.settings.connect_timeout, store.client.settings.read_timeout) == (
            3.0,
            7.0,
        )  # type: ignore[attr-defined]


def test_no_commit_marker_needs_a_quiet_period(tmp_path: Path) -> None:
    """``commit_marker = ""`` (a node of a node-local multi-node save that never holds
    .metadata): files staying the same ``quiet_seconds`` apart are then the only sign a
    part is finished, so no quiet period is refused, and one is accepted."""
    with pytest.raises(ConfigError, match='commit_marker = "" needs quiet_seconds > 0'):
        load_config(
            write(tmp_path, 'hot_dir = "/x"\ncommit_marker = ""\nquiet_seconds = 0\n'), env={}
        )
    config = load_config(write(tmp_path, 'hot_dir = "/x"\ncommit_marker = ""\n'), env={})
    assert config.commit_marker == "" and config.quiet_seconds > 0


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from agent.cli.run import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_says_its_default_once() -> None:
    """Issue 29 (b): `--workers` read "hash/codec threads (default: cores) (default 2)"."""
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.help and action.help != argparse.SUPPRESS:
                assert action.help.count("default") <= 1, (name, action.option_strings)
    help_text = " ".join(_subcommands()["push"].format_help().split())
    cores = TransferSettings().workers
    assert f"hash/codec threads (default: this machine's cores, {cores} here)" in help_text


def test_each_command_lists_only_the_knobs_it_uses() -> None:
    """Issue 29 (c): `ferry pull --help` listed push-only flags (--zstd-level, --max-chain,
    ...). A read lists what a read uses; the push-only flags are still accepted there."""
    commands = _subcommands()
    push_only = {"--" + k.name.replace("_", "-") for k in knobs(TransferSettings) if k.writes}
    push_only |= {"--no-delta", "--checksum"}
    assert {"--zstd-level", "--max-chain", "--dedupe-steps", "--delta"} <= push_only
    read_knobs = {"--part-size-mib", "--window", "--workers", "--memory-mib"}
    for name in ("pull", "verify"):
        listed = set(re.findall(r"--[a-z-]+", commands[name].format_help()))
        assert not listed & push_only, (name, listed & push_only)
        assert read_knobs <= listed, name
    for name in ("ls", "du"):
        listed = set(re.findall(r"--[a-z-]+", commands[name].format_help()))
        assert "--checksum" not in listed and "--attempts" in listed, name
    push_help = set(re.findall(r"--[a-z-]+", commands["push"].format_help()))
    assert push_only | read_knobs <= push_help
    for name in ("pin", "retention"):  # they write to the store
        assert "--checksum" in commands[name].format_help(), name
    # one set of flags still serves a script's push and pull
    from agent.cli.run import build_parser

    args = build_parser().parse_args(["pull", "s", "d", "--job", "j", "--zstd-level", "3"])
    assert args.zstd_level == 3


def test_a_restore_takes_as_long_as_the_slower_of_its_source_and_its_disk() -> None:
    """Issue 32: the estimate knows the disk it writes to. A restore streams, so a disk
    slower than the source sets its time (a node whose volume is slower than its network),
    a faster one leaves the source's; the two never add up."""
    meter = BandwidthMeter()
    meter.record("tier:x", 400 * MiB, 1.0)  # the source: 400 MiB/s
    meter.record("disk", 100 * MiB, 1.0)  # the disk: 100 MiB/s
    slow_disk = estimate_migration({"tier:x": 200 * MiB}, meter, bytes_total=400 * MiB,
                                   gpus=1, gpu_hour_price=0, bytes_written=400 * MiB)  # fmt: skip
    assert slow_disk.seconds == pytest.approx(4.0)  # the disk's 400 MiB, not the tier's 0.5 s
    assert slow_disk.seconds_low < 4.0 < slow_disk.seconds_high  # the disk's spread widens it
    meter.record("disk", 4000 * MiB, 1.0)  # (EWMA: ~1.27 GiB/s)
    fast_disk = estimate_migration({"tier:x": 200 * MiB}, meter, bytes_total=400 * MiB,
                                   gpus=1, gpu_hour_price=0, bytes_written=400 * MiB)  # fmt: skip
    assert fast_disk.seconds == pytest.approx(0.5)  # the source's time: overlapped, not added
    nothing = estimate_migration({"local": 0}, meter, bytes_total=5, gpus=1, gpu_hour_price=0)
    assert nothing.seconds == 0.0  # nothing written (a replica): the disk costs nothing
    with pytest.raises(ValueError):
        estimate_migration({}, meter, bytes_total=1, gpus=1, gpu_hour_price=0, bytes_written=-1)


def test_rates_taken_alone_add_the_disk_until_a_restore_has_measured_them() -> None:
    """A probe rates the source alone, without writing, and the disk alone, without
    receiving: a restore that does both at once on shared cores took their sum, not the
    slower (first contact from a tier, 289 MB, 2 cores: -35..-48% as the slower). Once a
    restore measured the source, its rate includes the writes beside it: the slower."""
    meter = BandwidthMeter()
    meter.record("tier:x", 400 * MiB, 1.0, provisional=True)  # a probe: 400 MiB/s alone
    meter.record("disk", 800 * MiB, 1.0, provisional=True)  # the write probe: 800 MiB/s
    first = estimate_migration({"tier:x": 400 * MiB}, meter, bytes_total=400 * MiB,
                               gpus=1, gpu_hour_price=0, bytes_written=400 * MiB)  # fmt: skip
    assert first.seconds == pytest.approx(1.5)  # 1 s receiving + 0.5 s writing
    assert first.seconds_low < 1.0 < 1.5 < first.seconds_high  # down to the slower of the two
    meter.record("tier:x", 400 * MiB, 1.0)  # a restore's own figure replaces the probe's
    after = estimate_migration({"tier:x": 400 * MiB}, meter, bytes_total=400 * MiB,
                               gpus=1, gpu_hour_price=0, bytes_written=400 * MiB)  # fmt: skip
    assert after.seconds == pytest.approx(1.0)
    default = estimate_migration({"peer:y": 100 * MiB}, meter, bytes_total=400 * MiB,
                                 gpus=1, gpu_hour_price=0, bytes_written=400 * MiB)  # fmt: skip
    assert default.seconds == pytest.approx(100 * MiB / 0.5e9 + 0.5)  # a default adds too


def test_the_write_probe_takes_a_small_part_of_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs beside training's saves: on a hot dir with little free it writes at
    most a sixteenth of what is free, in whole blocks, and nothing at all below 8 MiB (a
    64 MiB probe on a 48 MiB hot dir failed a save with ENOSPC)."""
    from types import SimpleNamespace

    from transfer.engine import writeprobe

    def free(nbytes: int) -> None:
        usage = SimpleNamespace(total=nbytes, used=0, free=nbytes)
        monkeypatch.setattr(writeprobe.shutil, "disk_usage", lambda _path: usage)

    free(100 << 30)
    assert writeprobe.probe_size(tmp_path) == writeprobe.PROBE_BYTES
    free(500 << 20)
    assert writeprobe.probe_size(tmp_path) == 28 << 20  # 31.25 MiB, in 4 MiB blocks
    free(48 << 20)
    assert writeprobe.probe_size(tmp_path) == 0


def test_the_write_probe_writes_as_a_restore_and_leaves_nothing(tmp_path: Path) -> None:
    """The disk probe writes what it says, from several writers, in both write paths, and
    removes its scratch file; a restore's write stage gives the same kind of figure."""
    from transfer.directio import open_direct
    from transfer.engine.writeprobe import PROBE_NAME, probe_write, write_rate

    for direct in (True, False):
        nbytes, took, read = probe_write(tmp_path, direct=direct, workers=2, nbytes=9 << 20)
        assert nbytes == 9 << 20 and took > 0 and read is None
        assert list(tmp_path.iterdir()) == []  # no .ferry-write-probe left behind
    # read back past the page cache (warm's read-back: writepath.page_cache_first), where
    # the file system does direct I/O
    read = probe_write(tmp_path, direct=True, workers=2, nbytes=9 << 20, read_back=True)[2]
    (tmp_path / "o_direct").write_bytes(b"")
    fd = open_direct(tmp_path / "o_direct")
    if fd is not None:
        os.close(fd)
        assert read is not None and read > 0
    (tmp_path / "o_direct").unlink()
    assert list(tmp_path.iterdir()) == []
    # a read-back the device refuses costs only its figure, not the write probe's
    from transfer.engine import writeprobe

    def refused(fd: int, buffer: memoryview, offsets: list[int]) -> None:
        raise OSError(errno.EIO, "Input/output error")

    real, writeprobe._read_lane = writeprobe._read_lane, refused
    fds = len(os.listdir("/proc/self/fd"))
    try:
        got = probe_write(tmp_path, direct=True, workers=2, nbytes=9 << 20, read_back=True)
    finally:
        writeprobe._read_lane = real
    assert got.written == 9 << 20 and got.busy_seconds > 0 and got.read_seconds is None
    assert len(os.listdir("/proc/self/fd")) == fds and list(tmp_path.iterdir()) == []
    (tmp_path / PROBE_NAME).write_bytes(b"a killed probe's")  # replaced, then removed
    probe_write(tmp_path, direct=True, workers=1, nbytes=1 << 20)
    assert not (tmp_path / PROBE_NAME).exists()
    assert write_rate(200 * MiB, 2.0) == pytest.approx(100 * MiB)
    assert write_rate(100, 1.0) is None  # too little to say
    assert write_rate(200 * MiB, 0.0) is None  # too fast to say


def test_a_prefetch_s_fixed_part_is_timed_not_assumed() -> None:
    """The fixed part of an estimate is the constant until this agent has timed a
    prefetch, then an EWMA of what prefetches took besides their bytes."""
    meter = BandwidthMeter()
    assert meter.start_seconds("restore") == PREFETCH_START_SECONDS
    meter.record_start("restore", 0.02)
    assert meter.start_seconds("restore") == 0.02
    meter.record_start("restore", 0.12)
    assert meter.start_seconds("restore") == pytest.approx(0.3 * 0.12 + 0.7 * 0.02)
    meter.record_start("restore", float("nan"))  # not a time: ignored
    assert meter.start_seconds("restore") == pytest.approx(0.3 * 0.12 + 0.7 * 0.02)
    assert meter.start_seconds("check") == PREFETCH_START_SECONDS  # a check: its own
    # before one is timed: what resolving the step took the estimate, which the prefetch
    # repeats (a replica's check on the corpus, 0.05 s, was predicted 0.02 s: out of range)
    assert meter.start_seconds("check", resolved_in=0.05) == 0.05
    assert meter.start_seconds("check", resolved_in=0.001) == PREFETCH_START_SECONDS
    assert meter.start_seconds("restore", resolved_in=5.0) == pytest.approx(0.3 * 0.12 + 0.7 * 0.02)


def test_a_restore_the_disk_kept_up_with_never_slows_the_disk_s_rate() -> None:
    """A restore re-measures the disk only where the disk set its pace (writes in progress
    most of the time), or where it shows the disk faster than the meter thought: a slow
    restore limited by its source or a busy CPU says the disk is at least that fast."""
    from agent.node.prefetch import _disk_sample

    assert _disk_sample(300e6, busy=0.9, took=1.0, current=2e9)  # disk-bound: its rate
    assert not _disk_sample(300e6, busy=0.5, took=1.0, current=2e9)  # it kept up
    assert _disk_sample(3e9, busy=0.1, took=1.0, current=2e9)  # faster than thought
    assert not _disk_sample(None, busy=0.0, took=1.0, current=2e9)  # wrote too little
