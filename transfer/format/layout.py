"""Where each object lives in a store (keys are relative to the store URL's prefix).

    ferry-store.json                          store descriptor (format name + version)
    packs/<id[:2]>/<id>.pack                  immutable packs of encoded chunks
    manifests/<job>/<step:018d>/<node>.json   one committed checkpoint part per node
    complete/<job>/<step:018d>.json           written once (create-only) when every expected
                                              node's part of a step is committed (a repack
                                              may write it back without its common index)
    pins/<job>/<step:018d>/<holder>.json      "do not delete this step" until its expiry
    heads/<job>/<node>.json                   a hint: the node's newest committed steps
    gc/lock.json, gc/state.json               retention's lease and its mark-and-sweep state

Steps are zero-padded so that a lexical listing is in step order.
"""

from __future__ import annotations

import os
import re

from transfer.errors import FormatError
from transfer.format.names import check_name, check_step

STORE_DESCRIPTOR_KEY = "ferry-store.json"
STORE_FORMAT = "ckpt-ferry-store"
STORE_VERSION = 1

PACKS_PREFIX = "packs/"
MANIFESTS_PREFIX = "manifests/"
COMPLETE_PREFIX = "complete/"
PINS_PREFIX = "pins/"
HEADS_PREFIX = "heads/"
HEAD_FORMAT = "ckpt-ferry-node-head"
HEAD_VERSION = 1
#: steps a node head names (a push's dedupe window is 16 by default)
HEAD_STEPS = 64
GC_LOCK_KEY = "gc/lock.json"
GC_STATE_KEY = "gc/state.json"
PUSH_LOCKS_PREFIX = "locks/push/"
_PACK_KEY_RE = re.compile(r"^packs/[0-9a-f]{2}/(?P<id>[0-9a-f]{32})\.pack\Z")
_COMPLETE_KEY_RE = re.compile(r"^complete/(?P<job>[^/]+)/(?P<step>\d{18})\.json\Z")
_PIN_KEY_RE = re.compile(r"^pins/(?P<job>[^/]+)/(?P<step>\d{18})/(?P<holder>[^/]+)\.json\Z")
_PACK_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
_MANIFEST_KEY_RE = re.compile(r"^manifests/(?P<job>[^/]+)/(?P<step>\d{18})/(?P<node>[^/]+)\.json\Z")


def new_pack_id() -> str:
    """128 random bits: packs are named before their content is known (they stream). The
    kernel's random bytes, as ``secrets.token_hex`` gives them, without its import (hmac and
    OpenSSL's hashes: ~9 ms of every ``ferry`` command's start, which imports this module)."""
    return os.urandom(16).hex()


def check_pack_id(value: object) -> str:
    if not isinstance(value, str) or not _PACK_ID_RE.match(value):
        raise FormatError(f"invalid pack id {value!r}")
    return value


def pack_key(pack_id: str) -> str:
    check_pack_id(pack_id)
    return f"{PACKS_PREFIX}{pack_id[:2]}/{pack_id}.pack"


def manifest_key(job: str, step: int, node: str) -> str:
    check_name("job", job)
    check_name("node", node)
    check_step(step)
    return f"{MANIFESTS_PREFIX}{job}/{step:018d}/{node}.json"


def completion_key(job: str, step: int) -> str:
    check_name("job", job)
    return f"complete/{job}/{check_step(step):018d}.json"


def pin_key(job: str, step: int, holder: str) -> str:
    check_name("job", job)
    check_name("pin holder", holder)
    return f"{PINS_PREFIX}{job}/{check_step(step):018d}/{holder}.json"


def node_head_key(job: str, node: str) -> str:
    """Where a node's head (its newest committed steps) lives: a hint a push reads instead
    of listing the whole job; every step it names is checked by loading its manifest."""
    check_name("job", job)
    check_name("node", node)
    return f"{HEADS_PREFIX}{job}/{node}.json"


def push_lock_key(job: str, step: int, node: str) -> str:
    """The lease of a push in progress (transfer/engine/pushlease.py); readers ignore it."""
    check_name("job", job)
    check_name("node", node)
    return f"{PUSH_LOCKS_PREFIX}{job}/{check_step(step):018d}/{node}.json"


def parse_pack_key(key: str) -> str | None:
    """The pack id of a pack key whose id matches its directory; None for anything else."""
    match = _PACK_KEY_RE.match(key)
    if not match or not key.startswith(f"{PACKS_PREFIX}{match['id'][:2]}/"):
        return None
    return match["id"]


def parse_completion_key(key: str) -> tuple[str, int] | None:
    match = _COMPLETE_KEY_RE.match(key)
    return _job_step(match["job"], match["step"]) if match else None


def parse_pin_key(key: str) -> tuple[str, int, str] | None:
    match = _PIN_KEY_RE.match(key)
    parsed = _job_step(match["job"], match["step"]) if match else None
    if match is None or parsed is None:
        return None
    try:
        return (*parsed, check_name("pin holder", match["holder"]))
    except FormatError:
        return None


def _job_step(job: str, step: str) -> tuple[str, int] | None:
    try:
        return check_name("job", job), int(step)
    except FormatError:
        return None


def manifest_prefix(job: str | None = None, step: int | None = None) -> str:
    if job is None:
        return MANIFESTS_PREFIX
    check_name("job", job)
    if step is None:
        return f"{MANIFESTS_PREFIX}{job}/"
    return f"{MANIFESTS_PREFIX}{job}/{check_step(step):018d}/"


def parse_manifest_key(key: str) -> tuple[str, int, str] | None:
    """(job, step, node) for a manifest key; None for anything else (temp files, strays)."""
    match = _MANIFEST_KEY_RE.match(key)
    if not match:
        return None
    try:
        job = check_name("job", match["job"])
        node = check_name("node", match["node"])
    except FormatError:
        return None
    return job, int(match["step"]), node


def store_descriptor() -> dict[str, object]:
    return {"format": STORE_FORMAT, "version": STORE_VERSION}


def check_store_descriptor(doc: object) -> None:
    if not isinstance(doc, dict) or doc.get("format") != STORE_FORMAT:
        raise FormatError(f"{STORE_DESCRIPTOR_KEY} does not describe a ckpt-ferry store")
    version = doc.get("version")
    if type(version) is not int or version != STORE_VERSION:
        raise FormatError(
            f"store format version {version!r} is not supported by this ferry "
            f"(it reads version {STORE_VERSION}); upgrade ckpt-ferry"
        )
