"""How long `kvprof simulate`'s engine takes: an hour of Poisson traffic at 8 trajectories per second for every policy
of a replay, on one core (the issue asks for well under a minute).

    python scripts/simulate_bench.py REPLAY.json [--qps 8] [--duration 3600] [--repeats 3]

The step model is fitted to the replay's own dense timings and the server has 80 GiB; one warm-up run of the first
policy, then `--repeats` timed sweeps of every policy; prints each sweep's seconds and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvprof.serving.traffic import Load
from kvprof.simulate.cost import fit, replay_observations
from kvprof.simulate.sweep import GIB, Settings, sweep
from kvprof.simulate.workload import load_replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replay", type=Path)
    parser.add_argument("--qps", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    work = load_replay(options.replay)
    cost = fit(replay_observations(json.loads(options.replay.read_text(encoding="utf-8"))), "replay")
    settings = Settings(memory_bytes=80 * GIB, duration=options.duration)
    loads = [Load("qps", options.qps)]
    policies = list(work.policies)
    sweep(work, cost, settings, loads, policies[:1])  # warm-up
    seconds, requests = [], 0
    for _ in range(options.repeats):
        began = time.perf_counter()
        rows = sweep(work, cost, settings, loads, policies)
        seconds.append(time.perf_counter() - began)
        requests = sum(row["requests"] for row in rows)
        print(f"{len(policies)} policies, {requests} requests simulated: {seconds[-1]:.1f} s")
    print(
        f"median of {options.repeats}: {statistics.median(seconds):.1f} s for {options.duration:g} s of traffic at "
        f"{options.qps:g} qps × {len(policies)} policies ({statistics.median(seconds) / len(policies):.2f} s each)"
    )


if __name__ == "__main__":
    main()
