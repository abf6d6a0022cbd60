"""Configuration of the node agent (``ferry agent --config ferry.toml``).

Every key comes from the TOML file or from ``FERRY_<KEY>`` (upper-case; keys of the
``[transfer]`` table as ``FERRY_TRANSFER_<KEY>``); the environment wins, so one file can serve
a whole fleet with per-node settings injected by the scheduler. Lists in the environment are
comma-separated. An empty variable counts as unset, except for lists, where it means "empty".
Unknown keys in the file are errors (a typo must not silently fall back to a default);
unknown ``FERRY_*`` variables are ignored because other tools (tests, scripts) use the prefix.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import secrets
import socket
import stat
import textwrap
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from agent.node.hotdir import HotDir
from transfer.errors import FerryError, FormatError
from transfer.format.names import check_name
from transfer.options import (
    StoreSettings,
    TransferOptions,
    TransferSettings,
    knobs,
    named_as_settings,
)
from transfer.retention import TierPolicy, parse_duration, parse_size
from transfer.retention.repack import RepackPolicy

MiB = 1 << 20
_Q = TypeVar("_Q", int, float)
S = TypeVar("S")
ENV_PREFIX = "FERRY_"

log = logging.getLogger(__name__)


class ConfigError(FerryError):
    """The agent's configuration is missing, malformed or inconsistent."""


def _key(
    help: str,
    toml: type,
    *,
    example: object = MISSING,
    commented: bool = False,
    default_text: str = "",
) -> dict[str, object]:
    """An agent key's declaration, the metadata of its AgentConfig field (which holds its
    default; none: required or computed, said by ``default_text``): ``help`` (one line),
    its ``toml`` type (str, int, float, bool, list of strings, or object: any of several),
    and how the example config shows it (``example``: another value than the default;
    ``commented``: as a comment)."""
    return {
        "help": help,
        "toml": toml,
        "example": example,
        "commented": commented,
        "default_text": default_text,
        "name": "",
        "check": None,
        "type_text": "",
        "entries": (),
    }


def _table_key(
    help: str,
    toml: type,
    *,
    example: object = MISSING,
    commented: bool = False,
    name: str = "",
    check: Callable[[str, Any], object] | None = None,
    type_text: str = "",
    entries: tuple[TableKey, ...] = (),
) -> dict[str, object]:
    """A table's key (RetentionSettings' field: ``table_keys``) also says its ``name`` in the
    file when that is not the field's (``hot_budget``, stored as ``hot_budget_bytes``), how
    the value given is ``check``-ed and converted to the field's (called with the key's
    name for the message; none: taken as given), its type in docs/CONFIG.md when ``toml``
    is object (``type_text``), and for an array of tables (``toml`` list:
    ``[[retention.tiers]]``) the keys of each table (``entries``). The top level's checks
    are ``_CHECKS``."""
    declared = _key(help, toml, example=example, commented=commented)
    return declared | {"name": name, "check": check, "type_text": type_text, "entries": entries}


@dataclass(frozen=True)
class AgentKey:
    """One top-level key of the agent config, as AgentConfig declares it: ``name`` in the
    file, ``FERRY_<NAME>`` in the environment."""

    name: str
    toml: type
    default: object  # MISSING: required (hot_dir) or computed (node: the host name)
    help: str
    example: object
    commented: bool
    default_text: str
    #: a path (the TOML string is one)
    path: bool = False


@dataclass(frozen=True)
class TableKey:
    """One key of a table as its declaration says (``_table_key``; ``[retention]``:
    RetentionSettings' fields, ``table_keys``; ``[[retention.tiers]]``: ``_TIER_KEYS``):
    ``name`` in the file (and ``FERRY_RETENTION_<NAME>`` for [retention]'s scalars), stored
    as the settings' field ``field``."""

    name: str
    field: str
    #: its TOML type, as AgentKey's; list with ``entries``: an array of those tables
    toml: type
    help: str
    example: object
    default: object = None
    commented: bool = False
    #: (key name, value of type ``toml``) -> the field's value; none: the value as given
    check: Callable[[str, Any], object] | None = None
    type_text: str = ""
    entries: tuple[TableKey, ...] = ()


#: the keys of a ``[[retention.tiers]]`` table: TierPolicy's fields (transfer's class, so
#: declared here), each unset by default (the tier keeps everything)
_TIER_KEYS: tuple[TableKey, ...] = (
    TableKey(
        "keep_last",
        "keep_last",
        int,
        "keep the newest this many complete steps per job",
        20,
        check=lambda key, n: _int_at_least(key, n, 1),
    ),
    TableKey(
        "keep_every",
        "keep_every",
        int,
        "milestones: keep every complete step divisible by this",
        1000,
        check=lambda key, n: _int_at_least(key, n, 1),
    ),
    TableKey(
        "max_age",
        "max_age_s",
        object,
        'steps older than this ("90d", "12h") go, even milestones',
        "90d",
        check=lambda key, age: _quantity(key, age, parse_duration) if age else None,
        type_text="a duration",
    ),
    TableKey(
        "budget",
        "budget_bytes",
        object,
        "then the oldest kept steps go until the tier fits",
        "20TiB",
        commented=True,
        check=lambda key, size: _quantity(key, size, parse_size) if size else None,
        type_text="bytes or a size",
    ),
)


def _hot_size(key: str, size: object) -> int | None:
    """hot_budget, hot_min_free: a size (bytes, or a string like "800GB"); 0: none."""
    return _quantity(key, size, parse_size) if size else None


