"""A `kvprof replay` result as serving work: one request per replayed turn, per policy.

What a request carries (all from the policy's per-turn record, `policies[label]["turns"][i]`):

- `prefill_tokens`: tokens the policy pushes through the backbone in the TTFT phase (`prefilled`: chunks, LR
  prefills, recomputed (token, layer) entries ÷ layers), at least 1 (an engine always computes the last prompt token);
- `prefill_weight`: the TTFT phase's analytic FLOPs over those of the dense run's same turn, per dense prefill token:
  a policy whose correction, reference encoding or second batch row costs FLOPs beyond its prefilled tokens weighs
  more per scheduled token (the step-cost model counts `prefill_tokens × prefill_weight` dense-token equivalents);
- `context_tokens`: the turn's input tokens (the K/V its prefill attends to and decoding starts from);
- `decode_steps`: output tokens (the prefill step samples the first, each decode step one more);
- `decode_weight`: FLOPs per decode step ((flops − ttft_flops) / decode_steps: decode rows, DB's second row,
  ReBaseShared-LP's adapter-free pass after decoding spread over the steps) over the dense run's same turn;
- `working_bytes` / `kept_bytes`: the policy's peak analytic bytes during the turn and the bytes it keeps after it
  (caches, LR caches, anchor pools, stored hidden states); a trajectory holds `kept_bytes` until its next turn and
  frees it when it ends.

An engine's prefix cache holds whole blocks (vLLM: 16 tokens on GPU, 128 on its CPU backend), so it recomputes the
tail of a reused prefix that does not fill a block: `at_block_granularity` rounds every turn's reused tokens
(input − prefilled) down to a multiple of the block, the rest prefilled densely — exact for a prefix (NonShared's
own history, FullShared's and the LoRA policies' base cache), an approximation for reused segments (delta and
selective policies), whose engines would page them too.

`--shapes` scales every turn's input-side work linearly (prefilled tokens, context, FLOPs as weights per token stay,
bytes) so that the trajectories' final contexts reach the papers' shared-context length; output lengths stay.
Attention's quadratic growth and the papers' agent counts are not modelled by that scaling.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import NUMBER, JsonType, check_fields, is_json
from kvprof.results.replay import ReplayResult

TURN_FIELDS = ("agent", "trajectory", "turn", "input_tokens", "output_tokens", "prefilled", "ttft_flops", "flops")
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
    """Every policy's trajectories from one replay and the constants of the replayed model: dense FLOPs per
    prefill token and per decode step (means over the dense run), KV bytes per token (the dense run's first turns:
    stored bytes ÷ tokens), bytes per weight (the replay's dtype), and `params` (≈ dense decode FLOPs per step ÷ 2,
    the 2·N FLOPs a token costs), `scale` the linear factor applied by `--shapes` (1: none)."""

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
TURN_TYPES: dict[str, JsonType] = {
    "agent": str,
    "trajectory": str,
    "turn": int,
    "input_tokens": int,
    "output_tokens": int,
    "prefilled": NUMBER,
    "ttft_flops": NUMBER,
    "flops": NUMBER,
    "decode_steps": (int, type(None)),
    "memory_bytes": (int, float, type(None)),
    "working_peak_bytes": (int, float, type(None)),
}
DENSE_TURN_TYPES: dict[str, JsonType] = TURN_TYPES | {"ttft_s": NUMBER, "decode_s": NUMBER}


def load_replay(path: Path) -> ReplayWork:
    """Read a `kvprof replay` result (`read_replay_result`) as serving work."""
    return replay_work(read_replay_result(path), path)


def read_replay_result(path: Path) -> ReplayResult:
    """A `kvprof replay` result with everything simulate reads from it checked: the dense run's and every
    policy's per-turn records; a file that is not one is refused with a sentence naming it."""
    result = ReplayResult.read(path)
    if not result.dense.turns or not result.policies:
        raise KvprofError(
            f"{path} holds no per-turn records of a dense run and policies; rerun `kvprof replay` with this kvprof."
        )
    _check_turns(path, "dense run", result.dense.turns, DENSE_TURN_TYPES)
    for label, run in result.policies.items():
        _check_turns(path, f"policy {label!r}", run.turns, TURN_TYPES)
    if not any(t["turn"] == 0 and t.get("memory_bytes") for t in result.dense.turns):
        raise KvprofError(f"{path}: the dense run records no memory of a first turn; {REPLAY_FIX}.")
    return result


def read_replay(path: Path) -> dict:
    """`read_replay_result` as the JSON `kvprof simulate` reads it (it passes that to `replay_work`,
    `kvprof.simulate.cost.replay_observations` and `kvprof.simulate.sweep.replay_errors`)."""
    return read_replay_result(path).to_json()


def _check_turns(path: Path, where: str, turns: list, types: dict[str, JsonType]) -> None:
    """Refuse a per-turn record that lacks a field simulate reads, has one of another type, or a negative count."""
    for index, turn in enumerate(turns):
        record = f"{path}, {where} turn record {index}"
        check_fields(turn, types, record, REPLAY_FIX)
        negative = next((key for key in types if is_json(turn.get(key), NUMBER) and turn[key] < 0), None)
        if negative is not None:
            raise KvprofError(f"{record}: {negative} is negative; {REPLAY_FIX}.")
        if turn["input_tokens"] + turn["output_tokens"] < 1:
            raise KvprofError(f"{record} has no input or output tokens; {REPLAY_FIX}.")


