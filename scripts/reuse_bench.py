"""How long deriving a trace's reuse structure (kvprof.traces.reuse, what `kvprof inspect` prints) takes, against trace
size.

    python scripts/reuse_bench.py [TURNS ...]

Synthetic trajectories of 20 turns by 3 agents in the shape chat logs take: each turn renders the conversation so
far (every 4th reply re-rendered with its first id dropped, as a template's `| trim` does; every 5th turn under
another role header) plus a 60-id tool result, then generates 40 ids. One warm-up, then the median of 3 timed runs
per size; the tokens/s column shows whether the cost is linear in the trace's tokens.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from kvprof.traces.reuse import ReuseSummary, trajectory_reuse
from kvprof.traces.trace import Segment, Trajectory, Turn

TURNS_PER_TRAJECTORY = 20


def synthetic_trajectory(index: int, rng: random.Random) -> Trajectory:
    segments: dict[str, Segment] = {}
    turns, history = [], [[1, 2, 3] + [rng.randrange(1000) for _ in range(200)]]
    for number in range(TURNS_PER_TRAJECTORY):
        agent = ("plan", "act", "reflect")[number % 3]
        header = [7, 8] if number % 5 else [9]
        history.append(header + [rng.randrange(1000) for _ in range(60)])
        ids = [tok for message in history for tok in message]
        output = [rng.randrange(1000) for _ in range(40)]
        segments[f"in:{number}"] = Segment("message", "shared", ids, "")
        segments[f"out:{number}"] = Segment("output", "shared", output, "", producer=agent)
        turns.append(Turn(agent, [f"in:{number}"], f"out:{number}"))
        history.append(output[1:] if number % 4 == 0 else output)
    return Trajectory(f"t{index}", segments, turns)


def main(sizes: list[int]) -> None:
    print(f"{'turns':>8} {'input tokens':>14} {'median s':>10} {'tokens/s':>12} {'shared prefix':>14} {'moved':>7}")
    for turns in sizes:
        rng = random.Random(0)
        trajectories = [synthetic_trajectory(i, rng) for i in range(turns // TURNS_PER_TRAJECTORY)]
        times, summary = [], ReuseSummary()
        for repeat in range(4):
            summary = ReuseSummary()
            start = time.perf_counter()
            for traj in trajectories:
                summary.add(trajectory_reuse(traj))
            if repeat:  # the first run is the warm-up
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        print(
            f"{summary.turns:>8} {summary.input_tokens:>14} {seconds:>10.2f} {summary.input_tokens / seconds:>12.0f} "
            f"{summary.share(summary.shared_prefix):>14.1%} {summary.share(summary.moved):>7.1%}"
        )


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [2500, 5000, 10000])
