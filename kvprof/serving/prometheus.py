"""The few numbers serve-bench reads from a server's Prometheus /metrics text: vLLM's scheduler gauges (running and
waiting requests, KV-cache usage) and its prefix-cache counters."""

from __future__ import annotations

GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
}


def metric_values(text: str, names: dict[str, str]) -> dict[str, float]:
    """Per `key: metric name` of `names`, its value in `text` over label sets (engines): summed, except KV-cache usage
    (the largest); missing metrics absent."""
    wanted = {metric: key for key, metric in names.items()}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = wanted.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if key in values:
            value = max(values[key], value) if key == "kv_cache_usage" else values[key] + value
        values[key] = value
    return values