@dataclass(frozen=True)
class RetentionSettings:
    """The ``[retention]`` table. Without it the agent deletes nothing, anywhere. Each key
    is declared once, here (a field with its default and ``_key``'s metadata): what
    ``_retention`` reads and checks, the example config's commented table and the table in
    docs/CONFIG.md are made from these fields (``table_keys``)."""

    interval_seconds: float = field(
        default=600.0,
        metadata=_table_key(
            "seconds between runs (it also runs after each push)",
            float,
            example=600,
            check=lambda key, s: _seconds(key, s),
        ),
    )
    grace_seconds: float = field(
        default=3600.0,
        metadata=_table_key(
            "unreferenced packs wait this long before GC; must exceed a push",
            float,
            example=3600,
            check=lambda key, s: _seconds(key, s),
        ),
    )
    deep_verify: bool = field(
        default=False,
        metadata=_table_key("re-hash a step in the next tier before it leaves this one", bool),
    )
    #: transfer/retention/repack.py
    repack: bool = field(
        default=True,
        metadata=_table_key(
            "store deltas whose base expired whole; empty mostly-dead packs",
            bool,
        ),
    )
    repack_min_dead: float = field(
        default=0.2,
        metadata=_table_key(
            "repack packs with at least this fraction of dead bytes",
            float,
            check=lambda key, f: _fraction(key, f),
        ),
    )
    #: at least 2: the newest may still be in use by training or be the next push's base
    hot_keep_last: int = field(
        default=2,
        metadata=_table_key(
            "committed steps kept per job in hot_dir (at least 2)",
            int,
            check=lambda key, n: _int_at_least(key, n, 2),
        ),
    )
    hot_budget_bytes: int | None = field(
        default=None,
        metadata=_table_key(
            "evict older steps (already in a colder tier) beyond this size",
            object,
            name="hot_budget",
            example="800GB",
            commented=True,
            check=lambda key, size: _hot_size(key, size),
            type_text="bytes or a size",
        ),
    )
    hot_min_free_bytes: int | None = field(
        default=None,
        metadata=_table_key(
            "evict them also while the hot filesystem has less free than this",
            object,
            name="hot_min_free",
            example="100GB",
            commented=True,
            check=lambda key, size: _hot_size(key, size),
            type_text="bytes or a size",
        ),
    )
    tiers: tuple[TierPolicy, ...] = field(
        default=(),
        metadata=_table_key(
            "policy of tiers[0]; one table per tier, in order",
            list,
            check=lambda key, tables: tuple(TierPolicy(**t) for t in tables),
            type_text="[[retention.tiers]] tables",
            entries=_TIER_KEYS,
        ),
    )

    def repack_policy(self, options: TransferOptions) -> RepackPolicy | None:
        """``options``: the agent's own (what it rewrites is coded as its pushes are)."""
        return RepackPolicy(self.repack_min_dead, options) if self.repack else None

    def tier_policy(self, index: int) -> TierPolicy:
        return self.tiers[index] if index < len(self.tiers) else TierPolicy()


def table_keys(settings: type) -> tuple[TableKey, ...]:
    """The keys of the table ``settings`` declares (RetentionSettings), in order. A field
    not declared with ``_table_key`` is a TypeError (this module runs it on import)."""
    keys = []
    for f in fields(settings):
        if "help" not in f.metadata:
            raise TypeError(
                f"{settings.__name__}.{f.name} is not declared: give it its default and "
                "`metadata=_table_key(help, toml type)` (agent/daemon/config.py)"
            )
        m = f.metadata
        keys.append(
            TableKey(
                m["name"] or f.name,
                f.name,
                m["toml"],
                m["help"],
                f.default if m["example"] is MISSING else m["example"],
                default=f.default,
                commented=m["commented"],
                check=m["check"],
                type_text=m["type_text"],
                entries=m["entries"],
            )
        )
    return tuple(keys)


#: AgentConfig's fields that are not top-level keys: its tables and the keys' provenance
_NOT_TOP_KEYS = frozenset({"transfer", "store", "retention", "sources"})
#: the config file's tables
_TABLES = ("transfer", "store", "retention")


