"""The replay's own cost: wall time of one `kvprof replay --policy all` against the sum of one run per variant.

    python scripts/replay_cost.py OUT_DIR [TRACE] [kvprof replay options...]

TRACE defaults to the demo world's `lora_short` sample trace. Every run is a fresh `kvprof replay` process, as a user
runs it (start-up and model loading included). The lockstep replay runs the dense (NonShared) pass once for all
variants; one run per variant repeats it each time. Prints one row per run and the ratio; writes OUT_DIR/cost.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def replay(trace: str, out: Path, flags: list[str], extra: list[str]) -> float:
    """Wall seconds of one `kvprof replay` process."""
    command = [sys.executable, "-c", "from kvprof.cli import main; main()", "replay", trace, "--out", str(out)]
    started = time.perf_counter()
    run = subprocess.run(command + flags + extra, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if run.returncode:
        last = (run.stderr.strip() or run.stdout).splitlines()[-1]
        sys.exit(f"kvprof replay {' '.join(flags + extra)} failed: {last}")
    return seconds


def variant_flags(entry: dict) -> list[str]:
    """The --policy / --policy-option flags that replay exactly one recorded variant."""
    flags = ["--policy", entry["name"]]
    for key, value in entry["options"].items():
        flags += ["--policy-option", f"{entry['name']}.{key}={value}"]
    return flags


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from kvprof.demo.assets import demo_world

    trace = sys.argv[2] if len(sys.argv) > 2 else str(demo_world().sample_traces["lora_short"])
    extra = sys.argv[3:]
    together = replay(trace, out / "all", ["--policy", "all"], extra)
    entries = json.loads((out / "all" / "replay.json").read_text())["policies"]
    single = {label: replay(trace, out / label, variant_flags(entry), extra) for label, entry in entries.items()}
    for label, seconds in single.items():
        print(f"{label:28s} {seconds:8.1f} s")
    total = sum(single.values())
    print(f"{'sum of single-variant runs':28s} {total:8.1f} s")
    print(f"{'--policy all (lockstep)':28s} {together:8.1f} s   ({total / together:.2f}× less wall time)")
    result = {"trace": trace, "policy_all_s": together, "single_variant_s": single, "sum_single_s": total}
    (out / "cost.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
