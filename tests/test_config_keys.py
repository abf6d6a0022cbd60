"""The agent's top-level keys are declared once (AgentConfig's fields, agent/daemon/config.py):
what load_config reads, its defaults, the example config and docs/CONFIG.md follow."""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import pytest

from agent.daemon import config as agent_config
from agent.daemon.config import (
    AgentConfig,
    ConfigError,
    agent_keys,
    config_reference,
    example_toml,
    load_config,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_key_cannot_be_added_without_its_declaration() -> None:
    """A field without its declaration (help, TOML type) is refused where the keys are made,
    which agent/daemon/config.py does on import: such a key cannot exist."""

    @dataclass(frozen=True)
    class Undeclared(AgentConfig):
        new_knob: int = 3

    with pytest.raises(TypeError, match=r"Undeclared\.new_knob is not declared"):
        agent_keys(Undeclared)

    @dataclass(frozen=True)
    class Declared(AgentConfig):
        new_knob: int = field(default=3, metadata=agent_config._key("A new knob.", int))

    assert agent_keys(Declared)[-1].name == "new_knob"
    assert agent_keys(Declared)[-1].default == 3


def test_every_field_is_a_declared_key_or_a_table() -> None:
    declared = {k.name for k in agent_keys()}
    tables = {"transfer", "store", "retention", "sources"}
    assert declared | tables == {f.name for f in fields(AgentConfig)}
    assert set(agent_config._TOP_KEYS) == declared  # the schema load_config checks against
    assert set(agent_config._CHECKS) <= declared


def test_the_declared_defaults_are_what_load_config_gives() -> None:
    config = load_config(None, env={"FERRY_HOT_DIR": "/x"})
    for key in agent_keys():
        if key.default is MISSING or key.default_text:  # required or computed
            continue
        assert getattr(config, key.name) == key.default, key.name
        assert config.sources.get(key.name) is None, key.name


def test_an_empty_commit_marker_in_the_environment_is_the_no_marker_mode() -> None:
    """``FERRY_COMMIT_MARKER=""``, as a pod spec sets it on a node without .metadata, is the
    value "" (an empty variable was taken for unset: the node waited for .metadata that never
    came); another key's empty variable is still unset."""
    env = {"FERRY_HOT_DIR": "/x", "FERRY_COMMIT_MARKER": "", "FERRY_NODE": ""}
    config = load_config(None, env=env)
    assert config.commit_marker == ""
    assert config.sources.get("commit_marker") == "env FERRY_COMMIT_MARKER"
    assert config.sources.get("node") is None


def test_a_node_missing_from_its_own_expected_nodes_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A typo in one node's expected_nodes (n2 lists "n-2") left every step it completed
    without a marker and nothing said why (a newcomer's trial): said at start, with the
    name it is like; a node in the list, or with no list, says nothing."""
    env = {"FERRY_HOT_DIR": "/x", "FERRY_NODE": "n2", "FERRY_EXPECTED_NODES": "n0,n1,n-2"}
    with caplog.at_level("WARNING"):
        load_config(None, env=env)
        said = [r.getMessage() for r in caplog.records if "expected_nodes" in r.getMessage()]
        assert said == [
            "node 'n2' is not in expected_nodes ['n0', 'n1', 'n-2'] (is 'n-2' this node?): if "
            "it saves parts of the job, no step it saves is ever whole (the completion marker "
            "is never written)"
        ]
        caplog.clear()
        load_config(None, env={**env, "FERRY_EXPECTED_NODES": "n0,n1,n2"})
        load_config(None, env={"FERRY_HOT_DIR": "/x", "FERRY_NODE": "n2"})
        assert not [r for r in caplog.records if "expected_nodes" in r.getMessage()]


def test_every_unknown_key_of_the_file_is_named_at_once(tmp_path: Path) -> None:
    """Three typos took three starts, one named each time (a newcomer's trial)."""
    path = tmp_path / "ferry.toml"
    path.write_text(
        'hot_dir = "/x"\ncomit_marker = ""\nexpected_node = ["a"]\n[transfer]\nchunk_size_mb = 4\n'
    )
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={})
    assert str(raised.value) == (
        "unknown config keys: 'comit_marker' (did you mean 'commit_marker'?), "
        "'expected_node' (did you mean 'expected_nodes'?), "
        "'transfer.chunk_size_mb' (did you mean 'chunk_size_mib'?)"
    )


def test_the_declared_defaults_pass_their_own_checks() -> None:
    """Set explicitly (as their TOML value), the defaults load as the defaults."""
    for key in agent_keys():
        if key.default in (MISSING, None) or key.default_text:
            continue
        value = list(key.default) if isinstance(key.default, tuple) else key.default
        check = agent_config._CHECKS.get(key.name, agent_config._as_given)
        assert check(key.name, value) == key.default, key.name


def test_the_example_shows_every_key_as_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = example_toml()
    for key in agent_keys():
        line = f"{key.name} = {agent_config._toml_value(key.example)}\n"
        assert ("\n# " + line if key.commented else "\n" + line) in text, key.name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ferry.token").write_text("t0ken")
    (tmp_path / "ferry.toml").write_text(text)
    config = load_config(tmp_path / "ferry.toml", env={})
    for key in agent_keys():
        if key.commented:
            assert key.name not in config.sources, key.name
        else:  # as shown, and said to come from the file
            assert config.sources[key.name] == "file", key.name


def test_docs_config_md_is_made_from_the_declarations() -> None:
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    assert doc == config_reference(), (
        "docs/CONFIG.md is stale: python -c 'from agent.daemon.config import "
        'config_reference as r; print(r(), end="")\' > docs/CONFIG.md'
    )
    for key in agent_keys():
        assert f"| `{key.name}` |" in doc and f"`FERRY_{key.name.upper()}`" in doc


def _not_the_default(key: agent_config.TableKey) -> object:
    """A TOML value of ``key``'s type other than its default (so a key declared but not read
    shows: it would load as the default)."""
    if key.example != key.default:
        return key.example
    if key.toml is bool:
        return not key.default
    assert isinstance(key.default, int | float), key.name
    return key.default + 1 if key.toml is int else key.default / 2


def test_every_retention_key_is_declared_once_and_read(tmp_path: Path) -> None:
    """The [retention] keys (RetentionSettings' fields) and the [[retention.tiers]] keys
    (``_TIER_KEYS``, one per TierPolicy field) are in the example config (commented out), in
    docs/CONFIG.md, and read by load_config from the file and from FERRY_RETENTION_<KEY>;
    an undeclared key is refused."""
    from transfer.retention import TierPolicy

    keys = agent_config._RETENTION_KEYS
    assert {k.field for k in keys} == {f.name for f in fields(agent_config.RetentionSettings)}
    (tables,) = (k for k in keys if k.entries)
    assert {k.field for k in tables.entries} == {f.name for f in fields(TierPolicy)}
    text = example_toml()
    example = text[text.index("\n# [retention]\n") :]
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    doc = doc[doc.index("\n## [retention]\n") :]
    path = tmp_path / "f.toml"

    def load(toml: str, env: dict[str, str] | None = None) -> agent_config.RetentionSettings:
        path.write_text('hot_dir = "/h"\ntiers = ["/a"]\n' + toml)
        retention = load_config(path, env=env or {}).retention
        assert retention is not None
        return retention

    def shown(key: agent_config.TableKey) -> str:
        line = f"{key.name} = {agent_config._toml_value(key.example)}"
        return f"\n# # {line}" if key.commented else f"\n# {line}"

    defaults = load("[retention]\n")
    assert defaults == agent_config.RetentionSettings()  # the declared defaults
    for key in keys:
        assert f"\n| `{key.name}` |" in doc, key.name
        if key.entries:  # [[retention.tiers]]: a table per tier
            assert f"\n# [[retention.{key.name}]]" in example
            for entry in key.entries:
                assert shown(entry) in example and f"\n| `{entry.name}` |" in doc, entry.name
                value = agent_config._toml_value(_not_the_default(entry))
                policy = load(f"[[retention.{key.name}]]\n{entry.name} = {value}\n").tiers[0]
                assert getattr(policy, entry.field) is not None, entry.name
            continue
        assert shown(key) in example, key.name
        env_name = f"FERRY_RETENTION_{key.name.upper()}"
        assert f"`{env_name}`" in doc, key.name
        value = _not_the_default(key)
        from_file = load(f"[retention]\n{key.name} = {agent_config._toml_value(value)}\n")
        env_text = str(value).lower() if isinstance(value, bool) else str(value)
        from_env = load("", {env_name: env_text})
        assert getattr(from_file, key.field) == getattr(from_env, key.field), key.name
        assert getattr(from_file, key.field) != getattr(defaults, key.field), key.name
    with pytest.raises(agent_config.ConfigError, match=r"unknown config key 'retention\.bog'"):
        load("[retention]\nbog = 1\n")
    with pytest.raises(agent_config.ConfigError, match=r"key retention\.tiers\[0\]\.'bog'"):
        load("[[retention.tiers]]\nbog = 1\n")
    assert load("", {"FERRY_RETENTION_BOG": "1"}) == defaults  # other tools' variables


def test_an_unknown_key_like_a_known_one_is_named_with_it(tmp_path: Path) -> None:
    """(A newcomer's trial: ``standy_jobs`` was refused without a hint.)"""
    (tmp_path / "ferry.toml").write_text(f'hot_dir = "{tmp_path}"\nstandy_jobs = ["a"]\n')
    with pytest.raises(ConfigError, match=r"'standy_jobs' \(did you mean 'standby_jobs'\?\)$"):
        load_config(tmp_path / "ferry.toml", env={})
    (tmp_path / "ferry.toml").write_text(f'hot_dir = "{tmp_path}"\nzzz = 1\n')
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'$"):
        load_config(tmp_path / "ferry.toml", env={})
    # a mistyped table too (it was named without a hint)
    (tmp_path / "ferry.toml").write_text(f'hot_dir = "{tmp_path}"\n[retentoin]\nkeep_last = 2\n')
    with pytest.raises(ConfigError, match=r"'retentoin' \(did you mean 'retention'\?\)$"):
        load_config(tmp_path / "ferry.toml", env={})


def test_a_ferry_variable_the_agent_never_reads_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A newcomer's trial: FERRY_QUIET_SECOND=5 and FERRY_HOTDIR=/x changed nothing and
    said nothing (a typo in the file is refused with a suggestion)."""
    env = {
        "FERRY_HOT_DIR": "/x",
        "FERRY_QUIET_SECOND": "5",
        "FERRY_HOTDIR": "/y",
        "FERRY_RETENTION_HOT_KEEP_LAST": "3",  # (read: a setting, as every one the agent has)
        "FERRY_TRANSFER_WORKERS": "2",
        "FERRY_WITH_TORCH": "1",  # (this project's scripts': like no setting, so not named)
    }
    with caplog.at_level(logging.WARNING, logger="agent.daemon.config"):
        config = load_config(None, env=env)
    assert config.quiet_seconds != 5 and config.hot_dir == Path("/x")
    said = [r.getMessage() for r in caplog.records if "not a setting" in r.getMessage()]
    assert said == [
        "FERRY_HOTDIR is not a setting of the agent: ignored (did you mean FERRY_HOT_DIR?)",
        "FERRY_QUIET_SECOND is not a setting of the agent: ignored "
        "(did you mean FERRY_QUIET_SECONDS?)",
    ]
