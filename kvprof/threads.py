"""kvprof on a shared machine: how many torch threads a command runs (`--threads`, else a default from the cores
free), and how much of the machine other processes took while it ran or timed (`LoadMeter`).

Threads that outnumber the free cores contend: on a 2-core machine a prefill slowed about 5× with torch's default
threads while one other CPU-bound process ran. The default is the smaller of torch's own count and the cores free:
the cores less what other processes used since the command started (its first second or so, while it imports).
Where the command has not metered for `MIN_WINDOW` seconds (one run in the same process as another), the busier of
the last minute's load average and the other processes runnable right now stands in: the average lags (a capture
that ended seconds before a replay made the replay run one thread for a minute), and the snapshot counts any
process runnable at that instant (a shell pipeline's reader) as a core. What other processes took is
read from /proc/stat (every CPU's busy time, steal included) less this process's own CPU time; a timing is
contended when they took more than the cores its threads left them, by over `CONTENTION_MARGIN` of a core.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from kvprof.errors import KvprofError

CONTENTION_MARGIN = 0.5  # cores: other processes' use beyond the cores left free before a timing counts contended
MIN_WINDOW = 0.5  # seconds of metering that tell the cores other processes use (shorter: the load average instead)
PROC_STAT = Path("/proc/stat")
PROC_LOADAVG = Path("/proc/loadavg")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; the machine's count where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def busy_cores(meter: LoadMeter | None = None) -> float | None:
    """How many cores other processes keep busy: what they used since `meter` started, where that is `MIN_WINDOW`
    seconds or more (a command's start, its imports); else the busier of the last minute's load average and the
    scheduling entities runnable now, this one's reading thread excepted (/proc/loadavg); None where neither is
    known."""
    if meter is not None:
        load = meter.reading()
        if load.seconds >= MIN_WINDOW and load.other_cores is not None:
            return load.other_cores
    try:
        average = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    try:
        running = int(PROC_LOADAVG.read_text().split()[3].split("/")[0]) - 1
    except (OSError, IndexError, ValueError):
        return average
    return max(average, float(running))


@dataclass(frozen=True)
class ThreadChoice:
    """The torch threads a command runs and why: `--threads`, or the default from the cores free."""

    threads: int
    cores: int
    free: int | None  # cores other processes left free (`busy_cores`; None: chosen by --threads, or not known)
    requested: bool

    def describe(self) -> str:
        plural = "s" if self.threads != 1 else ""
        if self.requested:
            return f"{self.threads} torch thread{plural} (--threads)"
        free = "" if self.free is None else f", {self.free} of {self.cores} cores free of other processes"
        return f"{self.threads} torch thread{plural} (default{free}; --threads to choose)"


def choose_threads(requested: int | None, meter: LoadMeter | None = None) -> ThreadChoice:
    """Set torch's intra-op threads to `requested`, or by default to the smaller of torch's own count and the cores
    free (at least 1; `busy_cores`, measured since `meter` started where it is given); what was chosen."""
    import torch

    cores = available_cores()
    if requested is not None:
        if requested < 1:
            raise KvprofError(f"--threads {requested} is not a thread count; pass 1 to {cores} (this machine's cores).")
        torch.set_num_threads(requested)
        return ThreadChoice(requested, cores, None, True)
    busy = busy_cores(meter)
    free = None if busy is None else max(1, cores - round(busy))
    threads = min(torch.get_num_threads(), free or cores)
    torch.set_num_threads(threads)
    return ThreadChoice(threads, cores, free, False)


@dataclass(frozen=True)
class MachineLoad:
    """Other processes' CPU use over `seconds` of wall time, in cores (`other_cores`), beside this process's
    `threads` torch threads on `cores` cores; None fields where /proc/stat is not there."""

    seconds: float
    other_cores: float | None
    cores: int
    threads: int

    @property
    def contended(self) -> bool:
        """Whether other processes took more than the cores this process's threads left them (`CONTENTION_MARGIN`)."""
        spare = max(0, self.cores - self.threads)
        return self.other_cores is not None and self.other_cores > spare + CONTENTION_MARGIN

    def to_json(self) -> dict:
        other = None if self.other_cores is None else round(self.other_cores, 3)
        return dict(
            seconds=round(self.seconds, 3),
            other_cores=other,
            cores=self.cores,
            threads=self.threads,
            contended=self.contended,
        )


def _busy_seconds() -> float | None:
    """Every CPU's busy time since boot (user, nice, system, irq, softirq, steal), None without /proc/stat."""
    try:
        fields = PROC_STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """This process's CPU time, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LoadMeter:
    """Started at construction; `reading()` is other processes' CPU use since then (`MachineLoad`)."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()

    def reading(self) -> MachineLoad:
        import torch

        wall = time.perf_counter() - self.wall
        busy = _busy_seconds()
        other = None
        if busy is not None and self.busy is not None and wall > 0:
            other = max(0.0, (busy - self.busy) - (_own_seconds() - self.own)) / wall
        return MachineLoad(wall, other, available_cores(), torch.get_num_threads())
