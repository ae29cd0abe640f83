"""Import shape-only traces: CSV rows `agent,prefill_len,decode_len` (the form public efficiency benchmarks use).

Each row is one turn: `prefill_len` new input tokens appended to the shared context (segment `in:K`), then
`decode_len` output tokens (segment `out:AGENT:K`); the turn reads every shared segment before it, after the agent's
role prompt (a private segment `prompt:AGENT`) when the agents of a prompt-mode workflow are given. An optional
fourth column `trajectory` splits rows into several trajectories. Tokens are synthesised deterministically from the
seed, drawn from the tokenizer's ordinary (non-special) ids.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from kvprof.errors import KvprofError
from kvprof.fileio import read_text_file
from kvprof.traces.spec import AgentSpec, WorkflowSpec
from kvprof.traces.trace import Segment, Trace, TraceHeader, Trajectory, Turn

COLUMNS = ("agent", "prefill_len", "decode_len")


def read_shape_rows(path: str | Path) -> list[tuple[str, str, int, int]]:
    """Rows as (trajectory, agent, prefill_len, decode_len); refuses bad rows naming file and line."""
    path = Path(path)
    text = read_text_file(path, "shape CSV", "pass a CSV with columns agent,prefill_len,decode_len")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if reader.fieldnames is None or not set(COLUMNS) <= {name.strip() for name in reader.fieldnames}:
            raise KvprofError(
                f"shape CSV {path} needs the header agent,prefill_len,decode_len "
                f"(found {reader.fieldnames}); add that header line."
            )
        rows = [_shape_row(path, reader.line_num, row) for row in reader]
    except csv.Error as err:
        raise KvprofError(f"shape CSV {path} line {reader.line_num} is not CSV ({err}); fix that line.") from None
    if not rows:
        raise KvprofError(f"shape CSV {path} has no rows; add agent,prefill_len,decode_len lines.")
    return rows


def _shape_row(path: Path, line: int, row: dict) -> tuple[str, str, int, int]:
    """One row of a shape CSV as (trajectory, agent, prefill_len, decode_len), refused naming its line."""
    row = {key.strip(): (value or "").strip() for key, value in row.items() if isinstance(key, str)}
    try:
        prefill, decode = int(row["prefill_len"]), int(row["decode_len"])
    except ValueError:
        raise KvprofError(
            f"shape CSV {path} line {line}: prefill_len and decode_len must be integers "
            f"(got {row['prefill_len']!r}, {row['decode_len']!r}); fix that line."
        ) from None
    if prefill < 0 or decode < 1 or not row["agent"]:
        raise KvprofError(
            f"shape CSV {path} line {line}: needs an agent name, prefill_len ≥ 0 and decode_len ≥ 1; fix that line."
        )
    return row.get("trajectory") or "shape0", row["agent"], prefill, decode


def import_shape_csv(
    path: str | Path,
    tokenizer,
    identity: dict,
    model_name: str,
    seed: int = 0,
    mode: str = "lora",
    spec: WorkflowSpec | None = None,
) -> Trace:
    """Build a trace from a shape CSV (see module docstring). Its header declares the CSV's agents by name, in
    `mode`; with `spec` (the agents' workflow: adapters or role prompts), it records that workflow instead, as a
    capture does, so that replay finds the agents' adapters; every agent of the CSV must then be one of its agents."""
    rows = read_shape_rows(path)
    if spec is not None:
        unknown = sorted({agent for _, agent, _, _ in rows} - set(spec.names))
        if unknown:
            raise KvprofError(
                f"shape CSV {path} has turns of agent {', '.join(map(repr, unknown))}, which the workflow does not "
                f"define (its agents: {', '.join(spec.names)}); rename them in the CSV or add them to the workflow."
            )
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    generator = torch.Generator().manual_seed(seed)
    trajectories: dict[str, Trajectory] = {}
    agents: list[str] = []
    for traj_id, agent, prefill, decode in rows:
        if agent not in agents:
            agents.append(agent)
        traj = trajectories.setdefault(traj_id, Trajectory(id=traj_id, segments={}, turns=[]))
        index = len(traj.turns)
        inputs = [seg_id for seg_id, seg in traj.segments.items() if seg.scope == "shared"]  # in creation order
        if prefill:
            seg_id = f"in:{index}"
            traj.segments[seg_id] = _synthetic(ordinary, prefill, generator, tokenizer, "synthetic")
            inputs.append(seg_id)
        if not inputs:
            raise KvprofError(
                f"shape CSV {path}: the first turn of trajectory {traj_id!r} has prefill_len 0, so it "
                "would read nothing; give it a positive prefill_len."
            )
        if spec is not None and spec.mode == "prompt":
            inputs.insert(0, _role_prompt(traj, spec.agent(agent), tokenizer))
        output = f"out:{agent}:{index}"
        traj.segments[output] = _synthetic(ordinary, decode, generator, tokenizer, "output", producer=agent)
        traj.turns.append(Turn(agent=agent, input=inputs, output=output))
    header = TraceHeader(
        model={"path": model_name},
        tokenizer=identity,
        source=f"shape-csv:{Path(path).name}",
        workflow=spec.to_dict() if spec is not None else {"mode": mode, "agents": [{"name": name} for name in agents]},
    )
    return Trace(header=header, trajectories=list(trajectories.values()))


def _role_prompt(traj: Trajectory, agent: AgentSpec, tokenizer) -> str:
    """The id of `agent`'s role prompt segment in `traj`, added on its first turn as a capture lays it out."""
    seg_id = f"prompt:{agent.name}"
    if seg_id not in traj.segments:
        # A prompt-mode spec gives every agent a role prompt (`kvprof.traces.spec` refuses one that does not).
        assert agent.prompt is not None, f"prompt-mode agent {agent.name!r} has no role prompt"
        tokens = tokenizer.encode(agent.prompt, add_special_tokens=False)
        traj.segments[seg_id] = Segment(kind="prompt", scope="private", tokens=tokens, text=agent.prompt)
    return seg_id


def _synthetic(
    ordinary: torch.Tensor, length: int, generator: torch.Generator, tokenizer, kind: str, producer: str | None = None
) -> Segment:
    tokens = ordinary[torch.randint(len(ordinary), (length,), generator=generator)].tolist()
    return Segment(kind=kind, scope="shared", tokens=tokens, text=tokenizer.decode(tokens), producer=producer)
