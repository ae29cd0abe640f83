"""Check a `kvprof serve-bench` result on the demo lora trace against issue #34's acceptance (used by .ci/run):

- output agreement 100 % under `--pattern agents` (the agents' own adapters, float32: greedy outputs equal the
  recorded ones id for id);
- later turns of an agent report cached tokens (an agent reuses its own earlier prefix);
- `--pattern base` caches a larger share of prompt tokens than `--pattern agents` at every load;
- the server kvprof started is gone.

Usage: python scripts/serve_check.py RUN_DIR/serve_bench.json; prints one line per check, exits 1 if any fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def checks(result: dict) -> list[tuple[bool, str]]:
    """(passed, what) for each acceptance check on `result`."""
    summaries = [run["summary"] for run in result["runs"]]
    agents = {s["load"]["label"]: s for s in summaries if s["pattern"] == "agents"}
    base = {s["load"]["label"]: s for s in summaries if s["pattern"] == "base"}
    found: list[tuple[bool, str]] = [(bool(agents) and bool(base), "both patterns ran")]
    for label, summary in agents.items():
        agreement = summary["agreement"]
        found.append(
            (
                agreement["fraction"] == 1.0,
                f"agents @ {label}: output agreement {agreement['matching']}/{agreement['requests']}",
            )
        )
        later = summary["cache_by_turn"]["later_turns"]
        found.append(
            (
                later["with_cached_tokens"] > 0,
                f"agents @ {label}: {later['with_cached_tokens']} of {later['requests']} later turns of an agent "
                f"report cached tokens ({later['cached_tokens']} tokens)",
            )
        )
        if label in base:
            ours, shared = summary["prefix_hit_ratio"] or 0.0, base[label]["prefix_hit_ratio"] or 0.0
            what = f"{label}: base caches {100 * shared:.1f} % of prompt tokens, agents {100 * ours:.1f} %"
            found.append((shared > ours, what))
    pid = result["server"].get("pid")
    if result["server"]["started"]:
        gone = pid is not None and not Path(f"/proc/{pid}").exists()
        found.append((gone, f"the vLLM server kvprof started (pid {pid}) is gone"))
    return found


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    results = checks(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
    for passed, what in results:
        print(f"{'ok  ' if passed else 'FAIL'} {what}")
    sys.exit(0 if all(passed for passed, _ in results) else 1)


if __name__ == "__main__":
    main()
