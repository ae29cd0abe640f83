"""A `kvprof replay` result as serving work: one request per replayed turn, per policy (docs/commands/simulate.md).

Fields (from the policy's per-turn record):

- `prefill_tokens`: the TTFT phase's backbone tokens (`prefilled`: chunks, LR prefills, recomputed entries ÷
  layers), at least 1;
- `prefill_weight`: the TTFT phase's FLOPs over the dense turn's, per dense prefill token (corrections, reference
  encodings, a second row weigh more);
- `context_tokens`: the turn's input; `decode_steps`: output tokens;
- `decode_weight`: FLOPs per decode step ((flops − ttft_flops) / decode_steps, e.g. DB's second row, LP's
  adapter-free pass) over the dense turn's;
- `working_bytes` / `kept_bytes`: peak during the turn / kept after it until the trajectory ends.

`at_block_granularity`: reused tokens rounded down to whole blocks (exact for prefixes, an approximation for reused
segments). `--shapes` scales input-side work linearly (not attention's quadratic growth, nor agent counts).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.results.replay import ReplayResult, TurnRecord

DENSE_LABEL = "nonshared"  # a replay's dense run is NonShared; simulated under this label when not replayed as a policy
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RequestWork:
    """One turn as a request (see the module docstring); tokens are counts, bytes are bytes."""

    agent: str
    prefill_tokens: int
    prefill_weight: float
    context_tokens: int
    decode_steps: int
    decode_weight: float
    working_bytes: int
    kept_bytes: int
    input_tokens: int
    output_tokens: int
    adapter: bool = False  # the turn runs a LoRA adapter (lora-mode traces)


@dataclass(frozen=True)
class TrajectoryWork:
    """A trajectory's requests, sent in order: the next when the previous one has finished."""

    id: str
    requests: tuple[RequestWork, ...]


@dataclass(frozen=True)
class ReplayWork:
    """Every policy's trajectories of one replay and the model's constants: dense FLOPs per prefill token and decode
    step (dense-run means), KV bytes per token (first turns: stored ÷ tokens), bytes per weight, `params` (≈ decode
    FLOPs ÷ 2), `scale` (the `--shapes` factor, 1: none)."""

    path: Path
    policies: dict[str, tuple[TrajectoryWork, ...]]
    prefill_flops_per_token: float
    decode_flops_per_step: float
    kv_bytes_per_token: float
    dtype_bytes: int
    params: float
    scale: float = 1.0

    def weight_bytes(self) -> float:
        """Bytes of the model's weights (params × bytes per weight)."""
        return self.params * self.dtype_bytes


REPLAY_FIX = "pass the replay.json `kvprof replay --policy all` wrote"
# The per-turn counts simulate reads, refused when negative.
SIMULATED = (
    "turn", "input_tokens", "output_tokens", "prefilled", "ttft_flops", "flops", "decode_steps", "memory_bytes",
    "working_peak_bytes",
)  # fmt: skip
TIMINGS = ("ttft_s", "decode_s")  # the dense run's, which the cost model fits


def load_replay(path: Path) -> ReplayWork:
    """Read a `kvprof replay` result (`read_replay_result`) as serving work."""
    return replay_work(read_replay_result(path), path)


def read_replay_result(path: Path) -> ReplayResult:
    """A `kvprof replay` result with every per-turn field simulate reads checked (`TurnRecord`'s required fields, the
    dense run's timings, no negative count); otherwise refused naming the file."""
    result = ReplayResult.read(path)
    if not result.dense.turns or not result.policies:
        raise KvprofError(
            f"{path} holds no per-turn records of a dense run and policies; rerun `kvprof replay` with this kvprof."
        )
    _check_turns(path, "dense run", result.dense.turns, timed=True)
    for label, run in result.policies.items():
        _check_turns(path, f"policy {label!r}", run.turns)
    if not any(t.turn == 0 and t.memory_bytes for t in result.dense.turns):
        raise KvprofError(f"{path}: the dense run records no memory of a first turn; {REPLAY_FIX}.")
    return result


def read_replay(path: Path) -> dict:
    """`read_replay_result` as JSON (passed to `replay_work`, `replay_observations`, `replay_errors`)."""
    return read_replay_result(path).to_json()


def _check_turns(path: Path, where: str, turns: list[TurnRecord], timed: bool = False) -> None:
    """Refuse a per-turn record that lacks the timings simulate fits (`timed`: the dense run's) or holds a negative
    count (`TurnRecord` checked the fields' types)."""
    for index, turn in enumerate(turns):
        record = f"{path}, {where} turn record {index}"
        for name in TIMINGS if timed else ():
            if getattr(turn, name) is None:
                raise KvprofError(f"{record} has no field '{name}'; {REPLAY_FIX}.")
        read = {name: getattr(turn, name) for name in SIMULATED + (TIMINGS if timed else ())}
        negative = next((name for name, value in read.items() if value is not None and value < 0), None)
        if negative is not None:
            raise KvprofError(f"{record}: {negative} is negative; {REPLAY_FIX}.")
        if turn.input_tokens + turn.output_tokens < 1:
            raise KvprofError(f"{record} has no input or output tokens; {REPLAY_FIX}.")


