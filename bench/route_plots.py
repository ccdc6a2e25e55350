"""PNG figures of a routing benchmark (matplotlib, headless): one file per question asked.

- route_ttft_cdf.png: the TTFT distribution of every policy (who is fast, and for how many)
- route_latency.png: TTFT p50 / p90 / p99 per policy
- route_reuse.png: prefix hit rate per policy against the trace's inherent reuse (the ceiling)
- route_load.png: requests per worker for every policy (load balance)
- route_sweep.png (`--sweep`): shed, time outside the engine, TTFT and reuse captured against
  the request rate, one line per policy
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .route_metrics import OK, PolicyMetrics, RequestResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(
    out: Path,
    metrics: Sequence[PolicyMetrics],
    results: dict[str, Sequence[RequestResult]],
    *,
    inherent_reuse: float,
    title: str,
) -> list[Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    names = [m.policy for m in metrics]
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in names:
        ttft = np.sort(
            [r.engine_ttft_s for r in results[name] if r.status == OK and r.engine_ttft_s]
        )
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name, color=colors[name])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, simulated s (log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT distribution — {title}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "route_ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = np.arange(len(names))
    for k, (label, attr) in enumerate(
        [("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s")]
    ):
        values = [getattr(m, attr) or 0.0 for m in metrics]
        ax.bar(x + (k - 1) * 0.27, values, 0.27, label=label)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, simulated s (log scale)")
    ax.set_title(f"TTFT percentiles — {title}", fontsize=10)
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "route_latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    hits = [m.hit_rate * 100 for m in metrics]
    bars = ax.bar(x, hits, color=[colors[n] for n in names])
    ax.axhline(inherent_reuse * 100, color="black", ls="--", lw=1)
    ax.text(
        len(names) - 0.5,
        inherent_reuse * 100,
        f"inherent reuse {inherent_reuse:.0%}",
        ha="right",
        va="bottom",
        fontsize=8,
    )
    for bar, m in zip(bars, metrics, strict=True):
        ax.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height(),
            f"{m.reuse_captured:.1%}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("prefix hit rate, % of prompt tokens")
    ax.set_ylim(0, max([*hits, inherent_reuse * 100]) * 1.15 + 1)
    ax.set_title(f"Prefix hits (labels: reuse captured) — {title}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    paths.append(_save(fig, out / "route_reuse.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    workers = sorted({w for m in metrics for w in m.per_worker_requests})
    width = 0.8 / max(len(workers), 1)
    for j, worker in enumerate(workers):
        counts = [m.per_worker_requests.get(worker, 0) for m in metrics]
        ax.bar(x - 0.4 + (j + 0.5) * width, counts, width, color=plt.cm.viridis(j / len(workers)))
    for i, m in enumerate(metrics):
        if m.imbalance:
            top = max(m.per_worker_requests.values())
            ax.text(i, top, f"×{m.imbalance:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("requests served per worker")
    ax.set_title(f"Load per worker (labels: max / mean) — {title}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    paths.append(_save(fig, out / "route_load.png"))
    return paths


SWEEP_PANELS = [
    # (title, y label, value of a sweep point, log scale)
    ("shed", "requests shed (429/503, cap)", lambda p: p["metrics"]["shed"], False),
    ("outside the engine p50", "wall ms (log)", lambda p: p["outside_p50_ms"], True),
    ("outside the engine p99", "wall ms (log)", lambda p: p["outside_p99_ms"], True),
    ("TTFT p50", "simulated s (log)", lambda p: p["metrics"]["ttft_p50_s"], True),
    ("TTFT p99", "simulated s (log)", lambda p: p["metrics"]["ttft_p99_s"], True),
    (
        "reuse captured",
        "% of inherent reuse",
        lambda p: 100 * p["metrics"]["reuse_captured"],
        False,
    ),
]


def write_sweep_plot(out: Path, points: Sequence[dict], *, title: str) -> Path:
    """One figure, a panel per metric against the request rate, one line per policy
    (`points`: `route_sweep.Point.as_dict()` rows)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(p["policy"] for p in points))
    rates = sorted({p["rate"] for p in points})
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (label, ylabel, value, log) in zip(axes.flat, SWEEP_PANELS, strict=True):
        for i, name in enumerate(names):
            mine = sorted((p for p in points if p["policy"] == name), key=lambda p: p["rate"])
            xy = [(p["rate"], value(p)) for p in mine if value(p) is not None]
            if log:
                xy = [(x, y) for x, y in xy if y > 0]
            if xy:
                xs, ys = zip(*xy, strict=True)
                ax.plot(xs, ys, marker="o", label=name, color=plt.cm.tab10(i % 10))
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        if log:
            ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("request rate, /s (workload clock)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Rate sweep — {title}", fontsize=11)
    return _save(fig, out / "route_sweep.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
