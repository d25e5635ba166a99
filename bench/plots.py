"""The one results figure: six panels, ours vs peer, bars at the median with a p90 whisker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from report import median_p90

Raw = dict[str, Any] | None
COLORS = {"ours": "#1f77b4", "peer": "#ff7f0e"}
_TTFT_KEYS = (
    ("cold", "cold_ttft"),
    ("warm", "warm_ttft"),
    ("partial\nb2b", "partial_b2b_ttft"),
    ("partial\ninterleaved", "partial_interleaved_ttft"),
)


def plot_all(ours: Raw, peer: Raw, plan: dict[str, Any], path: Path) -> None:
    """Write the figure to `path` (PNG). Missing servers leave their bars out."""
    servers = {"ours": ours, "peer": peer}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, prompt_len in zip(axes[0][:2], plan["prompt_lens"][:2], strict=False):
        labels = [label for label, _ in _TTFT_KEYS]
        series = {
            name: [_stats(raw, f"{key}_{prompt_len}", lambda r: r["ttft_s"] * 1000) for _, key in _TTFT_KEYS]
            for name, raw in servers.items()
        }
        _bars(ax, labels, series, log=True)
        ax.set_title(f"TTFT, {prompt_len}-token system prompt")
        ax.set_ylabel("ms (log)")
    ax = axes[0][2]
    labels = [f"max_tokens={n}" for n in plan["decode_max_tokens"]]
    series = {
        name: [
            _stats(raw, f"decode_{n}", lambda r: r["decode_tokens_per_s"]) for n in plan["decode_max_tokens"]
        ]
        for name, raw in servers.items()
    }
    _bars(ax, labels, series)
    ax.set_title("Single-stream decode")
    ax.set_ylabel("tokens/s")

    levels = plan["concurrency_levels"]
    ax = axes[1][0]
    for name, raw in servers.items():
        stats = [
            median_p90([r["tokens_per_s"] for r in (raw or {}).get("rounds", {}).get(f"concurrency_{c}", [])])
            for c in levels
        ]
        _line(ax, levels, stats, name)
    ax.set_title("Aggregate decode, clients sharing one system prompt")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tokens/s (median, p90 dashed)")
    ax = axes[1][1]
    for name, raw in servers.items():
        _line(
            ax, levels, [_stats(raw, f"concurrency_{c}", lambda r: r["ttft_s"] * 1000) for c in levels], name
        )
    ax.set_yscale("log")
    ax.set_title("TTFT under concurrency")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("ms (median, p90 dashed; log)")
    ax = axes[1][2]
    names = [n for n, raw in servers.items() if raw]
    for i, name in enumerate(names):
        raw = servers[name] or {}
        ax.bar(i - 0.2, raw["idle_rss_bytes"] / 2**20, 0.4, color=COLORS[name], alpha=0.45)
        ax.bar(i + 0.2, raw["peak_rss_bytes"] / 2**20, 0.4, color=COLORS[name])
    ax.set_xticks(range(len(names)), [f"{n}\n(idle | peak)" for n in names])
    ax.set_title("Server RSS")
    ax.set_ylabel("MiB")
    for row in axes:
        for ax in row:
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle("prefixserve (ours) vs llama.cpp server (peer), SmolLM2-135M Q4_1, same machine")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _stats(raw: Raw, key: str, metric: Any) -> tuple[float | None, float | None]:
    values = [metric(r) for r in (raw or {}).get("records", {}).get(key, [])]
    return median_p90([float(v) for v in values if v is not None])


def _bars(
    ax: Any, labels: list[str], series: dict[str, list[tuple[float | None, float | None]]], log: bool = False
) -> None:
    x = np.arange(len(labels))
    width = 0.38
    for offset, (name, stats) in zip((-width / 2, width / 2), series.items(), strict=True):
        medians = [m if m is not None else 0.0 for m, _ in stats]
        p90s = [p if p is not None else 0.0 for _, p in stats]
        ax.bar(x + offset, medians, width, label=name, color=COLORS[name])
        ax.errorbar(
            x + offset,
            medians,
            yerr=[[0.0] * len(medians), np.maximum(np.subtract(p90s, medians), 0)],
            fmt="none",
            ecolor="black",
            capsize=3,
            lw=1,
        )
        for xi, m in zip(x + offset, medians, strict=True):
            if m:
                ax.annotate(
                    f"{m:.0f}" if m >= 10 else f"{m:.2g}", (xi, m), ha="center", va="bottom", fontsize=7
                )
    ax.set_xticks(x, labels)
    if log:
        ax.set_yscale("log")
    ax.legend()


def _line(ax: Any, levels: list[int], stats: list[tuple[float | None, float | None]], name: str) -> None:
    points = [(c, m, p) for c, (m, p) in zip(levels, stats, strict=True) if m is not None]
    if not points:
        return
    xs, medians, p90s = zip(*points, strict=True)
    ax.plot(xs, medians, "o-", color=COLORS[name], label=name)
    ax.plot(xs, p90s, "--", color=COLORS[name], alpha=0.6)
    ax.set_xticks(levels)
    ax.legend()
