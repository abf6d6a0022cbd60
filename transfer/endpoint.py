"""Which S3 endpoint the environment names, where none is configured: its own module, with
nothing else imported, because `ferry pull` through the node's agent (agent/cli/viaagent.py)
asks it before it imports any store."""

from __future__ import annotations

import os


def endpoint_from_env() -> tuple[str | None, str | None]:
    """(S3 endpoint, the variable it came from) where none is configured: botocore's
    order, the service-specific variable first; (None, None) without either."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if value := os.environ.get(name):
            return value, name
    return None, None
