"""A serve-bench run summarised: latency percentiles per agent and overall (linear interpolation), throughput,
prefix-hit ratio (cached ÷ prompt tokens, as the server reports), agreement with the trace, gauges, and the two
patterns compared per load. Times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from kvprof.results.serve_bench import ServeLoad, ServeRun, ServeSummary
from kvprof.serving.driver import LoadRun, RequestRecord

LATENCIES = ("ttft", "tpot", "e2e", "server_queue", "send_delay")
QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile of `values` (non-empty), interpolated linearly."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float]) -> dict | None:
    """p50, p90, p99 and mean of `values`; None when there are none."""
    if not values:
        return None
    return {f"p{q}": percentile(values, q) for q in QUANTILES} | {"mean": sum(values) / len(values)}


def hit_ratio(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens of `records`; None when the server reported no cached tokens."""
    reported = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if reported and prompt else None


def group_stats(records: list[RequestRecord]) -> dict:
    """Request count, prefix-hit ratio and the distribution of every latency of `records`."""
    stats: dict = {"requests": len(records), "prefix_hit_ratio": hit_ratio(records)}
    for name in LATENCIES:
        stats[name] = distribution([v for r in records if (v := getattr(r, name)) is not None])
    return stats


def cache_by_turn(records: list[RequestRecord]) -> dict:
    """Cached tokens of agents' first turns and of later turns: requests reporting cached tokens, hit ratios."""
    result = {}
    for kind, chosen in (
        ("first_turns", [r for r in records if r.agent_turn == 0]),
        ("later_turns", [r for r in records if r.agent_turn > 0]),
    ):
        result[kind] = {
            "requests": len(chosen),
            "with_cached_tokens": sum(1 for r in chosen if r.cached_tokens),
            "cached_tokens": sum(r.cached_tokens or 0 for r in chosen),
            "prefix_hit_ratio": hit_ratio(chosen),
        }
    return result


def gauge_stats(samples: list[dict]) -> dict:
    """Mean and maximum of each /metrics gauge over the run's samples."""
    keys = dict.fromkeys(key for sample in samples for key in sample if key != "t")
    stats = {}
    for key in keys:
        values = [sample[key] for sample in samples if key in sample]
        stats[key] = {"mean": sum(values) / len(values), "max": max(values)}
    return stats


def summarize(run: LoadRun) -> dict:
    """The summary of one run (see the module docstring); times in seconds, rates per second."""
    records = run.requests
    matching = sum(1 for r in records if r.matches)
    duration = max(run.duration, 1e-9)
    queries, hits = run.prefix_cache.get("prefix_cache_queries"), run.prefix_cache.get("prefix_cache_hits")
    return {
        "pattern": run.pattern,
        "load": {"kind": run.load.kind, "value": run.load.value, "label": run.load.label},
        "requests": len(records),
        "unfinished_trajectories": run.unfinished,
        "duration_s": run.duration,
        "throughput": {
            "requests_per_s": len(records) / duration,
            "output_tokens_per_s": sum(r.output_tokens for r in records) / duration,
            "tokens_per_s": sum(r.output_tokens + r.prompt_tokens for r in records) / duration,
        },
        "prefix_hit_ratio": hit_ratio(records),
        "cache_by_turn": cache_by_turn(records),
        "agreement": {
            "matching": matching,
            "requests": len(records),
            "fraction": matching / len(records) if records else None,
        },
        "overall": group_stats(records),
        "agents": {agent: group_stats([r for r in records if r.agent == agent]) for agent in _agents(records)},
        "server": {
            "samples": len(run.samples),
            "gauges": gauge_stats(run.samples),
            "prefix_cache": {
                "queries": queries,
                "hits": hits,
                "hit_ratio": hits / queries if queries and hits is not None else None,
            },
        },
    }


def _agents(records: list[RequestRecord]) -> list[str]:
    return list(dict.fromkeys(r.agent for r in records))


def run_result(run: LoadRun) -> ServeRun:
    """One run of a result: summary, every request, /metrics samples."""
    summary = summarize(run)
    return ServeRun(
        summary=ServeSummary(**summary | {"load": ServeLoad(**summary["load"])}),
        requests=[asdict(r) for r in run.requests],
        samples=run.samples,
    )


def pattern_comparison(summaries: list[ServeSummary]) -> list[dict]:
    """Per load run under both patterns: base's lower TTFT p90, higher throughput and prefix-hit ratio against
    agents — what sharing could win on this engine."""
    by_load: dict[str | None, dict[str, ServeSummary]] = {}
    for summary in summaries:
        by_load.setdefault(summary.load.label, {})[summary.pattern] = summary
    rows = []
    for label, patterns in by_load.items():
        agents, base = patterns.get("agents"), patterns.get("base")
        if agents is None or base is None:
            continue
        agents_p90, base_p90 = (_p90(s, "ttft") for s in (agents, base))
        rows.append(
            {
                "load": label,
                "ttft_p90_agents": agents_p90,
                "ttft_p90_base": base_p90,
                "ttft_p90_ratio": agents_p90 / base_p90 if agents_p90 and base_p90 else None,
                "throughput_ratio": _tokens_per_s(base) / _tokens_per_s(agents) if _tokens_per_s(agents) else None,
                "prefix_hit_ratio_agents": agents.prefix_hit_ratio,
                "prefix_hit_ratio_base": base.prefix_hit_ratio,
            }
        )
    return rows


def _p90(summary: ServeSummary, metric: str) -> float | None:
    stats = summary.overall[metric]
    return stats["p90"] if stats else None


def _tokens_per_s(summary: ServeSummary) -> float:
    return (summary.throughput or {})["tokens_per_s"]
