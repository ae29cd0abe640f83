"""How fast serve-bench's driver is, against the stub OpenAI server (kvprof.serving.stub_server) on 127.0.0.1: the
request rate it sustains closed-loop at several concurrencies (the stub answering at once), and the latency it adds
to a request (the stub answering after a fixed TTFT: measured TTFT minus that TTFT, which also holds the stub's own
HTTP handling, so it bounds the driver's share from above), plus how late it sends a due request. The stub runs in
this same process and shares its interpreter lock with the driver: both numbers are pessimistic for the driver.

One warm-up run, then `--repeats` runs per setting; medians. The demo lora trace's turns, its trajectories repeated
to `--requests` requests. Usage: python scripts/serve_driver_bench.py [--requests 600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from kvprof.demo.assets import demo_world
from kvprof.serving.client import ServerClient
from kvprof.serving.driver import run_load
from kvprof.serving.stub_server import StubServer, trace_config
from kvprof.serving.summary import percentile
from kvprof.serving.traffic import Load, ServedModels, TrajectoryTraffic, trajectory_traffic
from kvprof.traces.trace import read_trace

AGENTS = ["plan", "act", "reflect"]
FIXED_TTFT = 0.020


def traffic(requests: int) -> list[TrajectoryTraffic]:
    """The demo lora trace's trajectories, repeated (with new ids) until they hold `requests` turns."""
    trace = demo_world().sample_traces["lora_short"]
    once = trajectory_traffic(read_trace(trace).trajectories, "agents", ServedModels("base", {a: a for a in AGENTS}))
    result: list[TrajectoryTraffic] = []
    while sum(len(t.turns) for t in result) < requests:
        for traj in once:
            result.append(dataclasses.replace(traj, id=f"{traj.id}#{len(result)}"))
    return result


def measure(ttft: float, concurrency: int, load: list[TrajectoryTraffic], repeats: int) -> dict:
    """Median request rate, TTFT and send delay over `repeats` runs after a warm-up, the stub answering after
    `ttft` seconds."""
    trace = str(demo_world().sample_traces["lora_short"])
    config = trace_config(trace, base="base", adapters=AGENTS, ttft=ttft, lifetime=600, max_requests=10**7)
    rates, ttfts, delays = [], [], []
    with StubServer(config) as stub:
        client = ServerClient(stub.url, timeout=30)
        for index in range(repeats + 1):
            run = run_load(client, load, "agents", Load("concurrency", concurrency), 0, 600)
            if index == 0:
                continue  # warm-up
            rates.append(len(run.requests) / run.duration)
            ttfts.append(statistics.median(r.ttft for r in run.requests))
            delays.append(percentile([r.send_delay for r in run.requests], 99))
    return {
        "concurrency": concurrency,
        "stub_ttft_ms": 1000 * ttft,
        "requests_per_s": statistics.median(rates),
        "added_ttft_ms": 1000 * (statistics.median(ttfts) - ttft),
        "send_delay_p99_ms": 1000 * statistics.median(delays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = traffic(args.requests)
    rows = [measure(0.0, concurrency, load, args.repeats) for concurrency in (1, 8, 32)]
    rows.append(measure(FIXED_TTFT, 1, load[: max(1, len(load) // 4)], args.repeats))
    for row in rows:
        print(
            f"concurrency {row['concurrency']:>2}, stub TTFT {row['stub_ttft_ms']:>4.0f} ms: "
            f"{row['requests_per_s']:7.0f} requests/s, added TTFT {row['added_ttft_ms']:.2f} ms, "
            f"send delay p99 {row['send_delay_p99_ms']:.2f} ms"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
