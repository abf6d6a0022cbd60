"""How long and how much a checkpoint migration costs, and how often to checkpoint.

Pure arithmetic, no I/O: the agent feeds measured transfers into a BandwidthMeter and asks
for estimates; a scheduler uses them to decide whether moving a job is worth it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

MiB = 1 << 20

#: Rates (bytes/s) assumed for a source kind until a transfer from it has been measured.
#: Deliberately conservative for one node: NVMe sustains several GB/s, 10 GbE carries
#: ~1.1 GB/s, and one node's streams to an object store commonly get a few hundred MB/s.
#: ``disk``: how fast a restore writes to the hot dir's disk (probed at the agent's start,
#: re-measured by every restore: transfer/engine/writeprobe.py).
DEFAULT_RATES: Mapping[str, float] = {"local": 1.0e9, "peer": 0.5e9, "tier": 0.2e9, "disk": 1.0e9}

#: The meter's key for peers serving a node that holds an earlier step: each chunk is then
#: sent as a delta the peer encodes against the node's bytes at its position, which costs
#: the peer an encode per chunk that serving a stored chunk does not. Timed apart: in
#: ``ferry demo``'s second round the rate of the first round's plain transfer predicted
#: 0.03-0.07 s where the delta-served prefetch took 0.12-0.23 s, above the range.
PEER_DELTAS = "peer:deltas"


def peer_key(deltas: bool) -> str:
    """The meter's key for the peers' rate: with deltas (the node holds a base) or not."""
    return PEER_DELTAS if deltas else "peer"


#: Weight of a new sample: it moves the average about a third of the way, so a changed
#: link (congestion, another peer) shows within a few transfers while one outlier does not
#: halve or double the estimate.
EWMA_ALPHA = 0.3

#: The relative spread assumed for a source with fewer than two samples (a probe, or one
#: transfer): its estimate is given as -33%..+100% (seconds_low..seconds_high).
DEFAULT_SPREAD = 0.25

#: The most a first transfer's distance from its probe widens a source's spread (a spread
#: of 1 already gives a range of a third to four times the estimate).
MAX_PROBE_MISS = 1.0

#: Samples below these sizes measure request latency, not bandwidth.
MIN_SAMPLE_BYTES = 1 * MiB
MIN_SAMPLE_SECONDS = 0.010

#: Added to a migration's duration to get a scale-down cooldown: the default of the
#: Kubernetes HPA's ``behavior.scaleDown.stabilizationWindowSeconds`` (300 s), so capacity is
#: not reclaimed before the migrated job has settled.
COOLDOWN_MARGIN_SECONDS = 300.0

#: What a prefetch costs besides its bytes (the RPC, scheduling, checking what is already
#: there), until this agent has timed one (``BandwidthMeter.record_start``): a standby's
#: replica, which moves nothing, took 0.038-0.053 s to prefetch on one machine and 0.02 s
#: on another, timed with the client polling every 5 ms; 0.016 s with the long poll, which
#: answers as the prefetch ends (``python -m bench.estimate_cases``, the replica rows),
#: 0.012 s in another session (below the range 0.025 s gave). The range given is half to
#: twice the figure used: 0.01-0.04 s.
PREFETCH_START_SECONDS = 0.02

#: How far either side of its estimate a prefetch's range reaches at least, however small
#: the step: a node's scheduling and the RPC's round trips vary by tens of milliseconds that
#: no rate explains. Of 57 replica prefetches timed by ``python -m bench.estimate_cases``
#: (bench/results/estimate_cases*.md), which move nothing, the slowest took 0.06 s where
#: most took 0.02-0.03 s.
TIMING_JITTER_SECONDS = 0.05


def _kind(source: str) -> str:
    """``"tier:s3://b/x"`` -> ``"tier"``; ``"peer"`` -> ``"peer"``."""
    kind = source.split(":", 1)[0]
    if kind not in DEFAULT_RATES:
        raise ValueError(f"unknown source {source!r}: expected local, peer[:...] or tier:URL")
    return kind


class BandwidthMeter:
    """Per-source exponentially weighted average of measured throughput (bytes/s)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}
        #: EWMA of each sample's relative distance from the average before it
        self._spread: dict[str, float] = {}
        #: sources whose rate is a probe's: the first transfer replaces it
        self._provisional: set[str] = set()
        #: how far a source's probe landed from its first transfer (the ratio of the two
        #: rates less one, at most MAX_PROBE_MISS): the one sign of its spread until a second
        #: transfer measures it. Not kept for the disk: its probe and a restore's writes
        #: measure different things by design (a probe alone, a restore beside a fetch)
        self._probe_miss: dict[str, float] = {}
        #: EWMA of what a prefetch took besides its transfer and its re-check (seconds),
        #: per kind: "restore" (it moved bytes) or "check" (the step was here)
        self._start: dict[str, float] = {}

    def record_start(self, kind: str, seconds: float) -> None:
        """What a finished prefetch of ``kind`` took besides moving or re-checking bytes:
        its fixed part (resolving the step, pins, planning, staging, the answer). A
        restore's is larger than a check's (it plans, stages and renames), so they are
        kept apart."""
        if seconds >= 0 and math.isfinite(seconds):
            old = self._start.get(kind)
            new = seconds if old is None else EWMA_ALPHA * seconds + (1 - EWMA_ALPHA) * old
            self._start[kind] = new

    def start_seconds(self, kind: str, resolved_in: float = 0.0) -> float:
        """The fixed part of a prefetch of ``kind`` as timed here; before one was, what
        resolving its step took (``resolved_in``: the estimate's own resolution, which the
        prefetch repeats request for request), at least PREFETCH_START_SECONDS."""
        return self._start.get(kind, max(PREFETCH_START_SECONDS, resolved_in))

    def record(self, source: str, nbytes: int, seconds: float, provisional: bool = False) -> bool:
        """Add a measurement; returns False if it was too small to count. ``provisional``:
        a probe's (a few chunks, no disk writes): used until the first transfer's
        measurement replaces it, never averaged with it."""
        _kind(source)
        if nbytes < 0 or not seconds >= 0:
            raise ValueError(f"invalid sample: {nbytes} bytes in {seconds} s")
        # a local re-hash has no request latency to mistake for bandwidth, and a probe is
        # small on purpose (its request latency is part of what it measures): any time counts
        exact = provisional or _kind(source) == "local"
        too_quick = seconds < (1e-6 if exact else MIN_SAMPLE_SECONDS)
        if nbytes < MIN_SAMPLE_BYTES or too_quick or math.isinf(seconds):
            return False
        rate = nbytes / seconds
        old = self._rates.get(source)
        if provisional:
            if old is not None:
                return False  # measured already: a probe adds nothing
            self._rates[source] = rate
            self._provisional.add(source)
            return True
        if source in self._provisional:  # the first transfer replaces the probe's rate
            self._provisional.discard(source)
            if _kind(source) != "disk":
                probe = self._rates[source]
                miss = max(probe / rate, rate / probe) - 1
                self._probe_miss[source] = min(miss, MAX_PROBE_MISS)
            self._rates[source] = rate
            return True
        if old is not None:
            miss = abs(rate - old) / old
            spread = self._spread.get(source)
            self._spread[source] = (
                miss if spread is None else EWMA_ALPHA * miss + (1 - EWMA_ALPHA) * spread
            )
        self._rates[source] = rate if old is None else EWMA_ALPHA * rate + (1 - EWMA_ALPHA) * old
        return True

    def spread(self, source: str) -> float:
        """How far a transfer's rate typically lands from the average (relative). Before
        two transfers, DEFAULT_SPREAD, or more where the first transfer landed further
        than that from its probe: two measurements that disagree by a third say the
        next may too (bench.estimate_cases on the 289 MB fine-tune: a first transfer at
        0.99 s against its probe's 0.73 s, then a second at 0.61 s)."""
        measured = self._spread.get(source)
        if measured is not None:
            return measured
        return max(DEFAULT_SPREAD, self._probe_miss.get(source, 0.0))

    def rate(self, source: str) -> float:
        """The measured average, or the kind's DEFAULT_RATES entry before any sample."""
        measured = self._rates.get(source)
        return measured if measured is not None else DEFAULT_RATES[_kind(source)]

    def measured(self, source: str) -> bool:
        return source in self._rates

    def basis(self, source: str) -> str:
        """Where ``rate(source)`` comes from: "measured" (transfers), "probe" (a probe's
        rate, until the first transfer replaces it) or "default"."""
        if source in self._provisional:
            return "probe"
        return "measured" if source in self._rates else "default"

    def snapshot(self) -> dict[str, float]:
        """Measured sources only (bytes/s), for JSON and metrics; defaults are not data."""
        return dict(sorted(self._rates.items()))


