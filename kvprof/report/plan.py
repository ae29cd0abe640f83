"""A run's plan (`--plan`'s plan.json) on the terminal and in the dashboard: peak memory by kind and what makes it,
the expected time, the probes it was measured on."""

from __future__ import annotations

from kvprof.report.html import Section
from kvprof.report.tables import TableData
from kvprof.results.plan import PlanResult
from kvprof.ui import describe_bytes


def plan_lines(plan: PlanResult) -> list[str]:
    """The plan as the terminal shows it: peak by memory kind and what makes it, the expected time."""
    held_on = "device" if "device" in plan.peak_bytes else "host"
    stores = ", ".join(f"{label} {describe_bytes(size)}" for label, size in plan.stored_peak_bytes.items())
    parts = [
        f"process {describe_bytes(plan.process_bytes)}" if held_on == "host" else "",
        f"weights {describe_bytes(plan.weights_bytes)}" if plan.weights_bytes is not None else "",
        f"stored {describe_bytes(sum(plan.stored_peak_bytes.values()))} ({stores})" if stores else "",
        f"a turn's working set and the rest {describe_bytes(plan.working_bytes)}",
    ]
    probed = " and ".join(str(p.layers) for p in plan.probes)
    lines = [
        f"plan ({probed} of {plan.layers} layers probed): peak {held_on} memory "
        f"{describe_bytes(plan.peak_bytes[held_on])} = {' + '.join(p for p in parts if p)}",
    ]
    if held_on == "device":
        lines.append(f"  host memory at its peak {describe_bytes(plan.peak_bytes['host'])}")
    if plan.kv_budget_bytes is not None:
        lines.append(f"  stored caches of the runs not running parked beyond {describe_bytes(plan.kv_budget_bytes)}")
    free = ", ".join(f"{kind} {describe_bytes(size)}" for kind, size in plan.free_bytes.items() if size is not None)
    lines.append(f"  expected time {plan.expected_seconds:.0f} s; free now: {free or 'unknown'}")
    return lines


def sections(plan: PlanResult) -> list[Section]:
    """The plan's card (its lines) and a table of its probes."""
    table = TableData(
        "probes: the command on the model's first layers, each in its own process",
        ["layers", "seconds", "peak host", "peak device", "weights"],
        [
            [
                str(probe.layers),
                f"{probe.seconds:.1f}",
                describe_bytes(probe.peak_host_bytes),
                "–" if probe.peak_device_bytes is None else describe_bytes(probe.peak_device_bytes),
                "–" if probe.weights_bytes is None else describe_bytes(probe.weights_bytes),
            ]
            for probe in plan.probes
        ],
    )
    title = f"Plan of kvprof {plan.command} ({plan.layers} layers)"
    return [Section(title=title, card=plan_lines(plan), tables=[table], order="inputs")]
