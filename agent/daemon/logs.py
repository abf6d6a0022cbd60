"""The agent's log: one line per action, as text (default) or JSON (``log_format = "json"``).

Every action the agent takes on its own (a push, a prefetch, an eviction, a tier expiry, an
aborted orphan upload, a config value taken from the environment) is one ``event()`` call:
a name and flat fields (job, step, tier, bytes, seconds, outcome...). Text lines read as
``2026-11-30T15:51:22.101Z INFO push job=llm step=120 tier=s3://b/p outcome=durable ...``;
JSON lines carry the same keys plus ``time``, ``level`` and ``event``, one object per line,
for a log shipper. Ordinary ``log.warning(...)`` calls get the same time and level prefix.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FORMATS = ("text", "json")
_FIELDS = "ferry_fields"
_EVENT = "ferry_event"


def event(logger: logging.Logger, name: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log action ``name`` with ``fields`` (None values are left out)."""
    clean = {k: v for k, v in fields.items() if v is not None}
    logger.log(level, "%s", name, extra={_EVENT: name, _FIELDS: clean})


def _timestamp(record: logging.LogRecord) -> str:
    ms = int(record.msecs)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z"


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        head = f"{_timestamp(record)} {record.levelname}"
        fields: dict[str, Any] | None = getattr(record, _FIELDS, None)
        if fields is None:
            line = f"{head} {record.getMessage()}"
        else:
            pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
            line = f"{head} {getattr(record, _EVENT)} {pairs}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": _timestamp(record), "level": record.levelname}
        fields: dict[str, Any] | None = getattr(record, _FIELDS, None)
        if fields is None:
            doc["event"] = "message"
            doc["message"] = record.getMessage()
        else:
            doc["event"] = getattr(record, _EVENT)
            doc.update(fields)
        doc["logger"] = record.name
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(fmt: str = "text", level: int = logging.INFO) -> None:
    """Send the agent's log to stderr in ``fmt`` (call once, at ``ferry agent`` start)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("botocore", "urllib3", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
