"""The target as a team states it, as `--target` clauses (comma-separated or repeated):

    accuracy-drop<=1pt  kl<=0.01  ttft-p90<=2s  ttft-p50<=300ms  tpot-p90<=40ms  kv-memory<=2GiB
    load=4qps (or load=8conc: trajectories in flight)  optimise=throughput (or ttft, memory)

Accuracy drop and KL are against NonShared (online exact match in percentage points; KL(dense ‖ policy) in nats per
output token); TTFT and TPOT percentiles and KV memory are simulated at the load; the KV-memory budget is the KV
memory the modelled engine has. Every clause but `load` and `optimise` is an upper bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvprof.errors import KvprofError
from kvprof.serving.traffic import Load

OBJECTIVES = ("throughput", "ttft", "memory")
QUALITY_BOUNDS = ("accuracy-drop", "kl")
SERVING_BOUNDS = ("ttft-p50", "ttft-p90", "tpot-p50", "tpot-p90")
MEMORY_BOUND = "kv-memory"
BOUNDS = (*QUALITY_BOUNDS, *SERVING_BOUNDS, MEMORY_BOUND)
# Units each bound is written in, as factors to the stored unit (a fraction, nats, seconds, bytes).
UNITS: dict[str, dict[str, float]] = {
    "accuracy-drop": {"pt": 0.01, "pts": 0.01, "points": 0.01, "%": 0.01},
    "kl": {"": 1.0, "nats": 1.0},
    **{name: {"s": 1.0, "ms": 1e-3, "us": 1e-6} for name in SERVING_BOUNDS},
    MEMORY_BOUND: {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40},
}
LOAD_UNITS = {"qps": "qps", "conc": "concurrency", "in-flight": "concurrency"}
EXAMPLE = "accuracy-drop<=1pt, kl<=0.01, ttft-p90<=2s, tpot-p90<=40ms, kv-memory<=2GiB, load=4qps, optimise=throughput"
CLAUSE = re.compile(r"^\s*([a-z0-9-]+)\s*(<=|=)\s*([-+0-9.]+(?:e[-+]?[0-9]+)?)?\s*([A-Za-z%-]*)\s*$")


@dataclass(frozen=True)
class Target:
    """Upper bounds by name (stored units: a fraction, nats, seconds, bytes), the load and what to optimise."""

    bounds: dict[str, float] = field(default_factory=dict)
    load: Load | None = None
    optimise: str = "throughput"

    @property
    def kv_memory(self) -> float | None:
        """The KV-memory budget in bytes (None: the device's memory less the weights, as `kvprof simulate`)."""
        return self.bounds.get(MEMORY_BOUND)

    def with_load(self, load: Load) -> Target:
        return Target(self.bounds, load, self.optimise)

    def with_kv_memory(self, budget: float) -> Target:
        return Target(self.bounds | {MEMORY_BOUND: budget}, self.load, self.optimise)

    def clauses(self) -> list[str]:
        """The target written back as clauses (`bound_text` units), load and objective last."""
        clauses = [f"{name}<={bound_text(name, limit)}" for name, limit in self.bounds.items()]
        if self.load is not None:
            clauses.append(f"load={load_text(self.load)}")
        return [*clauses, f"optimise={self.optimise}"]


def load_text(load: Load) -> str:
    """A load as a clause writes it: 4qps, 8conc."""
    return f"{load.value:g}{'qps' if load.kind == 'qps' else 'conc'}"


def bound_text(name: str, value: float) -> str:
    """`value` of bound `name` in the unit a team would write it: 1pt, 0.01, 250ms, 1.5s, 2GiB."""
    if name == "accuracy-drop":
        return f"{100 * value:.3g}pt"
    if name == "kl":
        return f"{value:.3g}"
    if name == MEMORY_BOUND:
        for unit in ("GiB", "MiB", "KiB"):
            if value >= UNITS[MEMORY_BOUND][unit]:
                return f"{value / UNITS[MEMORY_BOUND][unit]:.3g}{unit}"
        return f"{value:.0f}B"
    return f"{value:.3g}s" if value >= 1 else f"{1e3 * value:.3g}ms"


def _refuse(clause: str, why: str) -> KvprofError:
    return KvprofError(f"--target {clause.strip()!r} {why}; write the target as e.g. {EXAMPLE!r}.")


def _number(clause: str, text: str | None) -> float:
    if text is None:
        raise _refuse(clause, "cannot be read as NAME<=NUMBER UNIT, load=NUMBER qps|conc or optimise=WHAT")
    try:
        return float(text)
    except ValueError:
        raise _refuse(clause, f"has {text!r}, which is not a number") from None


def _clause(clause: str, bounds: dict[str, float], settings: dict[str, object]) -> None:
    """Read one clause into `bounds` or `settings` (load, optimise), refusing what cannot be read."""
    match = CLAUSE.match(clause)
    if match is None:
        raise _refuse(clause, "cannot be read as NAME<=NUMBER UNIT, load=NUMBER qps|conc or optimise=WHAT")
    name, operator, text, unit = match.groups()
    name = "optimise" if name == "optimize" else name
    if name == "optimise" and operator == "=" and text is None and unit in OBJECTIVES:
        settings["optimise"] = unit
        return
    if name == "optimise":
        raise _refuse(clause, f"optimises none of {', '.join(OBJECTIVES)}")
    number = _number(clause, text)
    if name == "load" and operator == "=":
        kind = LOAD_UNITS.get(unit)
        if kind is None or number <= 0:
            raise _refuse(clause, "is not a positive load in qps (trajectories per second) or conc (in flight)")
        if kind == "concurrency" and not number.is_integer():
            raise _refuse(clause, "is not a whole number of trajectories in flight")
        settings["load"] = Load(kind, number)
        return
    if name not in UNITS or operator != "<=":
        raise _refuse(clause, f"is not a bound kvprof reads ({', '.join(f'{b}<=' for b in BOUNDS)})")
    if unit not in UNITS[name]:
        units = ", ".join(repr(u) if u else "no unit" for u in UNITS[name])
        raise _refuse(clause, f"has unit {unit!r}, not one of {units}")
    if name in bounds:
        raise _refuse(clause, f"bounds {name} a second time")
    if number < 0:
        raise _refuse(clause, "is a negative bound")
    bounds[name] = number * UNITS[name][unit]


def parse_target(clauses: list[str]) -> Target:
    """The target of `--target` clauses (each may hold several, comma-separated); refused in one sentence when a
    clause cannot be read, a load is given twice, or there is no load."""
    bounds: dict[str, float] = {}
    settings: dict[str, object] = {}
    parts = [part for clause in clauses for part in clause.split(",") if part.strip()]
    for part in parts:
        before = dict(settings)
        _clause(part, bounds, settings)
        if "load" in before and "load" in settings and settings["load"] is not before["load"]:
            raise _refuse(part, "names a second load (sensitivity to the load is reported for you)")
    load = settings.get("load")
    if not isinstance(load, Load):
        raise KvprofError(
            "--target names no load; add the load the bounds hold at, e.g. --target load=4qps (trajectories per "
            "second) or --target load=8conc (trajectories in flight)."
        )
    return Target(bounds, load, str(settings.get("optimise", "throughput")))
