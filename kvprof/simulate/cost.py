"""Step-time model t_step = a + b·prefill + c·decode_seqs + d·kv_read + f·adapter_tokens + g·adapter_step, plus e
once per request on its TTFT (docs/commands/simulate.md, "The step time").

- a: per step; b: per dense-equivalent prefill token (× `prefill_weight`); c: per decoding sequence (×
  `decode_weight`); d: per K/V token read; e: per request's TTFT (HTTP, tokenisation); f: per token of a request
  running an adapter; g: per step with any adapter token (vLLM's multi-LoRA kernels run for the whole step). f and g
  are identifiable only where timings mix adapter and adapter-free requests, else 0 (folded into a, b, c).

Sources (`StepCost.source`): an NNLS `fit` to serve-bench's request timings (TTFT and decode-step observations), the
same fit to a replay's dense single-sequence timings (c folded into a), or an uncalibrated roofline (`DEVICES`:
a = weight bytes ÷ bandwidth, b, c = dense FLOPs ÷ peak, d = KV bytes per token ÷ bandwidth, e = 0; compute and
memory time added, not overlapped).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import NUMBER, JsonType, check_fields, is_json
from kvprof.results.replay import ReplayResult, measured
from kvprof.results.serve_bench import ServeBenchResult, ServeRun
from kvprof.simulate.workload import ReplayWork

ROOFLINE = "roofline, uncalibrated"
COEFFICIENTS = ("a", "b", "c", "d", "e", "f", "g")
OPTIONAL = ("g", "f", "c")  # each fixed at 0, in this order, when the other features already span it
STEP_SPREAD = 0.0025  # seconds: a step's tokens reach the client within this of each other (vLLM streams them in turn)
COALESCED = 0.1  # a stream whose tokens after the first came faster than this × the run's median pace came in one burst


@dataclass(frozen=True)
class Device:
    """A device's dense bf16 peak (FLOP/s) and HBM bandwidth (bytes/s), from its vendor's data sheet."""

    name: str
    peak_flops: float
    bandwidth: float


DEVICES = {
    "a100": Device("NVIDIA A100 SXM 80GB", 312e12, 2.0e12),
    "h100": Device("NVIDIA H100 SXM", 989e12, 3.35e12),
    "h200": Device("NVIDIA H200 SXM", 989e12, 4.8e12),
}


@dataclass(frozen=True)
class StepCost:
    """The coefficients (seconds), their source, and when fitted the observations and R² per kind."""

    a: float
    b: float
    c: float
    d: float
    e: float
    source: str
    fit: dict = field(default_factory=dict)
    f: float = 0.0
    g: float = 0.0

    def step_time(
        self,
        prefill: float,
        decode_seqs: float,
        kv_read: float,
        adapter_tokens: float = 0.0,
    ) -> float:
        """Seconds of a step with `prefill` dense-equivalent tokens, `decode_seqs` weighted sequences, `kv_read` K/V
        tokens, `adapter_tokens` with an adapter (g charged if any)."""
        adapter_step = 1.0 if adapter_tokens > 0 else 0.0
        return (
            self.a
            + self.b * prefill
            + self.c * decode_seqs
            + self.d * kv_read
            + self.f * adapter_tokens
            + self.g * adapter_step
        )

    def describe(self) -> str:
        """One line: the source and the coefficients in readable units."""
        return (
            f"{self.source}: a = {1e3 * self.a:.3g} ms/step, b = {1e6 * self.b:.3g} µs/prefill token, "
            f"c = {1e6 * self.c:.3g} µs/decoding seq, d = {1e9 * self.d:.3g} ns/KV token read, "
            f"e = {1e3 * self.e:.3g} ms/request, f = {1e6 * self.f:.3g} µs/adapter token, "
            f"g = {1e3 * self.g:.3g} ms/step with adapters"
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Observation:
    """A measured interval of `seconds` over `steps` steps, with the summed features (`prefill`, `decode`, `kv_read`,
    `adapter_tokens`, `adapter_steps`); `requests`: TTFTs it holds (1 or 0); `kind`: "ttft" or "decode"."""

    kind: str
    seconds: float
    steps: float
    prefill: float
    decode: float
    kv_read: float
    requests: float
    adapter_tokens: float = 0.0
    adapter_steps: float = 0.0

    def features(self) -> list[float]:
        return [
            self.steps, self.prefill, self.decode, self.kv_read, self.requests, self.adapter_tokens,
            self.adapter_steps,
        ]  # fmt: skip


def fit(observations: list[Observation], source: str) -> StepCost:
    """NNLS of the observations' seconds on their features. A TTFT observation weighs its relative error (the fit
    follows the median request); a step observation its mean error per step relative to the mean step (the fit
    follows the mean step, hence throughput). Unidentifiable coefficients (`OPTIONAL`) are fixed at 0: c with
    single-sequence timings (into a), f and g when every request or none ran an adapter (into b and c)."""
    import numpy as np
    from scipy.optimize import nnls

    rows = [o for o in observations if o.seconds > 0]
    if len(rows) < len(COEFFICIENTS):
        raise KvprofError(
            f"{source} holds {len(rows)} usable timings, fewer than the {len(COEFFICIENTS)} coefficients of the step "
            "model; pass a result with more requests."
        )
    x = np.array([o.features() for o in rows], dtype=float)
    y = np.array([o.seconds for o in rows], dtype=float)
    steps = np.array([o.steps for o in rows], dtype=float)
    decoding = np.array([o.kind == "decode" for o in rows])
    per_step = (y[decoding] / steps[decoding]).mean() if decoding.any() else 1.0
    weights = np.where(decoding, 1.0 / (steps * per_step), 1.0 / y)
    columns = list(range(len(COEFFICIENTS)))
    notes = []
    reasons = {
        "g": "every request ran an adapter, or none did: the adapter costs f and g are not identifiable, folded "
        "into a, b and c",
        "c": "every step decoded one sequence: the per-sequence cost c is not identifiable, folded into a",
    }
    for name in OPTIONAL:
        rank = np.linalg.matrix_rank(x[:, columns] * weights[:, None])
        if rank == len(columns):
            break
        rest = [column for column in columns if column != COEFFICIENTS.index(name)]
        if np.linalg.matrix_rank(x[:, rest] * weights[:, None]) == rank:
            columns = rest
            if name in reasons:
                notes.append(reasons[name])
    solution, _ = nnls(x[:, columns] * weights[:, None], y * weights)
    coefficients = [0.0] * len(COEFFICIENTS)
    for column, value in zip(columns, solution):
        coefficients[column] = float(value)
    predicted = x @ np.array(coefficients)
    stats: dict = {"observations": len(rows), "notes": notes}
    for kind in ("ttft", "decode"):
        mask = np.array([o.kind == kind for o in rows])
        stats[f"r2_{kind}"] = _r2(y[mask], predicted[mask]) if mask.sum() > 1 else None
        stats[f"{kind}_observations"] = int(mask.sum())
    a, b, c, d, e, f, g = coefficients
    return StepCost(a, b, c, d, e, source, stats, f, g)


def _r2(measured, predicted) -> float | None:
    """Coefficient of determination of `predicted` against `measured` (numpy arrays); None without variance."""
    total = float(((measured - measured.mean()) ** 2).sum())
    return 1.0 - float(((measured - predicted) ** 2).sum()) / total if total > 0 else None


def replay_observations(replay: ReplayResult | dict) -> list[Observation]:
    """The dense run's per-turn timings of a `replay` as observations: per turn one TTFT (one step, the prefilled
    tokens reading the input) and one decode (decode_steps single-sequence steps, context growing)."""
    replay = ReplayResult.of(replay)
    adapter = 1.0 if replay.mode == "lora" else 0.0
    observations = []
    for turn in replay.dense.turns:
        context, steps = turn.input_tokens, turn.steps
        prefill = turn.prefilled
        ttft_s = measured(turn.ttft_s)
        observations.append(Observation("ttft", ttft_s, 1, prefill, 0, context, 1, adapter * prefill, adapter))
        if steps and turn.decode_s:
            read = steps * context + steps * (steps + 1) / 2
            observations.append(
                Observation("decode", turn.decode_s, steps, 0, steps, read, 0, adapter * steps, adapter * steps)
            )
    return observations


def serve_bench_observations(records: list[dict], adapter_run: bool = False) -> list[Observation]:
    """A serve-bench run's `records` as observations, timed from each request's send (due + send_delay). A TTFT spans
    the steps from send to first token; prefill tokens are the uncached prompt. `adapter_run` (`agents` pattern):
    every request runs an adapter. A request whose later tokens came in one burst (mean gap below `COALESCED` × the
    run's median) gives one send-to-last-token observation. Decode side: single steps from `token_times`
    (`_step_observations`), else each request's decode phase, others' work reconstructed at even paces."""
    adapter = 1.0 if adapter_run else 0.0
    requests = []
    for r in records:
        sent = r["due"] + r["send_delay"]
        requests.append(
            {
                "sent": sent,
                "first": sent + r["ttft"],
                "done": sent + r["e2e"],
                "prefill": max(1, r["prompt_tokens"] - (r.get("cached_tokens") or 0)),
                "prompt": r["prompt_tokens"],
                "output": r["output_tokens"],
                "times": [sent + moment for moment in r.get("token_times") or ()],
            }
        )
    timed = all(len(r["times"]) == r["output"] for r in requests)
    paces = [(r["done"] - r["first"]) / (r["output"] - 1) for r in requests if r["output"] > 1]
    pace = statistics.median(paces) if paces else 0.0
    observations = []
    for r in requests:
        steps = r["output"] - 1
        coalesced = steps >= 1 and (r["done"] - r["first"]) < COALESCED * pace * steps
        end = r["done"] if coalesced else r["first"]
        prefill, decode, read, prefills, paced = _others_within(requests, r, r["sent"], end)
        own_steps, own_decode, own_read = 1, 0, float(r["prompt"])
        if coalesced:
            own_steps, own_decode = 1 + steps, steps
            own_read += steps * r["prompt"] + steps * (steps + 1) / 2
        total = max(own_steps + prefills, paced)
        observations.append(
            Observation(
                "ttft",
                end - r["sent"],
                total,
                r["prefill"] + prefill,
                own_decode + decode,
                own_read + read,
                1,
                adapter * (r["prefill"] + prefill + own_decode + decode),
                adapter * total,
            )
        )
        if steps < 1 or coalesced or timed:
            continue
        prefill, decode, read, _, _ = _others_within(requests, r, r["first"], r["done"])
        decode += steps
        read += steps * r["prompt"] + steps * (steps + 1) / 2
        observations.append(
            Observation(
                "decode",
                r["done"] - r["first"],
                steps,
                prefill,
                decode,
                read,
                0,
                adapter * (prefill + decode),
                adapter * steps,
            )
        )
    if timed:
        observations += _step_observations(requests, adapter, COALESCED * pace)
    return observations


def _step_observations(requests: list[dict], adapter: float, burst: float) -> list[Observation]:
    """Engine steps read off token arrival times (`times`): tokens within `STEP_SPREAD` of a group's first, one per
    request, are one step, timed from the previous group's first token when run right after it. Its work: prefills
    completed in it, its decode tokens, their K/V read. Steps with a burst token (within `burst` s of the request's
    previous one), and the next step, are left out."""
    tokens = sorted(
        (moment, index, k, k > 0 and moment - r["times"][k - 1] < burst)
        for index, r in enumerate(requests)
        for k, moment in enumerate(r["times"])
    )
    groups: list[list[tuple]] = []
    for token in tokens:
        group = groups[-1] if groups else None
        if group and token[0] - group[0][0] < STEP_SPREAD and all(token[1] != other[1] for other in group):
            group.append(token)
        else:
            groups.append([token])
    observations = []
    for previous, group in zip(groups, groups[1:]):
        before = {index: k for _, index, k, _ in previous}
        if any(late for *_, late in previous + group) or not any(before.get(i) == k - 1 for _, i, k, _ in group):
            continue
        prefill = sum(requests[i]["prefill"] for _, i, k, _ in group if k == 0)
        decode = sum(1 for _, _, k, _ in group if k > 0)
        read = sum(requests[i]["prompt"] + k for _, i, k, _ in group)
        seconds = group[0][0] - previous[0][0]
        observations.append(
            Observation("decode", seconds, 1, prefill, decode, read, 0, adapter * (prefill + decode), adapter)
        )
    return observations


def _others_within(requests: list[dict], r: dict, start: float, end: float) -> tuple[float, float, float, int, float]:
    """What requests other than `r` computed in (start, end]: (prefill tokens of those whose first token came in it,
    or within `STEP_SPREAD` after `end`; their decode tokens; the K/V both read; the steps those prefills completed
    in before the last; the most decode tokens any one produced: a lower bound on the steps)."""
    prefill = decode = read = paced = 0.0
    firsts = []
    for q in requests:
        if q is r:
            continue
        if start < q["first"] <= end + STEP_SPREAD:
            prefill += q["prefill"]
            read += q["prompt"]
            if q["first"] < end - STEP_SPREAD:
                firsts.append(q["first"])
        tokens = _tokens_within(q, start, end)
        if tokens:
            decode += tokens
            paced = max(paced, tokens)
            middle = (max(q["first"], start) + min(q["done"], end)) / 2
            read += tokens * _context_at(q, middle)
    firsts.sort()
    prefills = sum(1 for before, after in zip([-math.inf, *firsts], firsts) if after - before > STEP_SPREAD)
    return prefill, decode, read, prefills, paced


def _tokens_within(q: dict, start: float, end: float) -> float:
    """Decode tokens request `q` produced in (start, end], assuming an even pace between its first and last token."""
    span = q["done"] - q["first"]
    if span <= 0 or q["output"] < 2:
        return 0.0
    overlap = max(0.0, min(end, q["done"]) - max(start, q["first"]))
    return (q["output"] - 1) * overlap / span


def _context_at(q: dict, moment: float) -> float:
    """Tokens in request `q`'s context at `moment` of its decoding: its prompt and the tokens it had produced."""
    span = q["done"] - q["first"]
    progress = (moment - q["first"]) / span if span > 0 else 1.0
    return q["prompt"] + 1 + (q["output"] - 1) * min(1.0, max(0.0, progress))


SERVE_BENCH_FIX = "pass the serve_bench.json `kvprof serve-bench` wrote"
REQUEST_TYPES: dict[str, JsonType] = {
    "trajectory": str,
    "due": NUMBER,
    "send_delay": NUMBER,
    "ttft": NUMBER,
    "e2e": NUMBER,
    "prompt_tokens": int,
    "cached_tokens": (int, type(None)),
    "output_tokens": int,
    "token_times": (list, type(None)),
}


def read_serve_bench(path: Path) -> ServeBenchResult:
    """A `kvprof serve-bench` result with every field simulate reads checked; otherwise refused naming the file."""
    result = ServeBenchResult.read(path)
    args = (result.envelope.args if result.envelope else None) or {}
    check_fields(args, {"kv_cache_gib": (int, float, type(None))}, f"{path}, args", SERVE_BENCH_FIX)
    if args.get("kv_cache_gib") is not None and args["kv_cache_gib"] <= 0:
        raise KvprofError(
            f"{path} ran with kv_cache_gib {args['kv_cache_gib']}, not a positive size; {SERVE_BENCH_FIX}."
        )
    if not result.runs:
        raise KvprofError(f"{path} holds no serve-bench runs; {SERVE_BENCH_FIX}.")
    for index, run in enumerate(result.runs):
        where = f"{path}, run {index}"
        summary = run.summary
        check_fields(summary.overall, {"ttft": (dict, type(None))}, f"{where} overall", SERVE_BENCH_FIX)
        ttft = summary.overall.get("ttft")
        if ttft is not None:
            throughput = check_fields(summary.throughput, {}, f"{where} summary, throughput", SERVE_BENCH_FIX)
            measured = (ttft.get("p50"), throughput.get("requests_per_s"))
            if not all(value is not None and is_json(value, NUMBER) and value > 0 for value in measured):
                raise KvprofError(f"{where} has no positive median TTFT and request throughput; {SERVE_BENCH_FIX}.")
        for number, request in enumerate(run.requests):
            record = f"{where} request {number}"
            check_fields(request, REQUEST_TYPES, record, SERVE_BENCH_FIX)
            counts = [request[key] for key in REQUEST_TYPES if is_json(request.get(key), NUMBER)]
            times = request.get("token_times") or []
            if any(value < 0 for value in counts) or not all(is_json(t, NUMBER) and t >= 0 for t in times):
                raise KvprofError(f"{record} holds a negative or non-numeric count or time; {SERVE_BENCH_FIX}.")
    return result


def serve_bench_cost(result: ServeBenchResult, source: str, fit_load: float | None = None) -> StepCost:
    """The step model fitted to a serve-bench `result`'s runs (read from `source`), all or those at `fit_load`."""
    runs = result.runs
    if not runs:
        raise KvprofError(f"{source} holds no serve-bench runs; {SERVE_BENCH_FIX}.")
    if fit_load is not None:
        runs = [run for run in runs if fitted_run(run, fit_load)]
        if not runs:
            raise KvprofError(
                f"{source} has no run at load {fit_load:g}; pass --fit-load with one of its loads "
                f"({', '.join(sorted({_load_label(run) for run in result.runs}))})."
            )
        source = f"{source} at load {fit_load:g}"
    observations = [o for run in runs for o in serve_bench_observations(run.requests, run.summary.pattern == "agents")]
    return fit(observations, f"fit to serve-bench runs of {source}")


def fitted_run(run: ServeRun, fit_load: float | None) -> bool:
    """Whether a serve-bench run is one the step model was fitted to (all are when `fit_load` is None)."""
    return fit_load is None or run.summary.load.value == fit_load


def _load_label(run: ServeRun) -> str:
    load = run.summary.load
    return f"{load.value:g} {load.kind}"


def roofline_cost(device: str, work: ReplayWork) -> StepCost:
    """The uncalibrated roofline model of the replayed model on `device` (a key of `DEVICES`)."""
    spec = DEVICES[device]
    return StepCost(
        a=work.weight_bytes() / spec.bandwidth,
        b=work.prefill_flops_per_token / spec.peak_flops,
        c=work.decode_flops_per_step / spec.peak_flops,
        d=work.kv_bytes_per_token / spec.bandwidth,
        e=0.0,
        source=f"{ROOFLINE} ({spec.name}: {spec.peak_flops / 1e12:g} TFLOP/s, {spec.bandwidth / 1e12:g} TB/s)",
    )