@dataclass(frozen=True)
class AgentConfig:
    """The agent's configuration. Each top-level key is declared once, here (a field with
    its default and ``_key``'s metadata):
    the keys load_config reads and their types and defaults, the example config
    (``example_toml``), the start-up log (``effective_config``) and docs/CONFIG.md
    (``config_reference``) are made from these fields (``agent_keys()``)."""

    node: str = field(
        metadata=_key(
            "This node's name in store keys; name it in containers (a file copied to several "
            "nodes with this set would push them all as one node).",
            str,
            example="node-a",
            commented=True,
            default_text="the host name",
        )
    )
    hot_dir: Path = field(
        metadata=_key(
            "Training writes checkpoints to <hot_dir>/<job>/<step dir>/ (required). "
            'e.g. "/nvme/ckpt"',
            str,
            example="ckpt/hot",
        )
    )
    listen: str = field(
        default="127.0.0.1:7070",
        metadata=_key(
            'Address of the agent\'s HTTP API (HOST:PORT); in a cluster: "0.0.0.0:7070".', str
        ),
    )
    token_file: Path | None = field(
        default=None,
        metadata=_key(
            "Bearer token for the API, read from this file (re-read when it changes); `ferry "
            "agent` creates it (random, mode 600) when missing.",
            str,
            example="ferry.token",
        ),
    )
    commit_marker: str = field(
        default=".metadata",
        metadata=_key(
            "A step directory is complete once this file exists (PyTorch DCP writes it last). In "
            "a multi-node job saving to each node's own disk, only rank 0's node gets .metadata: "
            'on the others set "" (FERRY_COMMIT_MARKER="" too: an empty variable is otherwise '
            "unset; a step is pushed once its files are quiet; the step is judged whole, against "
            ".metadata, by the node that finds the last part in, before it writes the completion "
            "marker).",
            str,
        ),
    )
    tiers: tuple[str, ...] = field(
        default=(),
        metadata=_key(
            "Stores to copy checkpoints to, hottest first: paths, file:// or s3://bucket/prefix. "
            'e.g. ["/mnt/nfs/ckpt", "s3://bucket/ckpt"]',
            list,
            example=("ckpt/store",),
        ),
    )
    peers: tuple[str, ...] = field(
        default=(),
        metadata=_key(
            'Other nodes\' agents (base URLs), for peer-to-peer restore. e.g. ["http://10.0.0.2:7070"]',
            list,
        ),
    )
    expected_nodes: tuple[str, ...] = field(
        default=(),
        metadata=_key(
            "Nodes whose parts make up a complete step (empty: a single-node job). "
            'e.g. ["node-07", "node-08"]',
            list,
        ),
    )
    endpoint_url: str | None = field(
        default=None,
        metadata=_key(
            "S3 endpoint of the s3:// tiers.",
            str,
            example="http://127.0.0.1:9000",
            commented=True,
            default_text="$AWS_ENDPOINT_URL",
        ),
    )
    #: how every tier is talked to: checksum (md5 lets an interrupted push salvage
    #: unfinished packs on SeaweedFS), tries per request, S3 timeouts
    store: StoreSettings = field(default_factory=StoreSettings)
    max_body_bytes: int = field(
        default=1 * MiB, metadata=_key("Largest accepted API request body.", int)
    )
    prefetch_concurrency: int = field(
        default=2, metadata=_key("Prefetches (scheduler-requested pulls) running at once.", int)
    )
    drain_seconds: float = field(
        default=30.0, metadata=_key("On SIGTERM, how long in-flight transfers may finish.", float)
    )
    orphan_upload_seconds: float = field(
        default=3600.0,
        metadata=_key(
            "At start, abort pack uploads begun longer ago than this (a killed push's); 0: never.",
            float,
        ),
    )
    quiet_seconds: float = field(
        default=2.0,
        metadata=_key(
            "A committed step is pushed once none of its files changed for this long (a commit "
            "marker copied in before the shards, by cp -r or rsync, does not make a torn step "
            'durable). On a node without the commit marker (commit_marker = "") it is the '
            "only sign that a save is done: a file that comes later is in no tier (an ERROR "
            "line, outcome=changed_after_push, names it); raise it for a writer that pauses.",
            float,
        ),
    )
    state_dir: Path = field(
        default=Path(),
        metadata=_key(
            'Agent state (its push journal), e.g. "/nvme/ckpt/.ferry".',
            str,
            example="ckpt/hot/.ferry",
            commented=True,
            default_text="<hot_dir>/.ferry",
        ),
    )
    transfer: TransferSettings = field(default_factory=TransferSettings)
    retention: RetentionSettings | None = None
    log_format: str = field(
        default="text", metadata=_key('Log lines: "text", or "json" for a log shipper.', str)
    )
    standby_jobs: tuple[str, ...] = field(
        default=(),
        metadata=_key(
            "Jobs whose every new durable step this node copies in the background, so a prefetch "
            "at scale-down finds it here (the scheduler can also register: PUT "
            "/v1/standby/<job>; agent/node/standby.py).",
            list,
        ),
    )
    standby_poll_seconds: float = field(
        default=5.0,
        metadata=_key("How often that background copy looks in the tiers for a new step.", float),
    )
    standby_max_rate: int = field(
        default=250_000_000,
        metadata=_key(
            'Cap on that background copy, per second ("250MB", bytes; 0: none).',
            object,
            example="250MB",
        ),
    )
    standby_memory: int | None = field(
        default=None,
        metadata=_key(
            "Most memory the newest replica of each standby job may hold locked in RAM, so "
            'the load after the decision reads memory, not the disk ("auto": what the node '
            'can spare, under a container\'s limit too; "8GB"; 0: never; '
            "agent/node/resident.py).",
            object,
            example="auto",
            default_text="auto",
        ),
    )
    peer_token_file: Path | None = field(
        default=None,
        metadata=_key(
            "The token peers present to each other (the same file on every node): it reads "
            "chunks (GET /v1/chunks/...) and nothing else; this agent sends it to its peers. "
            "Unset: peers use token_file's token. Re-read when it changes, as token_file is "
            "(docs/SECURITY.md).",
            str,
            example="/etc/ferry/peer-token/token",
            commented=True,
        ),
    )
    local_socket: Path | None = field(
        default=None,
        metadata=_key(
            "A unix socket (made mode 600, in a directory only this user writes) on which "
            "the agent serves POST /v1/pull to callers of its own user, without a token: "
            "`ferry pull` run with FERRY_LOCAL_SOCKET set to the same path hands its pull of "
            "one of the agent's tiers to the agent (warm connections and buffers, its write "
            'path; docs/SECURITY.md, "The local socket").',
            str,
            example="/run/ckpt-ferry/agent.sock",
            commented=True,
        ),
    )
    tls_cert_file: Path | None = field(
        default=None,
        metadata=_key(
            "TLS certificate (PEM; a rotated one is picked up without a restart), with "
            "tls_key_file (both or neither): the agent then serves HTTPS only, and its peers' "
            "http:// URLs become https://.",
            str,
            example="/etc/ferry/tls/tls.crt",
            commented=True,
        ),
    )
    tls_key_file: Path | None = field(
        default=None,
        metadata=_key(
            "The TLS certificate's private key (PEM).",
            str,
            example="/etc/ferry/tls/tls.key",
            commented=True,
        ),
    )
    tls_ca_file: Path | None = field(
        default=None,
        metadata=_key(
            "CA bundle outgoing calls verify agents against (unset: the system store), and that "
            "clients' certificates must chain to with tls_client_auth.",
            str,
            example="/etc/ferry/tls/ca.crt",
            commented=True,
        ),
    )
    tls_client_auth: bool = field(
        default=False,
        metadata=_key(
            "Every client but a health probe must present a certificate signed by tls_ca_file "
            "(needs tls_cert_file, which the agent presents to its peers).",
            bool,
            commented=True,
        ),
    )
    #: where each key set by the operator came from: "file" or "env FERRY_..."
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.state_dir == Path():
            object.__setattr__(self, "state_dir", self.hot_dir / ".ferry")

    @property
    def listen_host(self) -> str:
        return _parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return _parse_listen(self.listen)[1]

    @property
    def hot(self) -> HotDir:
        """The hot dir's layout: its checkpoints, and which are committed."""
        return HotDir(self.hot_dir, self.commit_marker)

    def transfer_options(self) -> TransferOptions:
        return self.transfer.to_options()

    def read_token(self) -> str | None:
        """The bearer token, re-read on every call so a rotated file takes effect."""
        return None if self.token_file is None else read_secret(self.token_file, "token_file")

    @property
    def tls_serving(self) -> bool:
        return self.tls_cert_file is not None


