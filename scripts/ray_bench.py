"""Wall time of `kvprof replay --policy all` on demo trajectories: one process against `--ray` with N CPU workers.

    python scripts/ray_bench.py OUT_DIR [--tasks 10] [--workers 2] [--rounds 3]

Captures `--tasks` held-out demo tasks with the shared-A LoRA workflow (so every LoRA policy runs) into
OUT_DIR/capture, warms every path up once on one trajectory, then runs, alternately, `--rounds` times: the
single-process replay with one thread (as each Ray worker runs), the single-process replay with N threads (what one
process makes of the same cores), and the Ray replay. Every run is a fresh `kvprof` process; the Ray runs start
their own local instance (`--ray-address local`), so their wall time includes starting Ray and loading the model on
every worker. Prints each run, the medians, the speed-up of the Ray median over each single-process median and the
1-minute load average before each run (other processes on the machine slow every path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORLD = Path(__file__).resolve().parent.parent / "kvprof" / "demo" / "assets"


def kvprof(*args: str, threads: int = 1) -> float:
    """Run `kvprof ARGS` with `threads` threads; its wall time in seconds."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvprof", *args], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trace = args.out / "capture" / "trace.jsonl"
    if not trace.exists():
        kvprof(
            "capture",
            "--model",
            str(WORLD / "model"),
            "--workflow",
            str(WORLD / "workflow_lora_shared_a.toml"),
            "--tasks",
            str(WORLD / "tasks" / "heldout.jsonl"),
            "--limit",
            str(args.tasks),
            "--out",
            str(args.out / "capture"),
        )
    replay = ("replay", str(trace), "--policy", "all", "--device", "cpu")
    ray = ("--ray", "--ray-address", "local", "--ray-workers", str(args.workers))
    runs = {
        "1 process, 1 thread": (replay, 1),
        f"1 process, {args.workers} threads": (replay, args.workers),
        f"--ray, {args.workers} workers": (replay + ray, 1),
    }
    folders = dict(zip(runs, ("single", "threads", "ray")))
    for command, threads in runs.values():
        kvprof(*command, "--limit", "1", "--out", str(args.out / "warmup"), threads=threads)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name, (command, threads) in runs.items():
            load = os.getloadavg()[0]
            seconds = kvprof(*command, "--out", str(args.out / f"{folders[name]}{round_ + 1}"), threads=threads)
            times[name].append(seconds)
            print(f"round {round_ + 1} {name:>21}: {seconds:6.1f} s (load average before: {load:.2f})", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"median  {name:>21}: {median:6.1f} s")
    *singles, distributed = medians.items()
    for name, median in singles:
        print(f"speed-up of the Ray median over {name}: {median / distributed[1]:.2f}x on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
