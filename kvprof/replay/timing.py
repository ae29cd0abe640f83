"""How a replay times TTFT, decode and latency: per turn, prefills timed round-robin across the runs
(`interleaved_prefills`); per trajectory (PReCache's), each policy alone over a whole trajectory
(`time_trajectory`, on `run_trajectory`).
"""

from __future__ import annotations

from kvprof.model.runtime import Runtime
from kvprof.policies import SharingPolicy, TurnRequest, TurnResult
from kvprof.replay.branches import BranchingTimeline, plan_of
from kvprof.results.replay import TimedRuns, WarmUp
from kvprof.traces.reuse import message_boundaries
from kvprof.traces.trace import Trajectory

TIMINGS = ("turn", "trajectory")
"""`replay_trace`'s timing modes: per-turn medians (kvprof) or PReCache's trajectory timing (code)."""


def interleaved_prefills(runs: list[SharingPolicy], request: TurnRequest, repeats: int) -> list[list[float] | None]:
    """With `repeats` > 1, each run's first `repeats` − 1 timed prefills of `request`, timed round-robin across
    `runs` after one untimed round; each run's `run_turn` times the last, in the same order. So a drift of the
    machine's speed during the turn reaches every run alike. Else None per run (each times its own)."""
    if repeats <= 1:
        return [None] * len(runs)
    timings: list[list[float]] = [[] for _ in runs]
    for round_index in range(repeats):
        for run, seconds in zip(runs, timings):
            measured = run.time_prefill(request)
            if round_index:
                seconds.append(measured)
    return list(timings)


def run_trajectory(runtime: Runtime, policies: list[SharingPolicy], traj: Trajectory) -> list[list[TurnResult]]:
    """Every turn of a served `traj` under `policies` in lockstep, once each, following its timeline; per turn,
    each policy's result."""
    timeline = BranchingTimeline(plan_of(traj, runtime.prefixes, runtime.span_matching), policies)
    results = []
    for index, turn in enumerate(traj.turns):
        start = timeline.begin(index)
        request = TurnRequest(
            turn.agent,
            traj.input_tokens(turn),
            traj.output_tokens(turn),
            moved=start.moved,
            boundaries=message_boundaries(traj, turn),
        )
        results.append([policy.run_turn(request) for policy in policies])
        shared_len = len(request.input_ids) - len(runtime.prefix(turn.agent))
        timeline.end(index, turn.agent, shared_len + len(request.output_ids or []))
    return results


def time_trajectory(policy: SharingPolicy, traj: Trajectory, repeats: int) -> list[tuple[WarmUp, TimedRuns]]:
    """Trajectory timing (PReCache's `bench/single_stream.py`): `policy` alone replays `traj` once untimed, then
    `repeats` times, each from an empty store. Per turn: `runs` (TTFT — the synced prefill call: a double-batched
    policy's two rows inside, a lazy prefill's adapter-free pass outside —, decode time, latency, CUDA allocator
    peak with the weights) and `warm_up`."""
    runs = []
    for _ in range(repeats + 1):
        policy.reset()
        runs.append([turn[0] for turn in run_trajectory(policy.runtime, [policy], traj)])
    policy.reset()
    warm_up, timed = runs[0], runs[1:]
    return [
        (
            WarmUp(ttft_s=warm_up[index].ttft_s, latency_s=warm_up[index].latency_s),
            TimedRuns(
                ttft_s=[run[index].ttft_s for run in timed],
                decode_s=[run[index].decode_s for run in timed],
                latency_s=[run[index].latency_s for run in timed],
                cuda_allocated_bytes=[run[index].cuda_allocated_bytes for run in timed],
            ),
        )
        for index in range(len(traj.turns))
    ]
