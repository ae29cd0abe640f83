"""Time one turn's prefill under the low-rank policies with their views expanded by the fused CPU kernel and by
torch, interleaved in one process (`kvprof.kernels.expansion`; KVPROF_NATIVE switches it):

    python scripts/expansion_bench.py TRACE [--turn N] [--policy NAME ...] [--repeats R]

Each policy replays the trajectory's turns before turn N (default: the last) once, then every round times one
prefill of turn N per policy and path, after a warm-up round; prints the medians and torch ÷ kernel. FullShared, which
expands nothing, is timed beside them for scale. Used for docs/benchmarks.md (the ReAct shape's capture from
scripts/react_bench.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics

from kvprof.kernels.expansion import native_library
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, TurnRequest
from kvprof.traces.trace import read_trace


def use_kernel(on: bool) -> None:
    os.environ["KVPROF_NATIVE"] = "1" if on else "0"
    native_library.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--turn", type=int, default=-1)
    parser.add_argument("--policy", action="append", default=None)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    use_kernel(True)
    if native_library() is None:
        raise SystemExit("the fused kernel does not build here (no C compiler?): nothing to compare")
    agents = load_agents_for_trace(args.trace, device="cpu", dtype="float32")
    trajectory = read_trace(args.trace).trajectories[0]
    requests = [TurnRequest(t.agent, trajectory.input_tokens(t), trajectory.output_tokens(t)) for t in trajectory.turns]
    turn = args.turn % len(requests)
    names = args.policy or ["prelrshared", "baselrshared", "rebaseshared"]
    policies = {name: PolicyVariant(name, {}).build(Runtime(agents)) for name in ["fullshared", *names]}
    for policy in policies.values():
        for request in requests[:turn]:
            policy.run_turn(request)
    paths = {"kernel": True, "torch": False}
    times: dict[tuple[str, str], list[float]] = {(name, path): [] for name in policies for path in paths}
    for round_index in range(args.repeats + 1):
        for path, on in paths.items():
            use_kernel(on)
            for name, policy in policies.items():
                seconds = policy.time_prefill(requests[turn])
                if round_index:
                    times[(name, path)].append(seconds)
    use_kernel(True)
    request = requests[turn]
    print(f"turn {turn}: {len(request.input_ids)} input tokens, agent {request.agent}; medians of {args.repeats}")
    print(f"{'policy':<16} {'kernel ms':>10} {'torch ms':>10} {'torch ÷ kernel':>15}")
    for name in policies:
        kernel = statistics.median(times[(name, "kernel")]) * 1e3
        torch_ms = statistics.median(times[(name, "torch")]) * 1e3
        print(f"{name:<16} {kernel:>10.2f} {torch_ms:>10.2f} {torch_ms / kernel:>15.2f}")


if __name__ == "__main__":
    main()
