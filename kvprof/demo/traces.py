"""Sample traces of the demo world in both modes.

    python -m kvprof.demo.traces [--world DIR]

`{prompt,lora}_short`: the first SHORT_TASKS held-out tasks, captured with `kvprof capture` (the agents generate).
`{prompt,lora}_long`: the first long task (3 hops, paragraphs of ~130 distractor sentences: several thousand tokens
of shared context) with the gold outputs (source `demo-oracle` in the header): the demo model was trained on
paragraphs of at most 10 distractors and loses the thread in paragraphs ten times longer, so a captured long
trajectory stops after its first observation. Replay is teacher-forced, so the gold trace is what a long shared
context looks like to every policy. Paths in the headers (model, adapters) are relative to the traces' folder (see
`kvprof.model.load_agents_for_trace`), so the committed files do not name this machine's folders.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.demo.assets import ASSETS, DemoWorld
from kvprof.demo.world import read_tasks
from kvprof.fileio import write_json
from kvprof.trace import record_line

SHORT_TASKS = 4


def _relative_header(trace: Path, folder: Path) -> str:
    lines = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    header = json.loads(lines[0])
    header["model"]["path"] = Path(os.path.relpath(header["model"]["path"], folder)).as_posix()
    header["tokenizer"]["name"] = header["model"]["path"]
    for agent in header["workflow"]["agents"]:
        if agent.get("adapter"):
            agent["adapter"] = Path(os.path.relpath(agent["adapter"], folder)).as_posix()
    return record_line(header) + "".join(lines[1:])


def _gold_trace(world: DemoWorld, mode: str, tasks: list, out: Path) -> None:
    """OUT/trace.jsonl and OUT/capture.json (as `kvprof capture` writes them) for `tasks` with gold outputs."""
    from kvprof.commands.capture import trajectory_summary
    from kvprof.demo.data import oracle_trajectory
    from kvprof.model import load_tokenizer, tokenizer_identity
    from kvprof.spec import build_spec
    from kvprof.trace import Trace, TraceHeader, write_trace

    spec = build_spec(world.workflow(mode))
    tokenizer = load_tokenizer(str(world.model.resolve()))
    trajectories = [oracle_trajectory(spec, tokenizer, task) for task in tasks]
    header = TraceHeader(model={"path": str(world.model.resolve()), "dtype": "float32",
                                "architecture": "LlamaForCausalLM"},
                         tokenizer=tokenizer_identity(tokenizer), workflow=spec.to_dict(), source="demo-oracle")
    write_trace(out / "trace.jsonl", Trace(header, trajectories))
    write_json(out / "capture.json", {"summary": trajectory_summary(trajectories, 0.0)})


def build(world: DemoWorld, device: str = "cpu") -> dict[str, dict]:
    """Capture the four sample traces into WORLD/sample_traces; returns `name → {trajectories, tokens}`."""
    from kvprof.commands import capture

    root = world.root.resolve()
    stats = {}
    for mode in ("prompt", "lora"):
        for kind, tasks, limit in (("short", world.heldout_tasks, SHORT_TASKS), ("long", world.long_tasks, 1)):
            name = f"{mode}_{kind}"
            with tempfile.TemporaryDirectory() as tmp:
                if kind == "short":
                    capture.command(model=str(root / "model"), tasks=tasks, workflow=world.workflow(mode),
                                    limit=limit, out=Path(tmp), device=device, dtype="float32", seed=0)
                else:
                    _gold_trace(world, mode, read_tasks(tasks)[:limit], Path(tmp))
                summary = json.loads((Path(tmp) / "capture.json").read_text(encoding="utf-8"))["summary"]
                target = world.sample_traces[name]
                target.parent.mkdir(parents=True, exist_ok=True)
                text = _relative_header(Path(tmp) / "trace.jsonl", target.parent.resolve())
            target.write_text(text, encoding="utf-8")
            stats[name] = {"trajectories": summary["trajectories"], "tokens": summary["distinct_tokens"],
                           "shared_tokens": summary["shared_tokens"], "accuracy": summary["accuracy"]}
    return stats


def main(world_dir: Annotated[Optional[Path], typer.Option("--world", help="Demo world folder.")] = None) -> None:
    """Re-capture the sample traces of a demo world."""
    print(json.dumps(build(DemoWorld(world_dir or ASSETS)), indent=1))


if __name__ == "__main__":
    typer.run(main)
