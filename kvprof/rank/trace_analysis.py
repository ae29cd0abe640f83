"""Rank analysis of a trace file: read it, load the agents it was captured with, and analyse the chosen agents and
layers (the maths is `kvprof.rank.analysis`) into the result record `kvprof rank-analysis` writes.

Two steps, so that a caller can size a progress bar (and see refusals) before the long part: `prepare_rank_analysis`
reads, checks and loads; `run_rank_analysis` captures and compares the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet, load_agents_for_trace
from kvprof.model.architecture import decoder_layers
from kvprof.model.layers import layer_list
from kvprof.rank.analysis import analyze_trace, select_agents
from kvprof.rank.kv_capture import resolve_layers
from kvprof.results.rank_analysis import RankAnalysisResult, RankClaim
from kvprof.traces.trace import Trace, Trajectory, read_trace


@dataclass
class RankAnalysisSetup:
    """A trace ready to analyse: its file, its trajectories, the agents loaded for it, the names of the agents to
    compare and the layer indices to analyse."""

    trace_path: Path
    trace: Trace
    agents: AgentSet
    agent_names: list[str]
    layers: list[int]


def prepare_rank_analysis(
    trace_path: Path,
    model: str | None = None,
    agent_flags: list[str] | None = None,
    agent_names: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    limit: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> RankAnalysisSetup:
    """Read the first `limit` trajectories of the trace, check the `agent_names` to compare (default: all) and
    load the agents (`model` and `agent_flags` override the trace's); `layers`: indices, default all."""
    trace = read_trace(trace_path)
    if limit is not None:
        trace.trajectories = trace.trajectories[:limit]
    names = select_agents(trace, agent_names)
    agents = load_agents_for_trace(trace_path, model=model, agent_flags=agent_flags, device=device, dtype=dtype)
    chosen = resolve_layers(layers, len(decoder_layers(agents.base_model)))
    recurrent = agents.recurrent
    if layers is None:  # a hybrid's attention layers: its recurrent ones cache nothing per token
        chosen = [layer for layer in chosen if layer not in recurrent]
    elif asked := [layer for layer in chosen if layer in recurrent]:
        attending = [layer for layer in range(len(agents.layer_kinds)) if layer not in recurrent]
        raise KvprofError(
            f"layer {asked[0]} is a recurrent layer ({recurrent[asked[0]]}), which keeps a state and caches no K/V "
            f"per token to analyse; pass --layers among the attention layers ({layer_list(attending)})."
        )
    return RankAnalysisSetup(trace_path, trace, agents, names, chosen)


def run_rank_analysis(
    setup: RankAnalysisSetup,
    max_tokens: int | None = 2048,
    per_head: bool = False,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> RankAnalysisResult:
    """The rank-analysis result of `setup`: trace, model, seconds and `kvprof.rank.analysis.RankAnalysis.to_dict()`.

    max_tokens: at most this many first tokens per agent; per_head: one (tokens, D) matrix per KV head instead of
    one flattened (tokens, H_kv·D) matrix per layer; `on_trajectory` is called after each trajectory.
    """
    started = time.perf_counter()
    result = analyze_trace(
        setup.agents,
        setup.trace,
        setup.agent_names,
        setup.layers,
        max_tokens=max_tokens,
        per_head=per_head,
        on_trajectory=on_trajectory,
    )
    analysis = result.to_dict()
    return RankAnalysisResult(
        trace=str(setup.trace_path),
        model=setup.agents.model_name,
        layer_kinds=[kind.to_json() for kind in setup.agents.layer_kinds],
        seconds=round(time.perf_counter() - started, 3),
        **analysis | {"claims": [RankClaim(**claim) for claim in analysis["claims"]]},
    )
