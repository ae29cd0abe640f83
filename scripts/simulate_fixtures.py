"""Trim a serve-bench result and a replay result of the same trace to what `kvprof simulate`'s calibration and
validation read, for tests/data/simulate/ (tests/test_simulate_validation.py):

    python scripts/simulate_fixtures.py SERVE_BENCH.json REPLAY.json tests/data/simulate

The replay keeps its dense run and the policies serve-bench's patterns stand for (nonshared, fullshared); times are
rounded to microseconds, token arrival times to 10 µs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REQUEST_FIELDS = (
    "trajectory", "index", "agent", "due", "send_delay", "ttft", "e2e", "prompt_tokens", "cached_tokens",
    "output_tokens", "token_times",
)  # fmt: skip
TURN_FIELDS = (
    "agent", "trajectory", "turn", "input_tokens", "output_tokens", "prefilled", "flops", "ttft_flops", "ttft_s",
    "decode_s", "decode_steps", "memory_bytes", "working_peak_bytes",
)  # fmt: skip


def rounded(value: object) -> object:
    if isinstance(value, list):
        return [round(v, 5) for v in value]  # token arrival times to 10 µs
    return round(value, 6) if isinstance(value, float) else value


def trimmed_serve_bench(data: dict) -> dict:
    runs = []
    for run in data["runs"]:
        summary = run["summary"]
        runs.append(
            {
                "summary": {
                    "pattern": summary["pattern"],
                    "load": summary["load"],
                    "overall": {"ttft": {"p50": summary["overall"]["ttft"]["p50"]}},
                    "throughput": {"requests_per_s": summary["throughput"]["requests_per_s"]},
                },
                "requests": [{k: rounded(r[k]) for k in REQUEST_FIELDS} for r in run["requests"]],
            }
        )
    args = {"kv_cache_gib": data["args"].get("kv_cache_gib"), "concurrency": data["args"].get("concurrency")}
    return {k: data[k] for k in ("schema", "version", "mode", "server")} | {"args": args, "runs": runs}


def trimmed_replay(data: dict) -> dict:
    def turns(records: list[dict]) -> list[dict]:
        return [{k: rounded(t[k]) for k in TURN_FIELDS if k in t} for t in records]

    policies = {label: {"turns": turns(data["policies"][label]["turns"])} for label in ("nonshared", "fullshared")}
    kept = {k: data[k] for k in ("schema", "version", "mode", "dtype", "trace")}
    return kept | {"dense": {"turns": turns(data["dense"]["turns"])}, "policies": policies}


def main(serve_bench: str, replay: str, out: str) -> None:
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    bench = trimmed_serve_bench(json.loads(Path(serve_bench).read_text(encoding="utf-8")))
    bench["server"] = {k: bench["server"].get(k) for k in ("version",)}
    (target / "serve_bench.json").write_text(json.dumps(bench, separators=(",", ":")) + "\n", encoding="utf-8")
    replayed = trimmed_replay(json.loads(Path(replay).read_text(encoding="utf-8")))
    (target / "replay.json").write_text(json.dumps(replayed, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:4])