@dataclass(frozen=True)
class MigrationEstimate:
    bytes_total: int
    bytes_missing: int
    bytes_by_source: dict[str, int]
    seconds: float
    gpus: int
    gpu_hour_price: float
    #: the likely range of ``seconds``: each source's rate +- twice its spread (at least
    #: a quarter of its rate), and at least TIMING_JITTER_SECONDS either side
    seconds_low: float = 0.0
    seconds_high: float = 0.0
    #: GPU time idle while the checkpoint moves: seconds/3600 x gpus x price
    cost: float = field(init=False)
    cooldown_seconds: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", self.seconds / 3600 * self.gpus * self.gpu_hour_price)
        object.__setattr__(self, "cooldown_seconds", self.seconds + COOLDOWN_MARGIN_SECONDS)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def estimate_migration(
    bytes_by_source: Mapping[str, int],
    meter: BandwidthMeter,
    *,
    bytes_total: int,
    gpus: int,
    gpu_hour_price: float,
    parallel: bool = False,
    fixed_seconds: float = 0.0,
    bytes_written: int = 0,
) -> MigrationEstimate:
    """Time and GPU cost to bring the missing bytes to a node (plus ``fixed_seconds``,
    taken as anywhere from half to twice that in the range, which reaches at least
    TIMING_JITTER_SECONDS either side of the estimate).

    Sequential by default: sources are drained cheapest first and share the node's NIC and
    disk, so their times add up; ``parallel`` takes the slowest source instead (an upper
    bound on overlap, for sources that use independent paths). ``bytes_written``: what
    the restore writes to this node's disk (the whole step or share, reused chunks too),
    at the ``disk`` rate. A restore streams, so once its sources' rates are a restore's
    own (``measured``: what they delivered while a restore also wrote) it takes as long
    as the slower of its sources and its disk. A rate from a probe, or a default, was
    taken alone, and a restore that receives, decodes and writes at once shares the
    node's cores between them: then the disk's time is added (the range still reaches
    down to the slower of the two). 2 cores, loopback, first contact with a tier, 289 MB
    (``python -m bench.estimate_cases``): -35..-48% of the measured prefetch predicted as
    the slower of the two, -25..0% as their sum.
    """
    if any(n < 0 for n in bytes_by_source.values()) or min(bytes_total, bytes_written) < 0:
        raise ValueError("byte counts must not be negative")
    if gpus < 0 or not gpu_hour_price >= 0:
        raise ValueError("gpus and gpu_hour_price must not be negative")
    # (missing may exceed bytes_total: a delta-coded step restored onto a node without its
    # base fetches the base's chunks too). Bytes re-read here ("local": a held step's
    # re-check) take time but are not missing: a node holding the step misses nothing.
    missing = sum(n for s, n in bytes_by_source.items() if _kind(s) != "local")
    moving = [(n, meter.rate(s), 2 * meter.spread(s)) for s, n in bytes_by_source.items() if n]
    combine = max if parallel else sum

    disk = (bytes_written, meter.rate("disk"), 2 * meter.spread("disk"))
    # (a held step's re-check moves nothing from a source: nothing to overlap with)
    overlaps = all(meter.basis(s) == "measured" for s, n in bytes_by_source.items() if n)

    def total(rate_factor: float, sign: int, overlap: bool) -> float:
        def at(n: int, rate: float, k: float) -> float:
            return n / (rate * max(0.25, 1 + sign * k * rate_factor))

        times = [at(*source) for source in moving]
        fixed = fixed_seconds * (1.0 if not rate_factor else 0.5 if sign > 0 else 2.0)
        fetch = float(combine(times)) if times else 0.0
        return fixed + (max(fetch, at(*disk)) if overlap else fetch + at(*disk))

    seconds = total(0.0, 1, overlaps)
    return MigrationEstimate(
        bytes_total=bytes_total,
        bytes_missing=missing,
        bytes_by_source=dict(bytes_by_source),
        seconds=seconds,
        gpus=gpus,
        gpu_hour_price=gpu_hour_price,
        seconds_low=max(0.0, min(total(1.0, 1, True), seconds - TIMING_JITTER_SECONDS)),
        seconds_high=max(total(1.0, -1, overlaps), seconds + TIMING_JITTER_SECONDS),
    )


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value}")


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a non-negative finite number, got {value}")


