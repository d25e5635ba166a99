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
    # "ratio": the target bounds ours/peer; "ours": it bounds ours' own value (its p90 when
    # ratio_on_p90), in `unit` (an absolute target, or a ratio of ours to ours in another row)
    target_on: str = "ratio"

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
        value = self.ratio if self.target_on == "ratio" else (self.ours_p90 if self.ratio_on_p90 else self.ours_median)
        if self.target is None or value is None:
            return None
        op, bound = self.target
        return value <= bound if op == "<=" else value >= bound


def _long_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """The long prompt alone (and its cost over the longest shorter cold prompt, ours against
    ours), and the short requests that arrived while another one prefilled."""
    n = plan.get("long_prompt_len")
    if not n or not plan.get("long_runs"):
        return []

    def ttft(r: Raw) -> float:
        return float(r["ttft_s"]) * 1000

    rows = [_row(f"Cold TTFT, {n}-tok system", "ms", ours, peer, f"cold_ttft_{n}", ttft, None,
                 note=_cached_note(ours, f"cold_ttft_{n}"))]
    base = max(plan["prompt_lens"])
    growth = []
    for raw in (ours, peer):
        long_med = median_p90(_values(raw, f"cold_ttft_{n}", ttft))[0]
        short_med = median_p90(_values(raw, f"cold_ttft_{base}", ttft))[0]
        growth.append(long_med / short_med if long_med and short_med else None)
    rows.append(Row(f"Cold TTFT {n} tok / cold TTFT {base} tok (each server's own)", "x", growth[0], None,
                    growth[1], None, ("<=", 4.5), note=f"target: ours <= 4.5 ({n / base:g}x the tokens)",
                    target_on="ours"))
    rows.append(_row(f"Short requests ({plan['short_prompt_len']}-tok cold prompts, {plan['short_clients']} clients) "
                     f"while a cold {n}-tok prompt prefills (ratio of p90)", "ms", ours, peer, "short_during_long",
                     ttft, ("<=", 1000.0), note=_short_note(ours, peer, n) + "; target: ours p90 <= 1 s",
                     ratio_on_p90=True, target_on="ours"))
    return rows


def _short_note(ours: Raw | None, peer: Raw | None, n: int) -> str:
    parts = []
    for name, raw in (("ours", ours), ("peer", peer)):
        count = len(_values(raw, "short_during_long", lambda r: r["ttft_s"]))
        long_med = median_p90(_values(raw, f"long_busy_ttft_{n}", lambda r: r["ttft_s"]))[0]
        if count:
            parts.append(f"{name} {count} short requests" + (f", the long one {long_med:.1f} s" if long_med else ""))
    return "; ".join(parts)


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
    return [
        *_ttft_rows(ours, peer, plan),
        *_decode_rows(ours, peer, plan),
        *_concurrency_rows(ours, peer, plan),
        *_busy_rows(ours, peer, plan),
        *_long_rows(ours, peer, plan),
        *_process_rows(ours, peer),
    ]


def _ttft_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """Cold, warm and partial TTFT at each system-prompt length."""
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
    return rows


def _decode_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """Single-stream decode, and after a deep cached prompt."""
    rows: list[Row] = []
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
    deep = plan.get("deep_decode_prompt_len")
    if deep:
        key = f"decode_deep_{deep}"
        rows.append(
            _row(
                f"Single-stream decode after a {deep}-tok system prompt (cached), max_tokens={plan['deep_decode_max_tokens']}",
                "tok/s",
                ours,
                peer,
                key,
                lambda r: r["decode_tokens_per_s"],
                None,
                note=_token_count_note(ours, peer, key),
            )
        )
    return rows


def _concurrency_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """Aggregate decode and TTFT p90 at each number of clients."""
    rows: list[Row] = []
    for num_clients in plan["concurrency_levels"]:
        key = f"concurrency_{num_clients}"
        # issue #12's target against llama-server (3x was set against the one-slot Python server)
        agg_target: tuple[str, float] | None = (">=", 1.5) if num_clients == 8 else None
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
                ("<=", 0.25) if num_clients == 16 else None,
                ratio_on_p90=True,
            )
        )
    return rows


def _busy_rows(ours: Raw | None, peer: Raw | None, plan: Raw) -> list[Row]:
    """Cold and warm TTFT with one core busy with another process."""
    rows: list[Row] = []
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
    return rows


def _process_rows(ours: Raw | None, peer: Raw | None) -> list[Row]:
    """Start-up and peak RSS."""
    rows: list[Row] = []
    rows.append(
        Row(
            "Start-up, second start: launch to serving /v1/models (median of 3)",
            "s",
            _startup(ours),
            None,
            _startup(peer),
            None,
            target=("<=", 5.0),
            note="target: ours <= 5 s; the median of three second starts (ours "
                 f"{_starts(ours)} s, peer {_starts(peer)} s); each server was started once and stopped before (first start: ours "
                 f"{_fmt(_startup(ours, 'first_'))} s, peer {_fmt(_startup(peer, 'first_'))} s): ours then loads the model "
                 "from its prepared-model cache and its built kernels (docs/architecture.md, \"Start-up\")",
            target_on="ours",
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
        unit = "x" if row.target_on == "ratio" or row.unit == "x" else f" {row.unit}"
        target = f"{row.target[0]} {row.target[1]:g}{unit}" if row.target else ""
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
    target_on: str = "ratio",
) -> Row:
    o_med, o_p90 = median_p90(_values(ours, key, metric))
    p_med, p_p90 = median_p90(_values(peer, key, metric))
    return Row(label, unit, o_med, o_p90, p_med, p_p90, target, note, ratio_on_p90, target_on)


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


def _starts(raw: Raw | None) -> str:
    if raw is None or not raw.get("second_starts_s"):
        return "-"
    return " / ".join(f"{t:.1f}" for t in raw["second_starts_s"])


def _startup(raw: Raw | None, which: str = "") -> float | None:
    if raw is None or raw.get(f"{which}startup_s") is None:
        return None
    return round(float(raw[f"{which}startup_s"]), 1)


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"
