"""Prometheus text exposition, hand-rolled: a handful of counters and gauges do not justify
a dependency. Every metric the agent exports is declared once, in CATALOG (its type and
help text); setting one that is not there is a bug and raises. One rule for the ``tier``
label: a tier's store URL as configured (an entry of ``tiers``), ``hot`` for the hot dir."""

from __future__ import annotations

from collections import defaultdict

COUNTER, GAUGE = "counter", "gauge"

#: name -> (type, help). Counters only ever grow (across one agent process).
CATALOG: dict[str, tuple[str, str]] = {
    # prefetch and peers (agent/rpc/routes/status.py, prefetch.py, peers.py)
    "ferry_prefetch_started_total": (COUNTER, "prefetches requested"),
    "ferry_prefetch_queue_depth": (GAUGE, "prefetches queued or running"),
    "ferry_prefetch_total": (GAUGE, "prefetches the agent remembers, by current state"),
    "ferry_prefetch_seconds_total": (COUNTER, "time spent in finished prefetches"),
    "ferry_prefetch_bytes_total": (COUNTER, "bytes prefetched, by source"),
    "ferry_bandwidth_bytes_per_second": (GAUGE, "measured bandwidth per source"),
    "ferry_bytes_total": (COUNTER, "bytes served to peers"),
    # background pushes (agent/node/pushqueue.py)
    "ferry_push_total": (COUNTER, "background pushes by tier and result"),
    "ferry_push_bytes_total": (COUNTER, "bytes written by pushes"),
    "ferry_push_last_seconds": (GAUGE, "duration of the last push"),
    "ferry_push_written_ratio": (GAUGE, "bytes written / raw bytes, last push"),
    "ferry_push_queue_depth": (GAUGE, "steps queued, being pushed or waiting"),
    "ferry_push_completions_written_total": (COUNTER, "completion markers this node wrote"),
    "ferry_push_steps_torn_total": (
        COUNTER,
        "steps whose parts were all in but lacked a file their .metadata names",
    ),
    # retention (agent/node/retention_loop.py)
    "ferry_tier_bytes": (GAUGE, "bytes held per tier (hot: the hot dir)"),
    "ferry_retention_runs_total": (COUNTER, "retention runs by result"),
    "ferry_retention_last_run_timestamp": (GAUGE, "unix time the last run finished"),
    "ferry_retention_last_seconds": (GAUGE, "how long the last run took"),
    "ferry_retention_expired_total": (COUNTER, "steps expired or demoted out of a tier"),
    "ferry_hot_evicted_total": (COUNTER, "step directories evicted from the hot dir"),
    "ferry_gc_deleted_packs_total": (COUNTER, "packs deleted by GC"),
    "ferry_gc_freed_bytes_total": (COUNTER, "bytes freed by GC"),
    "ferry_gc_marked_packs": (GAUGE, "unreferenced packs waiting out the grace period"),
    "ferry_repack_moved_bytes_total": (COUNTER, "live bytes copied out of mostly-dead packs"),
    "ferry_repack_reencoded_chunks_total": (
        COUNTER,
        "delta chunks stored again whole because their base expired",
    ),
    "ferry_retention_errors": (GAUGE, "errors in the last run (see GET /v1/retention)"),
    "ferry_journal_rows": (GAUGE, "rows in the push journal"),
}

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self.values: dict[tuple[str, Labels], float] = defaultdict(float)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.values[_key(name, labels)] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[_key(name, labels)] = value

    def render(self) -> str:
        lines: list[str] = []
        described: set[str] = set()
        for (name, labels), value in sorted(self.values.items()):
            if name not in described:
                kind, text = CATALOG[name]
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                described.add(name)
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            sample = f"{name}{{{label_text}}}" if labels else name
            lines.append(f"{sample} {_number(value)}")
        return "\n".join(lines) + "\n"


def _key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
    if name not in CATALOG:
        raise KeyError(f"metric {name!r} is not declared in agent/rpc/metrics.py CATALOG")
    return name, tuple(sorted(labels.items()))


def _number(value: float) -> str:
    """Exact: integers in full (byte counters, unix times), other floats round-trip."""
    v = float(value)
    if v.is_integer() and abs(v) < 2**63:
        return str(int(v))
    return repr(v)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
