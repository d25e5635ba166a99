"""Turn two servers' raw records into summary rows and the markdown results table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

Raw = dict[str, Any]

# (row label, record key prefix, target as (op, ratio of ours/peer))
_TTFT_ROWS = (
    ("Cold TTFT", "cold_ttft", ("<=", 0.5)),
    ("Warm TTFT (identical prompt)", "warm_ttft", ("<=", 0.25)),
    ("Partial TTFT (new user msg, back to back)", "partial_b2b_ttft", ("<=", 0.5)),
    ("Partial TTFT (new user msg, unrelated request between)", "partial_interleaved_ttft", ("<=", 0.5)),
)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table. Values are in `unit`; `ratio` is ours/peer of the medians."""

    label: str
    unit: str
    ours_median: float | None
    ours_p90: float | None
    peer_median: float | None
    peer_p90: float | None
    target: tuple[str, float] | None = None
    note: str = ""
    ratio_on_p90: bool = False

    @property
    def ratio(self) -> float | None:
        ours, peer = (
            (self.ours_p90, self.peer_p90) if self.ratio_on_p90 else (self.ours_median, self.peer_median)
        )
        if ours is None or peer is None or peer == 0:
            return None
        return ours / peer

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None
        op, bound = self.target
        return self.ratio <= bound if op == "<=" else self.ratio >= bound


def _busy_note(ours: Raw | None, peer: Raw | None, key: str, n: int) -> str:
    """How much the busy core slowed each server: busy median / quiet median."""
    parts = []
    for name, raw in (("ours", ours), ("peer", peer)):
        quiet = median_p90(_values(raw, f"{key}_{n}", lambda r: r["ttft_s"]))[0]
        busy = median_p90(_values(raw, f"busy_{key}_{n}", lambda r: r["ttft_s"]))[0]
        if quiet and busy:
            parts.append(f"{name} {busy / quiet:.2f}x its quiet value")
    return "; ".join(parts)


def median_p90(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.median(values)), float(np.percentile(values, 90))


def build_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """Every row of the results table; a missing server yields empty cells, not an error."""
    rows: list[Row] = []
    for prompt_len in plan["prompt_lens"]:
        for label, key, ttft_target in _TTFT_ROWS:
            rows.append(
                _row(
                    f"{label}, {prompt_len}-tok system",
                    "ms",
                    ours,
                    peer,
                    f"{key}_{prompt_len}",
                    lambda r: r["ttft_s"] * 1000,
                    ttft_target,
                    note=_cached_note(ours, f"{key}_{prompt_len}"),
                )
            )
    for max_tokens in plan["decode_max_tokens"]:
        key = f"decode_{max_tokens}"
        rows.append(
            _row(
                f"Single-stream decode, max_tokens={max_tokens}",
                "tok/s",
                ours,
                peer,
                key,
                lambda r: r["decode_tokens_per_s"],
                (">=", 1.0),
                note=_token_count_note(ours, peer, key),
            )
        )
    for num_clients in plan["concurrency_levels"]:
        key = f"concurrency_{num_clients}"
        agg_target: tuple[str, float] | None = (">=", 3.0) if num_clients == 8 else None
        o_med, o_p90 = median_p90(_round_values(ours, key))
        p_med, p_p90 = median_p90(_round_values(peer, key))
        rows.append(
            Row(
                f"Aggregate decode, {num_clients} clients",
                "tok/s",
                o_med,
                o_p90,
                p_med,
                p_p90,
                agg_target,
                note=_token_count_note(ours, peer, key),
            )
        )
        rows.append(
            _row(
                f"TTFT at {num_clients} clients (ratio of p90)",
                "ms",
                ours,
                peer,
                key,
                lambda r: r["ttft_s"] * 1000,
                None,
                ratio_on_p90=True,
            )
        )
    n = plan.get("contended_prompt_len")
    for label, key in (("Cold TTFT", "cold_ttft"), ("Warm TTFT", "warm_ttft")):
        if n is None:
            break
        rows.append(
            _row(
                f"{label}, {n}-tok system, one core busy with another process",
                "ms",
                ours,
                peer,
                f"busy_{key}_{n}",
                lambda r: r["ttft_s"] * 1000,
                None,
                note=_busy_note(ours, peer, key, n),
            )
        )
    rows.append(
        Row(
            "Start-up: launch to /health answering",
            "s",
            _startup(ours),
            None,
            _startup(peer),
            None,
            note="ours loads the model from its prepared-model cache when an earlier start filled it "
                 "(docs/architecture.md, \"Start-up\"); the first start on a machine prepares it (~15 s more)",
        )
    )
    rows.append(
        Row(
            "Peak RSS of the server",
            "MiB",
            _rss(ours),
            None,
            _rss(peer),
            None,
            note=f"idle after start: ours {_fmt(_rss(ours, 'idle'))}, peer {_fmt(_rss(peer, 'idle'))} MiB",
        )
    )
    return rows


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| Workload | unit | ours median | ours p90 | peer median | peer p90 | ours/peer | target | met | notes |",
        "|---|---|--:|--:|--:|--:|--:|:-:|:-:|---|",
    ]
    for row in rows:
        target = f"{row.target[0]} {row.target[1]:g}x" if row.target else ""
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        lines.append(
            f"| {row.label} | {row.unit} | {_fmt(row.ours_median)} | {_fmt(row.ours_p90)} | "
            f"{_fmt(row.peer_median)} | {_fmt(row.peer_p90)} | {_fmt_ratio(row.ratio)} | {target} | {met} | {row.note} |"
        )
    return "\n".join(lines)