def badput_fraction(
    save_seconds: float,
    interval_seconds: float,
    mtbi_seconds: float,
    restart_seconds: float = 0.0,
) -> float:
    """Fraction of wall time lost to checkpointing and interruptions: under 1 (1.0 only
    where the rest rounds away).

    Interruptions independent (exponential, mean ``mtbi_seconds``), Daly's complete model:
    an interval of work and its save are done again from the last save whenever an
    interruption lands in them, after a restart (itself interruptible), so an interval of
    work takes ``mtbi x e^(restart/mtbi) x (e^((interval + save)/mtbi) - 1)`` of wall time
    on average; the rest of that is badput. To first order (save, restart and interval
    well under the MTBI) it is Young's ``save/interval + (restart + interval/2) / mtbi``,
    which passes 100% where they are not (a 600 s save against a 6 min MTBI: 183%).
    """
    _non_negative(save_seconds=save_seconds, restart_seconds=restart_seconds)
    _positive(interval_seconds=interval_seconds, mtbi_seconds=mtbi_seconds)
    x = (interval_seconds + save_seconds) / mtbi_seconds
    # log of the wall time an interval takes (e^x - 1 ~ e^x where e^x would overflow)
    log_wall = math.log(mtbi_seconds) + restart_seconds / mtbi_seconds
    log_wall += x if x > 700 else math.log(math.expm1(x))
    return -math.expm1(math.log(interval_seconds) - log_wall)


