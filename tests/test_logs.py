"""The agent's log lines: one per action, text or JSON, with time, level, event and fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from agent.daemon import logs


@pytest.fixture
def captured() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger("ferry-test-logs")
    logger.handlers.clear()
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, stream


def test_text_lines_carry_time_level_event_and_fields(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.handlers[0].setFormatter(logs.TextFormatter())
    logs.event(logger, "push", job="llm", step=120, tier="s3://b/p", outcome="durable",
               error=None, reason="two words")  # fmt: skip
    line = stream.getvalue().strip()
    stamp, level, rest = line.split(" ", 2)
    assert stamp.endswith("Z") and "T" in stamp and level == "INFO"
    assert rest == 'push job=llm step=120 tier=s3://b/p outcome=durable reason="two words"'


def test_json_lines_are_one_object_each(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.handlers[0].setFormatter(logs.JsonFormatter())
    logs.event(logger, "hot_evicted", level=logging.WARNING, job="j", step=3, bytes=10)
    logger.info("plain %s", "message")
    first, second = (json.loads(x) for x in stream.getvalue().splitlines())
    assert first["event"] == "hot_evicted" and first["level"] == "WARNING"
    assert (first["job"], first["step"], first["bytes"]) == ("j", 3, 10)
    assert second["event"] == "message" and second["message"] == "plain message"


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.setup("xml")