def usage_check(raw: Raw | None) -> str:
    """How many streamed responses carried usage and cached_tokens: the accounting contract."""
    if raw is None:
        return "not run"
    records = [r for rs in raw["records"].values() for r in rs]
    with_usage = sum(1 for r in records if r.get("usage"))
    with_cached = sum(
        1
        for r in records
        if isinstance(((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens"), int)
    )
    return f"{with_usage}/{len(records)} streamed responses carried `usage`, {with_cached} carried `cached_tokens`"


def _row(
    label: str,
    unit: str,
    ours: Raw | None,
    peer: Raw | None,
    key: str,
    metric: Any,
    target: tuple[str, float] | None,
    note: str = "",
    ratio_on_p90: bool = False,
) -> Row:
    o_med, o_p90 = median_p90(_values(ours, key, metric))
    p_med, p_p90 = median_p90(_values(peer, key, metric))
    return Row(label, unit, o_med, o_p90, p_med, p_p90, target, note, ratio_on_p90)


def _values(raw: Raw | None, key: str, metric: Any) -> list[float]:
    if raw is None:
        return []
    values = [metric(r) for r in raw["records"].get(key, [])]
    return [float(v) for v in values if v is not None]


def _round_values(raw: Raw | None, key: str) -> list[float]:
    return [] if raw is None else [r["tokens_per_s"] for r in raw["rounds"].get(key, [])]


def _cached_note(ours: Raw | None, key: str) -> str:
    if ours is None:
        return ""
    records = ours["records"].get(key, [])
    usages = [r.get("usage") or {} for r in records]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages]
    prompt = [u.get("prompt_tokens") for u in usages]
    cached_counts = [int(c) for c in cached if isinstance(c, int)]
    prompt_counts = [int(p) for p in prompt if isinstance(p, int)]
    if not records or len(cached_counts) < len(records) or len(prompt_counts) < len(records):
        return "ours: no cached_tokens in usage"
    return (
        f"ours cached {int(statistics.median(cached_counts))}/"
        f"{int(statistics.median(prompt_counts))} prompt tok"
    )


def _token_count_note(ours: Raw | None, peer: Raw | None, key: str) -> str:
    parts = []
    for name, raw in (("ours", ours), ("peer", peer)):
        counts = [r["num_completion_tokens"] for r in (raw or {}).get("records", {}).get(key, [])]
        if counts:
            parts.append(f"{name} {int(statistics.median(counts))} tok/req")
    return ", ".join(parts)


def _rss(raw: Raw | None, which: str = "peak") -> float | None:
    if raw is None:
        return None
    return round(raw[f"{which}_rss_bytes"] / 2**20, 1)


def _startup(raw: Raw | None) -> float | None:
    if raw is None or raw.get("startup_s") is None:
        return None
    return round(float(raw["startup_s"]), 1)


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"
