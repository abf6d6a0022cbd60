"""PNG plots of a bench.compare result (matplotlib, no display needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

TOOLS = ("ferry", "s5cmd", "rclone", "zstd")
COLORS = {"ferry": "#1f77b4", "s5cmd": "#ff7f0e", "rclone": "#2ca02c", "zstd": "#9467bd"}


def _bars(rows: list[dict[str, Any]], key: str, ylabel: str, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    tools = [t for t in TOOLS if any(r["tool"] == t for r in rows)]
    width = 0.8 / max(1, len(tools))
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(scenarios)), 4.2))
    for i, tool in enumerate(tools):
        xs, ys = [], []
        for j, sc in enumerate(scenarios):
            hit = [r for r in rows if r["scenario"] == sc and r["tool"] == tool]
            if hit and hit[0].get(key) is not None:
                xs.append(j + (i - (len(tools) - 1) / 2) * width)
                ys.append(hit[0][key])
        ax.bar(xs, ys, width, label=tool, color=COLORS.get(tool))
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels([textwrap.fill(s, 16) for s in scenarios], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def scenario_plots(
    rows: list[dict[str, Any]], out_dir: Path, label: str, baseline: dict[str, str]
) -> list[Path]:
    """``baseline``: scenario -> the scenario whose peer rows it is judged against (drawn
    beside ferry's bar, e.g. the peers' full download next to ferry's prefetch)."""
    time_png, bytes_png = out_dir / "compare_time.png", out_dir / "compare_bytes.png"
    shown = list(rows)
    for scenario, base in baseline.items():
        if scenario != base:
            peers = [r for r in rows if r["scenario"] == base and r["tool"] != "ferry"]
            shown += [{**r, "scenario": scenario} for r in peers]
    order = list(dict.fromkeys(r["scenario"] for r in rows))
    rows = sorted(shown, key=lambda r: order.index(r["scenario"]))
    _bars(rows, "median_s", "seconds (median)", f"Wall time per scenario ({label})", time_png)
    mb = [{**r, "mb": r["bytes_moved"] / 1e6} for r in rows]
    _bars(mb, "mb", "MB over the network", f"Bytes moved per scenario ({label})", bytes_png)
    return [time_png, bytes_png]


def scaling_plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(r["tool"], r["op"]) for r in rows})
    for tool, op in series:
        pts = sorted((r["size_mb"], r) for r in rows if (r["tool"], r["op"]) == (tool, op))
        xs = [p[0] for p in pts]
        style = "-" if op == "push" else "--"
        kw = {"color": COLORS.get(tool), "linestyle": style, "marker": "o"}
        ax_t.plot(xs, [p[1]["median_s"] for p in pts], label=f"{tool} {op}", **kw)
        ax_m.plot(xs, [p[1]["peak_rss_mb"] for p in pts], label=f"{tool} {op}", **kw)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("checkpoint size, MB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds (median)")
    ax_t.set_title("Time vs checkpoint size (cold push / cold pull)", fontsize=10)
    ax_m.set_ylabel("peak RSS, MB")
    ax_m.axhline(512, color="grey", linewidth=0.8, linestyle=":")
    ax_m.set_title("Peak RSS vs checkpoint size (target: <= 512 MB, flat)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def limits_plot(limits: dict[str, float], effective: dict[str, float], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(k, v) for k, v in limits.items() if k != "codec_ratio"]
    items += [(k, v) for k, v in effective.items()]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(items) + 1.2))
    names = [k.replace("_", " ") for k, _ in items]
    colors = ["#7f7f7f" if k in limits else COLORS["ferry"] for k, _ in items]
    ax.barh(names, [v for _, v in items], color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("MB/s (log)")
    ax.set_title("Limits (grey) and ferry's end-to-end rates (blue), this machine", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
