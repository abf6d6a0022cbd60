"""Push and pull pipelines over a store, and the catalog of committed checkpoints."""

from transfer.engine.catalog import CheckpointInfo, list_checkpoints, resolve_manifests
from transfer.engine.pull import PullResult, pull
from transfer.engine.pullplan import PullEvents, PullPlan
from transfer.engine.push import PushResult, push
from transfer.engine.pushplan import PushPlan
from transfer.engine.resume import ResumeLog
from transfer.engine.sources import Sources
from transfer.engine.verify import VerifyResult, verify
from transfer.options import TransferOptions

__all__ = [
    "CheckpointInfo",
    "PullEvents",
    "PullPlan",
    "PullResult",
    "PushPlan",
    "PushResult",
    "ResumeLog",
    "Sources",
    "TransferOptions",
    "VerifyResult",
    "list_checkpoints",
    "pull",
    "push",
    "resolve_manifests",
    "verify",
]
