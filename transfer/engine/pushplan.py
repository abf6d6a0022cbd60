"""How a push is made (``PushPlan``) beyond what it pushes (job, step, node): the delta base,
resuming an earlier attempt, one part of a multi-node save, and whether it may make a store.
Its own module, like pullplan.py: callers build one without importing the pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transfer.engine.resume import ResumeLog


@dataclass(frozen=True)
class PushPlan:
    """How one push is made; the default is a plain push of a whole save.

    ``base_step``: the step to delta against (default: the newest committed step of the
    same job and node before this one). ``base_dir``: a local copy of the base checkpoint
    (default: a sibling directory named for the base step); used only where its hashes
    match the base manifest. ``full``: a keyframe, no delta base at all. ``resume``: this
    push's resume log (resume.py), which an interrupted attempt filled: the chunks it made
    durable are reused where their pack still exists, and those in the landed parts of a
    pack it left unfinished too, once that upload is completed with what landed; this
    attempt records its own packs and parts there. ``part``: the directory is one node's
    part of a multi-node save, which holds some of the files its ``.metadata`` names
    (those it holds must be whole); else it must hold all. ``create_store``: a store that
    is not a ckpt-ferry store yet is made one (its descriptor written), as this Python API
    always has (tests and benchmarks rely on it); False refuses it with NotAStoreError
    before anything is written there (what the CLI, unless ``--init``, and the agent
    pass: a store is made on purpose, ``ferry init``). ``files``: push only these files
    of the directory, a part: this node's own part of a step a prefetch has since added
    other nodes' files (or a share of them) to, beside them (the agent's journal recorded
    them before anything was added); each must be there."""

    base_step: int | None = None
    base_dir: Path | None = None
    full: bool = False
    resume: ResumeLog | None = None
    part: bool = False
    create_store: bool = True
    files: frozenset[str] | None = None
