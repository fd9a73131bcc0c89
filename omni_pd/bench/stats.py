"""Statistics of one benchmark level, and the ratios between levels and configs.

Pure functions over plain numbers: no client, no server. A value that cannot be computed (no
successful request, no inter-token gap, a zero baseline) is None, never NaN, so the JSON holds null.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

# The metric keys of one result, in the order the table and the JSON show them.
LATENCIES = ("ttft", "ttfa", "itl", "e2e")
METRIC_KEYS = (
    "req_per_s",
    "output_tok_per_s",
    *(f"{name}_ms_{p}" for name in LATENCIES for p in ("p50", "p99")),
    "errors",
)


@dataclass
class RequestRecord:
    """What one request measured, in seconds from the moment it was sent.

    `ok` is False for a request that raised, or ended without audio although its answer had
    something to speak; its timings are not used. `no_speech`: the answer ended at once (an end
    token first) and had nothing to speak, so the request is complete without audio: counted
    apart, not an error, and out of the TTFA figures. `itl_s` holds the gaps between consecutive
    text-content chunks."""

    ok: bool
    no_speech: bool = False
    rejected: bool = False  # turned away at once by admission control (HTTP 429)
    ttft_s: float | None = None
    ttfa_s: float | None = None
    # The last audio chunk's time over the audio's seconds (vllm-omni's audio RTF: under 1, the
    # speech arrived faster than it plays).
    rtf: float | None = None
    audio_s: float = 0.0  # seconds of audio streamed
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    text: str = ""  # the answer's text (a multi-turn conversation carries it on)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    prompt_tokens: int | None = None  # usage.prompt_tokens (chat template included), when sent


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def percentiles_ms(values_s: Iterable[float | None], qs: Sequence[float] = (50, 99)) -> list[float | None]:
    """The `qs` percentiles (numpy's default, linear interpolation) of `values_s` in milliseconds;
    None values are left out, and every percentile is None when nothing is left."""
    values = [v for v in (_finite(v) for v in values_s) if v is not None]
    if not values:
        return [None for _ in qs]
    return [float(p) * 1e3 for p in np.percentile(np.asarray(values, dtype=np.float64), list(qs))]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not > 0."""
    numerator, denominator = _finite(numerator), _finite(denominator)
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def mean_tpot_s(record: RequestRecord) -> float | None:
    """The request's mean time per output token after its first (DistServe's TPOT): (end-to-end
    - TTFT) / (output tokens - 1); None for an answer of one token, which has no gap to time."""
    if record.e2e_s is None or record.ttft_s is None or record.output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slo(
    record: RequestRecord,
    slo_ttft_ms: float | None,
    slo_ttfa_ms: float | None,
    slo_itl_ms: float | None = None,
) -> bool:
    """A completed request within every SLO given (DistServe's goodput): its TTFT, its TTFA (a
    request without speech has none to miss) and its mean time per output token (the ITL SLO is
    judged on this one number per request, not on a percentile of its gaps; an answer of one
    token has none to miss)."""
    if not record.ok:
        return False
    if slo_itl_ms is not None:
        tpot = mean_tpot_s(record)
        if tpot is not None and tpot * 1e3 > slo_itl_ms:
            return False
    if slo_ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > slo_ttft_ms):
        return False
    if (
        slo_ttfa_ms is not None
        and not record.no_speech
        and (record.ttfa_s is None or record.ttfa_s * 1e3 > slo_ttfa_ms)
    ):
        return False
    return True