def replay_work(result: ReplayResult | dict, path: Path) -> ReplayWork:
    """The work of every policy of a replay `result` (read from `path`)."""
    if isinstance(result, dict):
        result = ReplayResult.from_json(result, str(path), REPLAY_FIX)
    dense_turns = result.dense.turns
    policies = result.policies
    if not dense_turns or not policies:
        raise KvprofError(
            f"{path} holds no per-turn records of a dense run and policies; rerun `kvprof replay` with this kvprof."
        )
    dense = {(t.trajectory, t.turn): t for t in dense_turns}
    prefill_per_token = sum(t.ttft_flops for t in dense_turns) / max(1, sum(t.prefilled for t in dense_turns))
    decode_per_step = sum(t.flops - t.ttft_flops for t in dense_turns) / max(1, sum(t.steps for t in dense_turns))
    firsts = [t for t in dense_turns if t.turn == 0 and t.memory_bytes]
    kv_per_token = statistics.median((t.memory_bytes or 0) / (t.input_tokens + t.output_tokens) for t in firsts)
    lora = result.mode == "lora"
    work = {label: _trajectories(run.turns, dense, label, path, lora) for label, run in policies.items()}
    if DENSE_LABEL not in work:  # the dense run is NonShared's
        work[DENSE_LABEL] = _trajectories(dense_turns, dense, DENSE_LABEL, path, lora)
    return ReplayWork(
        path=path,
        policies=work,
        prefill_flops_per_token=prefill_per_token,
        decode_flops_per_step=decode_per_step,
        kv_bytes_per_token=kv_per_token,
        dtype_bytes=DTYPE_BYTES.get(str(result.dtype), 4),
        params=decode_per_step / 2,
    )


def _trajectories(
    turns: list[TurnRecord], dense: dict[tuple[str, int], TurnRecord], label: str, path: Path, adapter: bool
) -> tuple[TrajectoryWork, ...]:
    """A policy's turns by trajectory, each compared with the dense turn; `adapter`: the turns run adapters."""
    grouped: dict[str, list[RequestWork]] = {}
    for turn in sorted(turns, key=lambda t: (t.trajectory, t.turn)):
        reference = dense.get((turn.trajectory, turn.turn))
        if reference is None:
            raise KvprofError(
                f"{path}: policy {label} replayed turn {turn.turn} of {turn.trajectory}, which the dense run "
                "did not; rerun `kvprof replay` on one trace."
            )
        grouped.setdefault(turn.trajectory, []).append(_request(turn, reference, adapter))
    return tuple(TrajectoryWork(traj, tuple(requests)) for traj, requests in grouped.items())


def _request(turn: TurnRecord, dense: TurnRecord, adapter: bool) -> RequestWork:
    prefilled = max(1, int(turn.prefilled))
    dense_ttft = dense.ttft_flops / max(1, dense.prefilled)  # dense FLOPs per prefilled token of this turn
    steps, dense_steps = turn.steps, dense.steps
    decode_flops = (turn.flops - turn.ttft_flops) / steps if steps else 0.0
    dense_decode = (dense.flops - dense.ttft_flops) / dense_steps if dense_steps else 0.0
    memory = int(turn.memory_bytes or 0)
    return RequestWork(
        agent=turn.agent,
        prefill_tokens=prefilled,
        prefill_weight=turn.ttft_flops / (prefilled * dense_ttft) if dense_ttft else 1.0,
        context_tokens=int(turn.input_tokens),
        decode_steps=int(turn.output_tokens),
        decode_weight=decode_flops / dense_decode if dense_decode and decode_flops else 1.0,
        working_bytes=max(memory, int(turn.working_peak_bytes or 0)),
        kept_bytes=memory,
        input_tokens=int(turn.input_tokens),
        output_tokens=int(turn.output_tokens),
        adapter=adapter,
    )


def without_adapters(trajectories: tuple[TrajectoryWork, ...]) -> tuple[TrajectoryWork, ...]:
    """The same work run with no adapter (serve-bench's `base` pattern serves the base model)."""
    return tuple(
        TrajectoryWork(traj.id, tuple(replace(request, adapter=False) for request in traj.requests))
        for traj in trajectories
    )


def at_block_granularity(trajectories: tuple[TrajectoryWork, ...], block: int) -> tuple[TrajectoryWork, ...]:
    """The work with reused tokens (input − prefilled, if positive) rounded down to whole `block`s, the rest prefilled
    densely (weight 1; `prefill_weight` becomes the mean over old and added tokens)."""
    if block <= 1:
        return trajectories

    def rounded(request: RequestWork) -> RequestWork:
        reused = request.input_tokens - request.prefill_tokens
        extra = reused % block if reused > 0 else 0
        if not extra:
            return request
        tokens = request.prefill_tokens + extra
        weight = (request.prefill_tokens * request.prefill_weight + extra) / tokens
        return replace(request, prefill_tokens=tokens, prefill_weight=weight)

    return tuple(TrajectoryWork(t.id, tuple(rounded(r) for r in t.requests)) for t in trajectories)


def shared_tokens(work: ReplayWork) -> float:
    """Mean input of the trajectories' last turns (dense-equivalent): the shared context reached (first policy)."""
    trajectories = next(iter(work.policies.values()))
    return statistics.mean(traj.requests[-1].input_tokens for traj in trajectories)


def scale_to_shapes(work: ReplayWork, target_tokens: int) -> ReplayWork:
    """`work` with input-side work (prefilled and context tokens, kept and peak bytes) scaled by one factor so the
    last turns read `target_tokens` on average."""
    factor = target_tokens / shared_tokens(work)

    def scaled(request: RequestWork) -> RequestWork:
        return replace(
            request,
            prefill_tokens=max(1, round(request.prefill_tokens * factor)),
            context_tokens=round(request.context_tokens * factor),
            input_tokens=round(request.input_tokens * factor),
            working_bytes=math.ceil(request.working_bytes * factor),
            kept_bytes=math.ceil(request.kept_bytes * factor),
        )

    policies = {
        label: tuple(TrajectoryWork(t.id, tuple(scaled(r) for r in t.requests)) for t in trajectories)
        for label, trajectories in work.policies.items()
    }
    return replace(work, policies=policies, scale=work.scale * factor)