def read_secret(path: Path, key: str) -> str:
    """A token file's token (``key``: its config key, for the message; the token itself is
    never in one)."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {key} {path}: {exc}") from exc
    if not token:
        raise ConfigError(f"{key} {path} is empty")
    return token


def agent_keys(config_class: type = AgentConfig) -> list[AgentKey]:
    """The top-level keys ``config_class`` declares, in order. A field that is neither a
    table nor declared with ``_key`` is a TypeError: a key cannot be added without its type,
    default and help (this module runs it on import)."""
    keys = []
    for f in fields(config_class):
        if f.name in _NOT_TOP_KEYS:
            continue
        if "help" not in f.metadata:
            raise TypeError(
                f"{config_class.__name__}.{f.name} is not declared: give it its default and "
                "`metadata=_table_key(help, toml type)` (agent/daemon/config.py)"
            )
        m = f.metadata
        example = f.default if m["example"] is MISSING else m["example"]
        keys.append(
            AgentKey(
                f.name,
                m["toml"],
                f.default,
                m["help"],
                example,
                m["commented"],
                m["default_text"],
                path="Path" in str(f.type),
            )
        )
    return keys


# Key -> the TOML type it must have; env strings are converted to that type first.
_TOP_KEYS: dict[str, type] = {key.name: key.toml for key in agent_keys()}
#: top-level keys from before the [store] table, still read: key -> its type
_MOVED_TO_STORE: dict[str, type] = {"checksum": str}
#: [retention]'s keys, as RetentionSettings declares them
_RETENTION_KEYS = table_keys(RetentionSettings)
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list of strings"}


def load_config(
    path: Path | None, env: Mapping[str, str] = os.environ, *, create_token: bool = False
) -> AgentConfig:
    """Read ``path`` (None: environment and defaults only), apply ``FERRY_*`` overrides,
    validate everything and return the config; raises ConfigError with a one-line reason.
    ``create_token``: a token_file that does not exist yet is created with a random token
    (``ferry agent``: the example config then runs as printed)."""
    raw = _read_toml(path) if path is not None else {}
    _refuse_unknown_keys(raw)
    env = _Asked(env)  # (what it was asked for: a FERRY_ variable never asked is a typo)
    retention_raw = raw.pop("retention", None)
    transfer_raw = raw.pop("transfer", {})
    store_raw = raw.pop("store", {})
    sources: dict[str, str] = {}
    given = _typed(raw, {**_TOP_KEYS, **_MOVED_TO_STORE}, env, "", ENV_PREFIX, sources)
    transfer = _transfer_settings(transfer_raw, env, sources)
    moved = {k: given.pop(k) for k in _MOVED_TO_STORE if k in given}
    store = _store_settings(store_raw, moved, env, sources)
    if "hot_dir" not in given:
        raise ConfigError(
            "hot_dir is required (in the config file or FERRY_HOT_DIR; to start from an "
            "example: ferry agent --print-example-config > ferry.toml, edit it, then "
            "ferry agent --config ferry.toml)"
        )
    # the declared defaults, overlaid with what the operator set, each value checked
    top: dict[str, Any] = {k.name: k.default for k in agent_keys() if k.default is not MISSING}
    for key, value in given.items():  # (a message names what the operator set: the
        # variable, for a value from the environment)
        came = sources.get(key, "")
        said = came.removeprefix("env ").split(",")[0] if came.startswith("env ") else key
        top[key] = _CHECKS.get(key, _as_given)(said, value)
    if "node" not in given:  # computed: the host name
        top["node"] = _name("node", _host_name())
    if top["tls_cert_file"] is not None:  # this agent serves TLS: its fleet does too
        top["peers"] = tuple(_https(url) for url in top["peers"])
    _check_security(top)
    config = AgentConfig(
        **top,
        store=store,
        transfer=transfer,
        retention=_retention(retention_raw, env, len(top["tiers"])),
        sources=sources,
    )
    if not config.commit_marker and config.quiet_seconds <= 0:
        raise ConfigError(
            'commit_marker = "" needs quiet_seconds > 0: without a marker, files that stayed '
            "the same that long are the only sign a part is finished"
        )
    _warn_if_not_expected(config.node, config.expected_nodes)
    if config.token_file is not None:
        if create_token:
            _create_token_file(config.token_file)
        config.read_token()  # fail at startup, not on the first request
        _warn_if_shared(config.token_file)
    if config.peer_token_file is not None:
        peer_token = read_secret(config.peer_token_file, "peer_token_file")
        if config.token_file is not None and peer_token == config.read_token():
            raise ConfigError(
                "peer_token_file holds token_file's token: the peers' token must be another "
                "(it is good for chunk reads only)"
            )
        _warn_if_shared(config.peer_token_file, "peer_token_file")
    _warn_unread(env)
    return config


def _refuse_unknown_keys(raw: Mapping[str, object]) -> None:
    """Every unknown key of the file's top level, ``[transfer]`` and ``[store]`` in one
    error, each with the key it is like: one per start took a start per typo. (Each table's
    own check, and ``[retention]``'s, still names the first it finds.)"""
    tables = {"transfer": knobs(TransferSettings), "store": knobs(StoreSettings)}
    top = [*_TOP_KEYS, *_MOVED_TO_STORE, *_TABLES]
    unknown = [(key, key, top) for key in raw if key not in top]
    for table, declared in tables.items():
        body = raw.get(table)
        names = [k.name for k in declared]
        if isinstance(body, dict):
            unknown += [(f"{table}.{key}", key, names) for key in body if key not in names]
    if len(unknown) > 1:
        said = ", ".join(f"{name!r}{_did_you_mean(key, known)}" for name, key, known in unknown)
        raise ConfigError(f"unknown config keys: {said}")


class _Asked(Mapping[str, str]):
    """The environment, remembering the names asked for with ``get`` (the config's one way
    of reading a variable; a look over all of them, ``items``, asks for none)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env, self.asked = env, set[str]()

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return self._env.get(key, default)

    def __getitem__(self, key: str) -> str:
        return self._env[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._env)

    def __len__(self) -> int:
        return len(self._env)


def _warn_if_not_expected(node: str, expected: tuple[str, ...]) -> None:
    """A node that saves parts of the job but is not in its own ``expected_nodes`` (a typo
    in one node's list) never sees a step whole: nobody writes the marker, and the tools
    that need it say the step is not whole. Warned, not refused: a spare node that only
    restores need not be in the list."""
    if expected and node not in expected:
        like = difflib.get_close_matches(node, expected, n=1, cutoff=0.6)
        hint = f" (is {like[0]!r} this node?)" if like else ""
        log.warning("node %r is not in expected_nodes %s%s: if it saves parts of the job, no "
                    "step it saves is ever whole (the completion marker is never written)",
                    node, list(expected), hint)  # fmt: skip


def _warn_unread(env: _Asked) -> None:
    """A ``FERRY_`` variable the config never read that is like a setting of it
    (``FERRY_QUIET_SECOND``, ``FERRY_HOTDIR``: a typo) changes nothing: a typo in the file
    is refused, one here was silent. Warned, not refused, and only when like a setting:
    other tools share the prefix (this project's own scripts set ``FERRY_WITH_TORCH``).
    Compared without the prefix, which every name shares."""
    known = [n.removeprefix(ENV_PREFIX) for n in env.asked if n.startswith(ENV_PREFIX)]
    for name in sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in env.asked):
        like = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1, cutoff=0.75)
        if like:
            log.warning("%s is not a setting of the agent: ignored (did you mean %s?)", name,
                        ENV_PREFIX + like[0])  # fmt: skip


def _check_security(top: Mapping[str, object]) -> None:
    """The credential and TLS keys that go together (docs/SECURITY.md)."""
    if (top["tls_cert_file"] is None) != (top["tls_key_file"] is None):
        raise ConfigError("tls_cert_file and tls_key_file go together: set both or neither")
    if top["tls_client_auth"] and (top["tls_cert_file"] is None or top["tls_ca_file"] is None):
        raise ConfigError(
            "tls_client_auth = true needs tls_cert_file and tls_key_file (what the agent "
            "serves and presents to its peers) and tls_ca_file (what clients' certificates "
            "must chain to)"
        )


def _https(url: str) -> str:
    """A peer's base URL when this agent serves TLS: https://."""
    return "https://" + url[len("http://") :] if url.startswith("http://") else url


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def _transfer_settings(
    raw: object, env: Mapping[str, str], sources: dict[str, str]
) -> TransferSettings:
    """The [transfer] table overlaid with FERRY_TRANSFER_*, checked as the options it
    makes."""
    transfer = _settings_table(TransferSettings, "transfer", raw, env, sources)
    try:
        transfer.to_options()
    except ValueError as exc:  # (named as the table's keys are: the options say part_size)
        raise ConfigError(f"[transfer] {named_as_settings(str(exc))}") from exc
    return transfer


def _store_settings(
    raw: object, moved: dict[str, object], env: Mapping[str, str], sources: dict[str, str]
) -> StoreSettings:
    """The [store] table overlaid with FERRY_STORE_*. ``moved``: its keys set at the top
    level (``checksum``, FERRY_CHECKSUM), as configs did before the table: still read."""
    if not isinstance(raw, dict):
        raise ConfigError("store: expected a table ([store])")
    for key, value in moved.items():
        if key in raw or env.get(f"{ENV_PREFIX}STORE_{key.upper()}"):
            raise ConfigError(f"{key}: set both at the top level and in [store]; keep one")
        raw = {**raw, key: value}
    store = _settings_table(StoreSettings, "store", raw, env, sources)
    for key in moved:  # where the operator set it
        sources[f"store.{key}"] = sources.pop(key)
    return store


def _settings_table(
    settings: type[S], table: str, raw: object, env: Mapping[str, str], sources: dict[str, str]
) -> S:
    """A settings class's table (``[transfer]``, ``[store]``) overlaid with its
    ``FERRY_<TABLE>_*`` variables: each key of the type the class declares, a choice among
    its choices, a number not negative."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{table}: expected a table ([{table}])")
    declared = knobs(settings)
    schema = {k.name: k.kind for k in declared}
    values = _typed(raw, schema, env, f"{table}.", f"{ENV_PREFIX}{table.upper()}_", sources)
    for k in declared:
        key, value = f"{table}.{k.name}", values.get(k.name)
        if value is None or isinstance(value, bool):
            continue
        values[k.name] = _one_of(key, value, k.choices) if k.choices else _at_least(key, value, 0)
    try:
        return settings(**values)
    except ValueError as exc:
        raise ConfigError(f"{table}: {exc}") from exc


def effective_config(config: AgentConfig) -> list[tuple[str, object, str]]:
    """(key, value, source) of every top-level, [transfer] and [store] key, for the start-up
    log."""
    rows: list[tuple[str, object, str]] = []
    for agent_key in agent_keys():
        key = agent_key.name
        value = getattr(config, key)  # (token_file: the path, never the token)
        source = config.sources.get(key, "default")
        if key == "endpoint_url":
            if value is None:  # the S3 tiers' endpoint then
                from transfer.endpoint import endpoint_from_env

                value, variable = endpoint_from_env()
                source = f"env {variable}" if variable else source
            value = _without_password(value)
        elif value is None and agent_key.default_text:  # (standby_memory's None: "auto")
            value = agent_key.default_text
        rows.append((key, _plain(value), source))
    for table, settings in (("transfer", config.transfer), ("store", config.store)):
        for knob in knobs(type(settings)):
            key = f"{table}.{knob.name}"
            rows.append((key, getattr(settings, knob.name), config.sources.get(key, "default")))
    return rows


def _without_password(url: str | None) -> str | None:
    """``url`` with any ``user:password@`` in it shown as ``***@`` (it goes to the log)."""
    from urllib.parse import urlsplit, urlunsplit

    if url is None:
        return None
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _one_of(key: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _typed(
    raw: Mapping[str, object],
    schema: Mapping[str, type],
    env: Mapping[str, str],
    key_prefix: str,
    env_prefix: str,
    sources: dict[str, str] | None = None,
) -> dict[str, object]:
    """Type-check the file's values, then overlay the environment's; ``sources`` gets where
    each key set by the operator came from ("file", or "env FERRY_..."; the env wins)."""
    out: dict[str, object] = {}
    where: dict[str, str] = {}
    # (at the top level a key may be a mistyped table: "[retentoin]" is named with it)
    known = [*schema, *(_TABLES if not key_prefix else ())]
    for key, value in raw.items():
        if key not in schema:
            raise ConfigError(f"unknown config key {key_prefix + key!r}{_did_you_mean(key, known)}")
        out[key] = _check(f"{key_prefix}{key}", value, schema[key])
        where[key_prefix + key] = "file"
    for key, kind in schema.items():
        name = env_prefix + key.upper()
        text = env.get(name)
        if text is None or (text == "" and kind is not list and key not in _EMPTY_IS_A_VALUE):
            continue
        out[key] = _from_env(name, text, kind)
        where[key_prefix + key] = f"env {name}" + (", over the file's" if key in raw else "")
    if sources is not None:
        sources.update(where)
    return out


#: keys whose empty value means something, also in the environment (an empty variable
#: is otherwise unset): ``FERRY_COMMIT_MARKER=""`` on a node without .metadata was ignored,
#: so a fleet configured by environment (a Kubernetes pod spec) waited for a marker that
#: never came on every node but rank 0's
_EMPTY_IS_A_VALUE = frozenset({"commit_marker"})


def _retention(raw: object, env: Mapping[str, str], n_tiers: int) -> RetentionSettings | None:
    """The ``[retention]`` table (plus ``FERRY_RETENTION_*``); None when neither is set."""
    prefix = ENV_PREFIX + "RETENTION_"
    if raw is None and not any(k.startswith(prefix) and v for k, v in env.items()):
        return None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("retention: expected a table ([retention])")
    scalars = [k for k in _RETENTION_KEYS if not k.entries]
    (tables,) = (k for k in _RETENTION_KEYS if k.entries)  # [[retention.tiers]]
    where = f"retention.{tables.name}"
    tables_raw = raw.pop(tables.name, [])
    values = _typed(raw, {k.name: k.toml for k in scalars}, env, "retention.", prefix)
    if not isinstance(tables_raw, list) or not all(isinstance(t, dict) for t in tables_raw):
        raise ConfigError(f"{where}: expected [[{where}]] tables")
    if len(tables_raw) > n_tiers:
        raise ConfigError(
            f"{where}: {len(tables_raw)} policies for {n_tiers} tiers (one per tier, in order)"
        )
    entries = [_table_values(tables.entries, f"{where}[{i}]", t) for i, t in enumerate(tables_raw)]
    settings: dict[str, Any] = {
        k.field: _checked(k, f"retention.{k.name}", values[k.name])
        for k in scalars
        if k.name in values
    }
    settings[tables.field] = _checked(tables, where, entries)
    return RetentionSettings(**settings)


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    """ " (did you mean 'standby_jobs'?)" for a key like a known one (``standy_jobs``)."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _table_values(
    keys: tuple[TableKey, ...], where: str, raw: Mapping[str, object]
) -> dict[str, object]:
    """A table of ``keys`` (a ``[[retention.tiers]]`` entry; ``where``: its name in
    messages), checked: field -> value."""
    declared = {k.name: k for k in keys}
    unknown = set(raw) - set(declared)
    if unknown:
        first = sorted(unknown)[0]
        raise ConfigError(f"unknown config key {where}.{first!r}{_did_you_mean(first, declared)}")
    return {k.field: _checked(k, f"{where}.{k.name}", raw[k.name]) for k in keys if k.name in raw}


def _checked(key: TableKey, name: str, value: object) -> object:
    """A table key's value, of its declared TOML type, checked and converted by its
    declaration (``name``: the key, in messages)."""
    if not key.entries:  # an array of tables: checked table by table
        value = _check(name, value, key.toml)
    return value if key.check is None else key.check(name, value)


def _quantity(key: str, value: object, parse: Callable[[object], _Q]) -> _Q:
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _check(key: str, value: object, kind: type) -> object:
    if kind is object:
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # `drain_seconds = 30` in TOML is an int, and fine
    if kind is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{key}: expected {_TYPE_NAMES[kind]}, got {value!r}")
    return value


def _is_int(value: object) -> bool:
    # bool is an int subclass; `workers = true` is a mistake, not 1
    return isinstance(value, int) and not isinstance(value, bool)


def _from_env(name: str, text: str, kind: type) -> object:
    if kind is bool:
        if text.lower() not in ("1", "0", "true", "false"):
            raise ConfigError(f"{name}: expected true or false, got {text!r}")
        return text.lower() in ("1", "true")
    if kind is object:
        return text
    if kind is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind is str:
        return text
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        raise ConfigError(f"{name}: expected {_TYPE_NAMES[kind]}, got {text!r}") from None


def _host_name() -> str:
    return socket.gethostname().split(".")[0] or "node"


def _rate(value: object) -> int:
    """standby_max_rate: bytes per second, or 0 for no cap."""
    if value in (0, "0"):
        return 0
    return _quantity("standby_max_rate", value, parse_size)


def _standby_memory(key: str, value: object) -> int | None:
    """standby_memory: "auto" (None: what the node can spare), a size of 1 MiB or more, or
    0 for never (a fraction of a byte is not "never": it is refused)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if value in (0, "0"):
        return 0
    nbytes = _quantity(key, value, parse_size)
    if nbytes < 1 << 20:
        raise ConfigError(
            f'{key}: {value!r} is under 1 MiB: give a size like "8GB", "auto", or 0 for never'
        )
    return nbytes


def _name(kind: str, value: object) -> str:
    try:
        return check_name(kind, value)
    except FormatError as exc:
        raise ConfigError(str(exc)) from exc


def _path(key: str, value: object) -> Path:
    if not value:
        raise ConfigError(f"{key}: expected a path, got an empty string")
    return Path(str(value)).expanduser()


def _int_at_least(key: str, value: object, minimum: int) -> int:
    assert isinstance(value, int)  # checked by _check
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum}, got {value}")
    return value


def _at_least(key: str, value: object, minimum: int) -> int | float:
    assert isinstance(value, int | float)  # checked by _check
    if not minimum <= value < float("inf"):
        raise ConfigError(f"{key}: must be at least {minimum}, got {value}")
    return value


def _seconds(key: str, value: object) -> float:
    assert isinstance(value, float)  # checked by _check
    if not 0.0 <= value < float("inf"):
        raise ConfigError(f"{key}: must be a non-negative number of seconds, got {value}")
    return value


def _fraction(key: str, value: object) -> float:
    assert isinstance(value, float)  # checked by _check
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{key}: must be a fraction in (0, 1], got {value}")
    return value


def _parse_listen(listen: str, key: str = "listen") -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:7070
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{key}: expected HOST:PORT with a port in 0..65535, got {listen!r}")
    return host, int(port)


def _commit_marker(value: object, key: str = "commit_marker") -> str:
    """A file name, or "" (no marker: a step directory is committed once its files are
    quiet; for the nodes of a node-local multi-node save that never hold .metadata)."""
    marker = str(value)
    if "/" in marker or marker in (".", ".."):
        raise ConfigError(f'{key}: expected a file name or "", got {marker!r}')
    return marker


def _tier_url(url: str, key: str = "tiers") -> str:
    # A light syntax check only: opening the store would touch the network.
    parts = urlsplit(url)
    bad_s3 = parts.scheme == "s3" and not parts.netloc
    if not url or parts.scheme not in ("", "file", "s3") or bad_s3:
        raise ConfigError(f"{key}: unsupported store URL {url!r} (a path, file://, s3://bucket)")
    return url


def _http_url(key: str, url: object) -> str:
    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{key}: expected an http:// or https:// URL, got {url!r}")
    return str(url)


def _expected_nodes(names: list[str], key: str = "expected_nodes") -> tuple[str, ...]:
    nodes = tuple(_name("expected node", n) for n in names)
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{key}: duplicate names in {list(nodes)}")
    return nodes


def _create_token_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot create token_file {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    log.warning("created token_file %s with a new random token (give it to the scheduler)", path)


def _warn_if_shared(token_file: Path, key: str = "token_file") -> None:
    # Warn rather than refuse: secrets mounted by Kubernetes are often 0644 by default.
    try:
        mode = token_file.stat().st_mode
    except OSError:
        return
    if mode & stat.S_IRWXO:  # group access is the norm for a mounted Secret with fsGroup
        log.warning("%s %s is readable by others (chmod o-rwx it)", key, token_file)


def _as_given(key: str, value: object) -> object:
    """A value of its declared TOML type (a list kept as a tuple: the config is frozen)."""
    return tuple(value) if isinstance(value, list) else value


def _listen(key: str, value: str) -> str:
    _parse_listen(value, key)
    return value


#: how a top-level value the operator set is checked and converted (a key not here is
#: taken as given, once of its declared TOML type); the declared defaults need none
_CHECKS: dict[str, Callable[[str, Any], object]] = {
    "node": lambda key, name: _name(key, name or _host_name()),
    "hot_dir": _path,
    "listen": _listen,
    "token_file": _path,
    "commit_marker": lambda key, marker: _commit_marker(marker, key),
    "tiers": lambda key, urls: tuple(_tier_url(u, key) for u in urls),
    "peers": lambda key, urls: tuple(_http_url(key, u).rstrip("/") for u in urls),
    "expected_nodes": lambda key, names: _expected_nodes(names, key),
    "endpoint_url": _http_url,
    "max_body_bytes": lambda key, n: _int_at_least(key, n, 1),
    "prefetch_concurrency": lambda key, n: _int_at_least(key, n, 1),
    "drain_seconds": _seconds,
    "orphan_upload_seconds": _seconds,
    "quiet_seconds": _seconds,
    "state_dir": _path,
    "log_format": lambda key, fmt: _one_of(key, fmt, ("text", "json")),
    "standby_jobs": lambda key, jobs: tuple(_name(key, j) for j in jobs),
    "standby_poll_seconds": _seconds,
    "standby_max_rate": lambda key, rate: _rate(rate),
    "standby_memory": _standby_memory,
    "peer_token_file": _path,
    "local_socket": lambda key, value: _path(key, value).absolute(),  # (callers are elsewhere)
    "tls_cert_file": _path,
    "tls_key_file": _path,
    "tls_ca_file": _path,
}


def _example_table(settings: type) -> str:
    """A settings class's table: its keys with their defaults and what each does."""
    lines = []
    for knob in knobs(settings):
        default = knob.default
        value = str(default).lower() if isinstance(default, bool) else repr(default)
        line = f"{knob.name} = {value}".replace("'", '"')
        help_text = knob.help
        if knob.default_text:  # e.g. this machine's cores: not a value to copy
            line, help_text = f"# {line}", f"{help_text} (default: {knob.default_text})"
        lines.append((line, help_text))
    width = max(25, *(len(line) + 1 for line, _ in lines))
    return "\n".join(f"{line:<{width}} # {help_text}" for line, help_text in lines)


def example_toml() -> str:
    """A commented example that runs as printed (``ferry init ckpt/store`` first) on
    one node, deleting nothing (its ``[retention]`` table is commented out); the production
    values are in the comments (a test keeps it honest)."""
    return _EXAMPLE_TOML.format(
        top=_example_top(),
        transfer=_example_table(TransferSettings),
        store=_example_table(StoreSettings),
        retention=_example_retention(),
    )


def _example_retention() -> str:
    """The ``[retention]`` table as RetentionSettings declares it, commented out (the
    example deletes nothing): its keys, then a ``[[retention.tiers]]`` table of
    ``_TIER_KEYS``."""

    def row(key: TableKey) -> tuple[str, str]:
        line = f"{key.name} = {_toml_value(key.example)}"
        return (f"# {line}" if key.commented else line), key.help

    rows = [("[retention]", ""), *(row(k) for k in _RETENTION_KEYS if not k.entries)]
    for key in _RETENTION_KEYS:
        if key.entries:
            rows += [("", ""), (f"[[retention.{key.name}]]", key.help)]
            rows += [row(k) for k in key.entries]
    width = max(25, *(len(line) + 1 for line, _ in rows))
    return "\n".join(
        f"# {line:<{width}} # {about}" if about else f"# {line}".rstrip() for line, about in rows
    )


def _example_top() -> str:
    """The top-level keys as AgentConfig declares them: each one's help as a comment, then
    its line (commented out where the example leaves it unset)."""
    lines = []
    for key in agent_keys():
        about = key.help + (f" Default: {key.default_text}." if key.default_text else "")
        lines += textwrap.wrap(about, 92, initial_indent="# ", subsequent_indent="# ")
        line = f"{key.name} = {_toml_value(key.example)}"
        lines.append(f"# {line}" if key.commented else line)
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    """``value`` as TOML (the types of the agent's keys: strings, paths, numbers, switches,
    lists of strings)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def config_reference() -> str:
    """docs/CONFIG.md: every key of the agent's config, made from the declarations (a test
    keeps the file equal to this)."""
    out = [
        "# The agent's configuration keys",
        "",
        "Generated from their declarations (`AgentConfig`, `TransferSettings`, `StoreSettings` "
        "and `RetentionSettings`) by `agent.daemon.config.config_reference()`; "
        "`tests/test_config_keys.py` fails when this file differs (regenerate it: "
        "`python -c 'from agent.daemon.config import "
        'config_reference as r; print(r(), end="")\' > docs/CONFIG.md`). `ferry agent '
        "--print-example-config` prints a "
        "commented example config. Each key comes from the TOML file or the environment "
        "variable beside it (the environment wins; lists comma-separated); unknown keys in "
        "the file are errors.",
        "",
        "## Top level",
        "",
        "| key | type | default | environment | what it does |",
        "|---|---|---|---|---|",
    ]
    for key in agent_keys():
        if key.default_text or key.default in (MISSING, None):
            default = key.default_text or ("required" if key.default is MISSING else "unset")
        else:
            default = f"`{_toml_value(key.default)}`"
        kind = "a path" if key.path else _TYPE_NAMES.get(key.toml, "true or false")
        kind = "bytes or a size" if key.toml is object else kind
        out.append(
            f"| `{key.name}` | {kind} | {_cell(default)} | `{ENV_PREFIX}{key.name.upper()}` | "
            f"{_cell(key.help)} |"
        )
    for table, settings in (("transfer", TransferSettings), ("store", StoreSettings)):
        out += [
            "",
            f"## [{table}]",
            "",
            f"The same names, with dashes, are the `ferry` commands' flags ({settings.__name__} "
            "in transfer/options.py).",
            "",
            "| key | type | default | environment | what it does |",
            "|---|---|---|---|---|",
        ]
        for knob in knobs(settings):
            default = knob.default_text or f"`{_toml_value(knob.default)}`"
            kind = (
                f"one of {', '.join(knob.choices)}"
                if knob.choices
                else (_TYPE_NAMES.get(knob.kind, "true or false"))
            )
            env_name = f"{ENV_PREFIX}{table.upper()}_{knob.name.upper()}"
            out.append(
                f"| `{knob.name}` | {kind} | {default} | `{env_name}` | {_cell(knob.help)} |"
            )
    out += [
        "",
        "## [retention]",
        "",
        "Without the table the agent deletes nothing, anywhere: docs/RETENTION.md, and the "
        "commented table in the example config (RetentionSettings in agent/daemon/config.py).",
        "",
        "| key | type | default | environment | what it does |",
        "|---|---|---|---|---|",
    ]
    for rkey in _RETENTION_KEYS:
        env_name = "none" if rkey.entries else f"`{ENV_PREFIX}RETENTION_{rkey.name.upper()}`"
        out.append(
            f"| `{rkey.name}` | {_table_type(rkey)} | {_table_default(rkey)} | {env_name} | "
            f"{_cell(rkey.help)} |"
        )
    for rkey in _RETENTION_KEYS:
        if not rkey.entries:
            continue
        out += [
            "",
            f"## [[retention.{rkey.name}]]",
            "",
            f"One table per entry of the top-level `{rkey.name}`, in order; a tier without one "
            "keeps everything.",
            "",
            "| key | type | default | what it does |",
            "|---|---|---|---|",
        ]
        for entry in rkey.entries:
            out.append(
                f"| `{entry.name}` | {_table_type(entry)} | {_table_default(entry)} | "
                f"{_cell(entry.help)} |"
            )
    out.append("")
    return "\n".join(out)


def _table_type(key: TableKey) -> str:
    return key.type_text or _TYPE_NAMES.get(key.toml, "true or false")


def _table_default(key: TableKey) -> str:
    return "unset" if key.default is None else f"`{_toml_value(key.default)}`"


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell (``<job>`` is no HTML tag)."""
    return text.replace("|", "\\|").replace("<", "\\<")


# example_toml()'s text; {top}: the top-level keys, made from AgentConfig; {transfer} and
# {store}: those tables, made from TransferSettings and StoreSettings; {retention}: that
# table, commented out, made from RetentionSettings
_EXAMPLE_TOML = """\
# ckpt-ferry node agent: `ferry agent --config ferry.toml`, from this file's directory
# (relative paths are relative to where the agent starts). As printed it is a one-node
# setup on this machine: checkpoints under ckpt/hot are pushed to the store ckpt/store
# (made a store first, once: `ferry init ckpt/store`; the agent makes none).
# Every key can be overridden by FERRY_<KEY> (e.g. FERRY_HOT_DIR, FERRY_TIERS="a,b";
# [transfer] keys as FERRY_TRANSFER_<KEY>, [store] keys as FERRY_STORE_<KEY>); the agent
# logs where each value came from.

{top}

[transfer]
{transfer}

# How every tier is talked to (a local or NFS directory: attempts only).
[store]
{store}

# Retention, commented out: as printed the agent never deletes anything, anywhere. Uncomment
# the table (remove one "# " from each line below) to let it delete: every interval_seconds
# and after each push it evicts older steps from hot_dir (keeping the newest hot_keep_last
# per job, and only what a colder tier holds) and trims each tier to its policy
# (docs/RETENTION.md).
{retention}
"""