def replay_work(result: ReplayResult | dict, path: Path) -> ReplayWork:
    """The work of every policy of a replay `result` (read from `path`; its JSON, as `kvprof simulate` passes
    it, is read as a `ReplayResult` first)."""
    if isinstance(result, dict):
        result = ReplayResult.from_json(result, str(path), REPLAY_FIX)
    dense_turns = result.dense.turns
    policies = result.policies
    if not dense_turns or not policies or any(field not in dense_turns[0] for field in TURN_FIELDS):
        raise KvprofError(
            f"{path} holds no per-turn records of a dense run and policies; rerun `kvprof replay` with this kvprof."
        )
    dense = {(t["trajectory"], t["turn"]): t for t in dense_turns}
    prefill_per_token = sum(t["ttft_flops"] for t in dense_turns) / max(1, sum(t["prefilled"] for t in dense_turns))
    decode_per_step = sum(t["flops"] - t["ttft_flops"] for t in dense_turns) / max(
        1, sum(_steps(t) for t in dense_turns)
    )
    firsts = [t for t in dense_turns if t["turn"] == 0 and t.get("memory_bytes")]
    kv_per_token = statistics.median(t["memory_bytes"] / (t["input_tokens"] + t["output_tokens"]) for t in firsts)
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


def _steps(turn: dict) -> int:
    return int(turn.get("decode_steps") or turn["output_tokens"])


def _trajectories(turns: list[dict], dense: dict, label: str, path: Path, adapter: bool) -> tuple[TrajectoryWork, ...]:
    """A policy's turns grouped by trajectory, in turn order, each compared with the dense run's same turn;
    `adapter`: the turns run LoRA adapters."""
    grouped: dict[str, list[RequestWork]] = {}
    for turn in sorted(turns, key=lambda t: (t["trajectory"], t["turn"])):
        reference = dense.get((turn["trajectory"], turn["turn"]))
        if reference is None:
            raise KvprofError(
                f"{path}: policy {label} replayed turn {turn['turn']} of {turn['trajectory']}, which the dense run "
                "did not; rerun `kvprof replay` on one trace."
            )
        grouped.setdefault(turn["trajectory"], []).append(_request(turn, reference, adapter))
    return tuple(TrajectoryWork(traj, tuple(requests)) for traj, requests in grouped.items())


def _request(turn: dict, dense: dict, adapter: bool) -> RequestWork:
    prefilled = max(1, int(turn["prefilled"]))
    dense_ttft = dense["ttft_flops"] / max(1, dense["prefilled"])  # dense FLOPs per prefilled token of this turn
    steps, dense_steps = _steps(turn), _steps(dense)
    decode_flops = (turn["flops"] - turn["ttft_flops"]) / steps if steps else 0.0
    dense_decode = (dense["flops"] - dense["ttft_flops"]) / dense_steps if dense_steps else 0.0
    memory = int(turn.get("memory_bytes") or 0)
    return RequestWork(
        agent=turn["agent"],
        prefill_tokens=prefilled,
        prefill_weight=turn["ttft_flops"] / (prefilled * dense_ttft) if dense_ttft else 1.0,
        context_tokens=int(turn["input_tokens"]),
        decode_steps=int(turn["output_tokens"]),
        decode_weight=decode_flops / dense_decode if dense_decode and decode_flops else 1.0,
        working_bytes=max(memory, int(turn.get("working_peak_bytes") or 0)),
        kept_bytes=memory,
        input_tokens=int(turn["input_tokens"]),
        output_tokens=int(turn["output_tokens"]),
        adapter=adapter,
    )


def without_adapters(trajectories: tuple[TrajectoryWork, ...]) -> tuple[TrajectoryWork, ...]:
    """The same work run with no adapter (serve-bench's `base` pattern serves the base model)."""
    return tuple(
        TrajectoryWork(traj.id, tuple(replace(request, adapter=False) for request in traj.requests))
        for traj in trajectories
    )


def at_block_granularity(trajectories: tuple[TrajectoryWork, ...], block: int) -> tuple[TrajectoryWork, ...]:
    """The same work on an engine whose prefix cache holds whole blocks of `block` tokens: each turn's reused
    tokens (input − prefilled, when positive) rounded down to a multiple of `block`, the remainder prefilled as dense
    tokens (weight 1, so the turn's `prefill_weight` becomes the mean over its old and added tokens)."""
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
    """The mean input length of the trajectories' last turns in the dense-equivalent sense: the shared context a
    trajectory reaches (tokens), over the first policy's trajectories."""
    trajectories = next(iter(work.policies.values()))
    return statistics.mean(traj.requests[-1].input_tokens for traj in trajectories)


def scale_to_shapes(work: ReplayWork, target_tokens: int) -> ReplayWork:
    """`work` with every turn's input-side work multiplied by one factor (prefilled and context tokens, bytes kept
    and at peak), so that the trajectories' last turns read `target_tokens` on average: scaled linearly."""
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
