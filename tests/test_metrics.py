"""/metrics text: every metric declared once with its type and help, values exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.rpc.metrics import CATALOG, Metrics

AGENT = Path(__file__).resolve().parent.parent / "agent"


def test_values_are_exact_and_every_sample_is_described() -> None:
    m = Metrics()
    m.set("ferry_retention_last_run_timestamp", 1796030123.0)
    m.inc("ferry_push_bytes_total", 123_456_789_012, tier="s3://b/p")
    m.set("ferry_push_written_ratio", 0.4321098765, tier="s3://b/p")
    text = m.render()
    assert "ferry_retention_last_run_timestamp 1796030123\n" in text  # not 1.79603e+09
    assert 'ferry_push_bytes_total{tier="s3://b/p"} 123456789012\n' in text
    assert 'ferry_push_written_ratio{tier="s3://b/p"} 0.4321098765\n' in text
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if line[0] != "#"}
    for name in names:
        kind, _ = CATALOG[name]
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text


def test_an_undeclared_metric_is_refused() -> None:
    with pytest.raises(KeyError, match="not declared"):
        Metrics().set("ferry_made_up", 1)


def test_every_metric_the_agent_sets_is_in_the_catalog() -> None:
    used = set()
    for path in AGENT.rglob("*.py"):  # agent/rpc/routes/ too
        used |= set(re.findall(r'\.(?:set|inc)\(\s*"(ferry_[a-z_]+)"', path.read_text()))
    assert used, "the pattern found no metric at all"
    assert used <= set(CATALOG), used - set(CATALOG)
