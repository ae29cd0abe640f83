"""A replay timed alone and beside a CPU-bound process: what contention does to its times, and whether it says so.

    python scripts/contention_check.py OUT_DIR [TRACE]

TRACE defaults to the demo world's `lora_short` sample trace. Three `kvprof replay --policy fullshared` processes,
each on the trace's first trajectory with 3 timed repeats per turn: alone with one torch thread per core; beside a
busy-looping Python process with as many (torch's own default); beside it with kvprof's default threads (the cores
free). Prints, per run, the dense run's TTFT (summed over turns), the threads, other processes' load while it timed
and whether the replay called its timing contended; writes OUT_DIR/contention.json. Run it on a quiet machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUSY_LOOP = "while True: pass"


def replay(trace: str, out: Path, threads: list[str]) -> dict:
    """One `kvprof replay` process: its dense TTFT, threads and the load it recorded while timing."""
    command = [sys.executable, "-c", "from kvprof.cli import main; main()", "replay", trace, "--out", str(out)]
    command += ["--policy", "fullshared", "--limit", "1", "--repeats", "3", "--device", "cpu", *threads]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"kvprof replay failed: {(run.stderr.strip() or run.stdout).splitlines()[-1]}")
    result = json.loads((out / "replay.json").read_text())
    return {
        "dense_ttft_s": result["dense"]["summary"]["ttft_s"],
        "threads": result["environment"]["threads_chosen"],
        "load": result["timing"]["load"],
        "warned": "WARNING: CONTENDED" in run.stdout,
    }


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from kvprof.demo.assets import demo_world

    trace = sys.argv[2] if len(sys.argv) > 2 else str(demo_world().sample_traces["lora_short"])
    every_core = ["--threads", str(len(os.sched_getaffinity(0)))]
    runs = {"alone, a thread per core": replay(trace, out / "alone", every_core)}
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        runs["beside a busy process, a thread per core"] = replay(trace, out / "busy_every_core", every_core)
        runs["beside a busy process, kvprof's default"] = replay(trace, out / "busy_default", [])
    finally:
        busy.kill()
        busy.wait()
    for label, run in runs.items():
        load = run["load"]
        print(
            f"{label:42s} dense TTFT {run['dense_ttft_s']:7.3f} s  {run['threads']}; other processes "
            f"{load['other_cores']:.2f} of {load['cores']} cores; contended: {load['contended']} "
            f"(warned: {run['warned']})"
        )
    (out / "contention.json").write_text(json.dumps({"trace": trace, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
