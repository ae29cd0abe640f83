"""A run's plan, measured before it runs: the same command on the model's first k and 3k decoder layers (2k where
the model has fewer than 6k), each in a process of its own (`kvprof.commands.probe`), extrapolated to all its
layers.

Everything a run holds or does per layer — weights, every run's stored caches, a turn's caches, the time in the
layers — grows by the same amount with each layer (of each kind: k is the fewest first layers holding every kind a
hybrid has), and the rest — the process, the embedding and head, the trace's bookkeeping — does not. So a quantity
measured at k and 3k layers is a line in the layers, and the plan reads it at the model's L: q(L) = q(k) + (q(3k) −
q(k)) · (L − k) / 2k. On k layers memory is not yet on its line (what the allocator keeps is a larger share: on the
Qwen3-0.6B shape at 2k tokens 0.26 GiB a layer from 2 to 4 layers, 0.19 from 4 to 8 and 0.21 from 8 to 28), so where
the line reaches far (6k layers or more) the second probe is at 3k. Memory is measured, not modelled (VmHWM on the
host, the CUDA allocator's peak on a GPU), so whatever the run allocates — workspaces, a turn's activations, the
allocator's retained blocks — is in the prediction. A peak is the most held at any moment, and the moment moves with
the layers (a turn's activations, the same on any number of layers, can top a cut model's memory early; the stores,
per layer, top the whole model's late): extrapolated, a probe's peak would underestimate. So each probe records its
peak from each call's start to the next (`kvprof.profiling.CallPeaks`), each is extrapolated on its own, and the
plan's peak is the largest. The breakdown names the stored caches (the replay's own analytic peak per run) and the
weights, the rest being a turn's working set. A model of 2k layers or fewer is probed once, whole: its plan is that
run.

The probes cost about 4k/L of the run (at most 2/3; 3k/L where the second is at 2k) and replay the whole input:
memory peaks where the stores are largest, which only the whole trace shows.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import read_json_file
from kvprof.model.first_layers import smallest_probe, text_config
from kvprof.planning.memory import free_device_bytes, free_host_bytes
from kvprof.results.plan import PlanProbe, PlanResult
from kvprof.results.replay import ReplayResult
from kvprof.ui import describe_bytes

PROBE_ERROR_LINES = 3  # lines of a failed probe's output quoted in the refusal
REFUSAL = "error: "  # how a command's refusal (`KvprofError`, a usage error) begins on its stderr


def probe_layers_for(config) -> list[int]:
    """The layer counts probed for a model of `config`: k (the fewest first layers holding every layer kind) and
    3k where the model has 6k layers or more, else 2k, or the whole model once where it has no more than 2k."""
    total = int(text_config(config).num_hidden_layers)
    small = smallest_probe(config)
    if 6 * small <= total:
        return [small, 3 * small]
    return [small, 2 * small] if 2 * small < total else [total]


def run_probe(command: str, arguments: list[str], layers: int, scratch: Path) -> PlanProbe:
    """`kvprof COMMAND ARGUMENTS` on the first `layers` layers in a process of its own, writing under `scratch`;
    where the command refuses its input (a `KvprofError`), refused in that sentence, as the command itself would
    refuse it; where it fails otherwise, refused quoting its last lines."""
    report = scratch / f"probe-{layers}.json"
    out = scratch / f"out-{layers}"
    line = [sys.executable, "-m", "kvprof.commands.probe", str(layers), str(report), command, *arguments]
    done = subprocess.run([*line, "--out", str(out)], capture_output=True, text=True)
    measured = read_json_file(report, "probe report", "plan again") if report.exists() else None
    if done.returncode or not isinstance(measured, dict):
        said = [text for text in (done.stderr + done.stdout).strip().splitlines() if text.strip()]
        refusal = next((text for text in reversed(said) if text.startswith(REFUSAL)), None)
        if done.returncode and refusal is not None:
            raise KvprofError(refusal.removeprefix(REFUSAL))
        raise KvprofError(
            f"planning ran `kvprof {command}` on the model's first {layers} layers and it failed "
            f"({' / '.join(said[-PROBE_ERROR_LINES:]) or f'exit code {done.returncode}'}); run the command without "
            "--plan to see the whole error."
        )
    return PlanProbe(
        layers=layers,
        seconds=float(measured["seconds"]),
        peak_host_bytes=int(measured["peak_host_bytes"]),
        peak_device_bytes=measured["peak_device_bytes"],
        process_bytes=int(measured["process_bytes"]),
        weights_bytes=measured["weights_bytes"],
        stored_peak_bytes=stored_peaks(out / f"{command.replace('-', '_')}.json"),
        call_peak_host_bytes=measured.get("call_peak_host_bytes"),
        call_peak_device_bytes=measured.get("call_peak_device_bytes"),
    )


def stored_peaks(result: Path) -> dict[str, int]:
    """What a probe's result says the run stores at its peak: each replayed run's stored caches (the dense run's
    and each policy's analytic stored bytes), or the anchor pool fit-anchors fitted (at its stored rank); none for
    another command's."""
    if not result.exists():
        return {}
    if result.name == "fit_anchors.json":
        fitted = read_json_file(result, "probe's fit-anchors result", "plan again")
        assert isinstance(fitted, dict), f"{result} is not a fit-anchors result"
        held = "full_bytes" if fitted.get("stored_rank") is None else "low_rank_bytes"
        return {"anchor pool": int(fitted["memory"][held])}
    if result.name != "replay.json":
        return {}
    replayed = ReplayResult.read(result)
    runs = {"dense": replayed.dense.summary, **{label: run.summary for label, run in replayed.policies.items()}}
    return {label: int(summary.peak_memory_bytes) for label, summary in runs.items() if summary is not None}


def _stored(probe: PlanProbe, label: str) -> float | None:
    size = probe.stored_peak_bytes.get(label)
    return None if size is None else float(size)


def at_layers(probes: list[PlanProbe], value: Callable[[PlanProbe], float | None], total: int) -> float | None:
    """A quantity measured by each probe, on the line through them at `total` layers (one probe: its value)."""
    values = [value(probe) for probe in probes]
    if any(v is None for v in values):
        return None
    if len(probes) == 1:
        return values[0]
    return on_line([probe.layers for probe in probes], [v or 0.0 for v in values], total)


def on_line(layers: list[int], values: list[float], total: int) -> float:
    """The line through (layers[i], values[i]) (two points) at `total` layers."""
    (small, large), (at_small, at_large) = layers, values
    return at_small + (at_large - at_small) * (total - small) / (large - small)


def peak_at_layers(probes: list[PlanProbe], kind: str, total: int) -> float | None:
    """The peak of memory `kind` at `total` layers: the largest of the probes' peaks call by call, each on its line
    (the module docstring says why), and never below their overall peaks' line; that line alone where the probes
    did not record call by call the same calls."""
    overall = at_layers(probes, lambda probe: probe.peaks(kind)[0], total)
    calls = [series for probe in probes if (series := probe.peaks(kind)[1]) is not None]
    if overall is None or len(probes) == 1 or len(calls) < len(probes) or len({len(c) for c in calls}) > 1:
        return overall
    layers = [probe.layers for probe in probes]
    return max([overall, *(on_line(layers, list(peaks), total) for peaks in zip(*calls))])


def make_plan(
    command: str,
    arguments: Callable[[int], list[str]],
    config,
    device: str,
    kv_budget: int | None,
    on_probe: Callable[[int], None] | None = None,
    threads: int | None = None,
) -> PlanResult:
    """The plan of `kvprof COMMAND` on a model of `config` (`arguments(layers)`: its command line for a probe of
    that many layers, without --out), its peak compared with the memory free on `device` now. `threads`: each
    probe's torch threads where the command line sets none (the planning command's: a probe started right after
    another would otherwise see the machine as the other left it, and the run is timed on these)."""
    total = int(text_config(config).num_hidden_layers)
    probes = []
    with tempfile.TemporaryDirectory(prefix="kvprof-plan-") as scratch:
        for layers in probe_layers_for(config):
            if on_probe:
                on_probe(layers)
            line = arguments(layers)
            if threads is not None and "--threads" not in line:
                line = [*line, "--threads", str(threads)]
            probes.append(run_probe(command, line, layers, Path(scratch)))
    labels = list(probes[0].stored_peak_bytes)
    stored = {label: at_layers(probes, partial(_stored, label=label), total) for label in labels}
    peak = {"host": peak_at_layers(probes, "host", total)}
    on_device = probes[0].peak_device_bytes is not None
    if on_device:
        peak["device"] = peak_at_layers(probes, "device", total)
    process = min(p.process_bytes for p in probes)
    weights = at_layers(probes, lambda p: p.weights_bytes, total)
    held = peak["device" if on_device else "host"] or 0.0
    working = held - (0 if on_device else process) - (weights or 0) - sum(v or 0 for v in stored.values())
    plan = PlanResult(
        command=command,
        arguments=arguments(total),
        layers=total,
        probes=probes,
        process_bytes=process,
        weights_bytes=None if weights is None else round(weights),
        stored_peak_bytes={label: round(value or 0) for label, value in stored.items()},
        working_bytes=round(working),
        peak_bytes={kind: round(value or 0) for kind, value in peak.items()},
        expected_seconds=float(at_layers(probes, lambda p: p.seconds, total) or 0.0),
        free_bytes={},
        fits=True,
        kv_budget_bytes=kv_budget,
    )
    return with_free_memory(plan, device)


def with_free_memory(plan: PlanResult, device: str) -> PlanResult:
    """`plan` with the memory free now on the host and `device` (a GPU's where the plan holds a device peak), and
    whether its peak fits in it."""
    free = {"host": free_host_bytes()}
    if "device" in plan.peak_bytes:
        free["device"] = free_device_bytes(device)
    fits = all(free.get(kind) is None or value <= (free[kind] or 0) for kind, value in plan.peak_bytes.items())
    return dataclasses.replace(plan, free_bytes=free, fits=fits)


def require_fit(plan: PlanResult, what: str) -> None:
    """Refuse, in one sentence with what would fit, a plan whose peak exceeds the memory free."""
    for kind, peak in plan.peak_bytes.items():
        free = plan.free_bytes.get(kind)
        if free is None or peak <= free:
            continue
        stores = sum(plan.stored_peak_bytes.values())
        options = ["fewer trajectories (--limit)"]
        if len(plan.stored_peak_bytes) > 2:
            options.insert(0, "fewer policies at once (--policy)")
        budget = free - (peak - stores)
        largest = max(plan.stored_peak_bytes.values(), default=0)
        if stores and budget > largest:
            options.append(f"the stored caches held within --kv-budget {describe_bytes(budget * 0.9)}")
        raise KvprofError(
            f"{what} would need {describe_bytes(peak)} of {kind} memory at its peak (planned on the model's first "
            f"layers) but {describe_bytes(free)} is free; run {', '.join(options[:-1])}"
            f"{' or ' if len(options) > 1 else ''}{options[-1]}."
        )


def require_budget_floor(plan: PlanResult) -> None:
    """Refuse a --kv-budget below what one step of the lockstep holds at once: the dense run's stores (the policies
    compare against its turn) and the largest policy's."""
    budget, stored = plan.kv_budget_bytes, dict(plan.stored_peak_bytes)
    if budget is None or "dense" not in stored:
        return
    dense = stored.pop("dense")
    floor = dense + max(stored.values(), default=0)
    if budget < floor:
        raise KvprofError(
            f"--kv-budget {describe_bytes(budget)} is below what one step of the replay holds at once (the dense "
            f"run's stored caches, {describe_bytes(dense)}, beside the largest policy's: {describe_bytes(floor)} "
            f"planned); pass --kv-budget {describe_bytes(floor * 1.25)} or more."
        )
