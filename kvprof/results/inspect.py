"""`kvprof inspect --out`'s result (inspect.json): what each turn could reuse and how replay would follow it.

Kept as JSON: reuse counts (`total`, each trajectory's `summary`), the replay plan's counts (`replay`), per-turn
records, the span-matching setting and layer kinds; on a hybrid model, checkpointed prefix reuse (`checkpoints`:
`InspectCheckpoints`; each trajectory's totals and each turn's hits per rule), which files of non-hybrid models and
older files lack.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import OPTIONAL, Record, ResultFile, json_field, record_reader, records_by_label

FIX = "pass the inspect.json a `kvprof inspect --out` run wrote, unchanged (or rerun `kvprof inspect`)"


@dataclasses.dataclass(kw_only=True)
class InspectedTrajectory(Record):
    """One trajectory's reuse counts (summed over its turns) and per-turn records (on a hybrid, each turn's
    `checkpoints`: rule → [per agent, shared] input ids served); on a hybrid, `checkpoints`: rule → its
    `engine_own` and `engine_shared` totals."""

    summary: dict = json_field(dict)
    turns: list[dict] = json_field(list)
    checkpoints: dict | None = json_field(dict, absent=True)


@dataclasses.dataclass(kw_only=True)
class CheckpointTotals(Record):
    """One checkpoint rule (`kvprof.traces.checkpoints`) over the trace: its `interval` (vllm: B; sglang: the track
    interval; boundaries: 0) and the input ids served, each agent from its own cache (`engine_own`) and from one
    cache for all (`engine_shared`)."""

    rule: str = json_field(str)
    interval: int = json_field(int)
    engine_own: int = json_field(int)
    engine_shared: int = json_field(int)


@dataclasses.dataclass(kw_only=True)
class InspectCheckpoints(Record):
    """Checkpointed prefix reuse on a hybrid model: one recurrent layer's state (`state_bytes`) and one attention
    layer's K/V per token (`token_bytes`), vLLM's hybrid block `block_size` derived from them, the most ids a
    prefill step computes (`prefill_chunk`, 0: no limit), the most states kept (`state_capacity`, None: no limit),
    vLLM's retention interval (`retention`: "0", "dense" or a number; absent in files written before it) and the
    kernel block B is aligned to (`kernel_block`), and each rule's totals by name."""

    state_bytes: int = json_field(int)
    token_bytes: int = json_field(int)
    block_size: int = json_field(int)
    prefill_chunk: int = json_field(int)
    state_capacity: int | None = json_field((int, OPTIONAL))
    retention: str | None = json_field(str, absent=True)
    kernel_block: int | None = json_field(int, absent=True)
    rules: dict[str, CheckpointTotals] = json_field(dict, read=records_by_label(CheckpointTotals))


@dataclasses.dataclass(kw_only=True)
class InspectResult(ResultFile):
    """An inspected trace: path, mode, prefix-cache block, span matching, layer kinds (None without --model), whole
    trace's reuse counts, replay plan counts, trajectories by id; checkpointed prefix reuse on a hybrid model."""

    KIND = "inspect"
    FIX = FIX

    trace: str = json_field(str)
    mode: str = json_field(str)
    block_size: int = json_field(int)
    span_matching: dict = json_field(dict)
    layers: list[dict] | None = json_field((list, OPTIONAL))
    total: dict = json_field(dict)
    replay: dict = json_field(dict)
    trajectories: dict[str, InspectedTrajectory] = json_field(dict, read=records_by_label(InspectedTrajectory))
    checkpoints: InspectCheckpoints | None = json_field(dict, read=record_reader(InspectCheckpoints), absent=True)