def summarize_level(
    records: Sequence[RequestRecord],
    wall_s: float,
    slo_ttft_ms: float | None = None,
    slo_ttfa_ms: float | None = None,
    slo_itl_ms: float | None = None,
) -> dict:
    """Throughput and latency percentiles of one level: `records` ran in `wall_s` seconds.

    Throughput counts successful requests only; latency percentiles are over successful requests,
    ITL over every gap of every successful request pooled together. Goodput (with an SLO given):
    successful requests per second within the SLOs, and the share of all requests that were.
    `tpot_ms_p50/p99`: percentiles over requests of each one's mean time per output token."""
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    wall = _finite(wall_s)
    row: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "wall_s": wall,
        "req_per_s": ratio(len(done), wall) if done else None,
        "output_tok_per_s": ratio(tokens, wall) if done else None,
        "output_tokens": tokens,
    }
    samples = {
        "ttft": [r.ttft_s for r in done],
        "ttfa": [r.ttfa_s for r in done if not r.no_speech],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done],
    }
    for name in LATENCIES:
        row[f"{name}_ms_p50"], row[f"{name}_ms_p99"] = percentiles_ms(samples[name])
    row["tpot_ms_p50"], row["tpot_ms_p99"] = percentiles_ms(mean_tpot_s(r) for r in done)
    rtf_p50, rtf_p99 = percentiles_ms(r.rtf for r in done if not r.no_speech)
    row["rtf_p50"] = rtf_p50 / 1e3 if rtf_p50 is not None else None  # a ratio, not a time
    row["rtf_p99"] = rtf_p99 / 1e3 if rtf_p99 is not None else None
    row["errors"] = len(records) - len(done)
    row["no_speech"] = sum(r.no_speech for r in done)
    row["rejected"] = sum(r.rejected for r in records)
    if slo_ttft_ms is not None or slo_ttfa_ms is not None or slo_itl_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_ttfa_ms, slo_itl_ms) for r in records)
        row["goodput_req_per_s"] = ratio(good, wall)
        row["slo_attainment"] = ratio(good, len(records))
    return row


def vs_config_key(label: str) -> str:
    """The JSON key of a config's req/s relative to the config `label` at the same level."""
    return "req_per_s_vs_" + re.sub(r"[^0-9A-Za-z_]+", "_", label)


def add_ratios(results: list[dict]) -> list[dict]:
    """Adds, in place, ratios measured in the same run to rows holding `config`, `concurrency`,
    `req_per_s` and `e2e_ms_p50`:
      req_per_s_vs_c1, e2e_p50_vs_c1   this level against the lowest level of the same config
                                       (its concurrency is in `ratio_baseline_concurrency`)
      req_per_s_vs_<first config>      for every other config, against the first config (the first
                                       in `results`) at the same concurrency
      pd_ttft_overhead_ms              for a config with KV handoffs (`kv_handoff_ms_mean`) beside a
                                       first config without: its TTFT p50 minus the first config's
                                       at the same concurrency, minus the mean handoff (what P/D
                                       orchestration adds to TTFT beyond moving the KV)
    Returns `results`."""
    configs = list(dict.fromkeys(row["config"] for row in results))
    lowest: dict[str, dict] = {}
    for row in results:
        base = lowest.get(row["config"])
        if base is None or row["concurrency"] < base["concurrency"]:
            lowest[row["config"]] = row
    for row in results:
        base = lowest[row["config"]]
        row["ratio_baseline_concurrency"] = base["concurrency"]
        row["req_per_s_vs_c1"] = ratio(row["req_per_s"], base["req_per_s"])
        row["e2e_p50_vs_c1"] = ratio(row["e2e_ms_p50"], base["e2e_ms_p50"])
    if len(configs) >= 2:
        first = configs[0]
        key = vs_config_key(first)
        by_level = {row["concurrency"]: row for row in results if row["config"] == first}
        for row in results:
            if row["config"] != first:
                other = by_level.get(row["concurrency"])
                row[key] = ratio(row["req_per_s"], other["req_per_s"] if other else None)
                handoff = row.get("kv_handoff_ms_mean")
                if (
                    handoff is not None
                    and other is not None
                    and other.get("kv_handoff_ms_mean") is None
                    and row.get("ttft_ms_p50") is not None
                    and other.get("ttft_ms_p50") is not None
                ):
                    row["pd_ttft_overhead_ms"] = row["ttft_ms_p50"] - other["ttft_ms_p50"] - handoff
    return results