def optimal_interval(save_seconds: float, mtbi_seconds: float) -> float:
    """The interval of work between saves that minimises badput_fraction (the restart
    cost does not move it). Young's ``sqrt(2 x save x MTBI)`` to first order; here the
    root of the complete model's derivative, ``e^((T + save)/MTBI) (T/MTBI - 1) + 1 = 0``,
    found by bisection: it lies between 0 and the MTBI, where the derivative is below 0
    exactly where ``(T + save)/MTBI + log(1 - T/MTBI) > 0`` (the form that never
    overflows, a save 10^3 MTBIs long included)."""
    _positive(save_seconds=save_seconds, mtbi_seconds=mtbi_seconds)
    lo, hi = 0.0, mtbi_seconds
    for _ in range(2000):  # (to a relative 1e-12: at most ~1,100 halvings from 0..MTBI)
        mid = (lo + hi) / 2
        if save_seconds / mtbi_seconds + _x_plus_log1p_minus_x(mid / mtbi_seconds) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def _x_plus_log1p_minus_x(x: float) -> float:
    """``x + log(1 - x)`` for 0 <= x < 1, without the cancellation of its two terms where
    x is small (its series there: -x^2/2 - x^3/3 - ...): a save 10^-21 of the MTBI
    needs it to 1e-21."""
    if x < 1e-3:
        return -sum(x**n / n for n in range(2, 8))
    return x + math.log1p(-x)


def badput_per_interruption(save_seconds: float, interval_steps: int, step_seconds: float) -> float:
    """Seconds lost per interruption as the issue phrases it: ``save + N/2 x step`` with N the
    checkpoint interval in steps; divided by the MTBI it is the lost fraction of time.

    It omits the stall of every save between interruptions (``save/interval`` in
    badput_fraction), so it grows with N and cannot pick N on its own: use
    optimal_interval_steps for that.
    """
    _non_negative(save_seconds=save_seconds)
    _positive(interval_steps=interval_steps, step_seconds=step_seconds)
    return save_seconds + interval_steps / 2 * step_seconds


def optimal_interval_steps(save_seconds: float, step_seconds: float, mtbi_seconds: float) -> int:
    """The best interval in whole steps: whichever neighbour of optimal_interval / step
    has the lower badput_fraction (it has one minimum), at least 1."""
    _positive(step_seconds=step_seconds)
    steps = optimal_interval(save_seconds, mtbi_seconds) / step_seconds
    candidates = {max(1, math.floor(steps)), max(1, math.ceil(steps))}
    return min(
        sorted(candidates),
        key=lambda n: badput_fraction(save_seconds, n * step_seconds, mtbi_seconds),
    )
