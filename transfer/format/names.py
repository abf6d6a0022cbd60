"""Validation of the names that become parts of store keys and local paths.

Job and node names end up in object keys and directory names, so they are restricted to a
conservative alphabet: no separators, no dot-only names, nothing a shell or S3 treats specially.
"""

from __future__ import annotations

import re

from transfer.errors import FormatError

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_STEP_IN_DIRNAME = re.compile(r"(\d+)(?!.*\d)")
# the digits end the name, alone or after a separator or a word that names a step
_STEP_ENDING_DIRNAME = re.compile(
    r"(?:^|[-_.=]|step|iter|checkpoint|ckpt|epoch)(\d+)\Z", re.IGNORECASE
)
MAX_STEP = 10**18 - 1  # fits the 18-digit zero-padded key component

#: a step of a job, (job, step): what retention keeps, pins and holds, agent and store alike
Key = tuple[str, int]


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a safe job/node name, else raise FormatError."""
    if not isinstance(value, str) or not _SAFE_NAME.match(value):
        raise FormatError(
            f"invalid {kind} name {value!r}: use 1-128 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def check_step(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise FormatError(f"invalid step {value!r}: an integer in 0..{MAX_STEP}")
    return value


def step_from_dirname(dirname: str, *, strict: bool = False) -> int | None:
    """The last run of digits in a directory name (``step_000120`` -> 120), if any.
    ``strict`` (a push told no step): only digits that end the name, alone or after a
    separator or a step word (``checkpoint-500``, ``global_step500``, ``iter_0000500``),
    so that ``llama-7b`` or ``run2024v3`` is not taken for step 7 or 3."""
    match = (_STEP_ENDING_DIRNAME if strict else _STEP_IN_DIRNAME).search(dirname)
    return int(match.group(1)) if match else None
