"""kvprof on a shared machine: the torch threads a command runs (`--threads`, else a default from the cores free),
the load other processes put on the machine (read from /proc/stat), and a replay timed under contention saying so."""

from __future__ import annotations

import json

import pytest
import torch

from kvprof import threads
from kvprof.threads import MachineLoad, choose_threads


@pytest.fixture
def one_thread_after():
    """Give torch back the suite's one thread (tests/conftest.py) after a test that sets another count."""
    yield
    torch.set_num_threads(1)


def test_the_default_is_capped_at_the_cores_free(monkeypatch, one_thread_after):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    torch.set_num_threads(8)
    monkeypatch.setattr(threads, "busy_cores", lambda meter=None: 5.4)
    choice = choose_threads(None)
    assert (choice.threads, choice.free, torch.get_num_threads()) == (3, 3, 3)
    assert choice.describe() == "3 torch threads (default, 3 of 8 cores free of other processes; --threads to choose)"
    monkeypatch.setattr(threads, "busy_cores", lambda meter=None: 11.0)
    assert choose_threads(None).threads == 1  # a busier machine than it has cores: still one thread
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "busy_cores", lambda meter=None: 0.0)
    assert choose_threads(None).threads == 2  # never more than torch's own count


class Metered(threads.LoadMeter):
    """A meter that has read `other_cores` over `seconds`."""

    def __init__(self, seconds: float, other_cores: float | None):
        self.load = MachineLoad(seconds, other_cores, 2, 1)

    def reading(self) -> MachineLoad:
        return self.load


def test_busy_cores_is_what_others_used_since_the_command_started_not_the_lagging_load_average(monkeypatch, tmp_path):
    """A capture that ended seconds ago still weighs in the load average (1.9): measured since the command started,
    the machine is free; a window too short to tell, or no /proc/stat, falls back to the average."""
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(threads, "PROC_LOADAVG", loadavg)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.9, 0.8, 0.3))
    loadavg.write_text("1.90 0.80 0.30 2/210 4242\n")  # a shell pipeline's reader runnable at that instant
    assert threads.busy_cores(Metered(1.2, 0.01)) == 0.01
    assert threads.busy_cores(Metered(1.2, 0.9)) == 0.9
    assert threads.busy_cores(Metered(0.1, 0.01)) == 1.9
    assert threads.busy_cores(Metered(1.2, None)) == 1.9


def test_a_command_measures_the_machine_while_it_starts(monkeypatch, one_thread_after):
    """A real meter over half a second in which another process kept a core busy reads about one core busy."""
    import subprocess
    import sys
    import time

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    torch.set_num_threads(2)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        meter = threads.LoadMeter()
        time.sleep(threads.MIN_WINDOW + 0.2)
        choice = choose_threads(None, meter)
    finally:
        hog.kill()
    assert choice.free == 1 and choice.threads == 1


def test_busy_cores_is_the_busier_of_the_load_average_and_the_processes_running_now(monkeypatch, tmp_path):
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(threads, "PROC_LOADAVG", loadavg)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    loadavg.write_text("0.30 0.20 0.10 3/210 4242\n")  # this reader and two others runnable: a fresh busy process
    assert threads.busy_cores() == 2.0
    loadavg.write_text("0.30 0.20 0.10 1/210 4242\n")
    assert threads.busy_cores() == 0.3


def test_threads_requested_are_set(one_thread_after):
    choice = choose_threads(3)
    assert torch.get_num_threads() == 3 and choice.describe() == "3 torch threads (--threads)"


@pytest.mark.parametrize(
    "other, cores, used, contended",
    [(0.1, 2, 2, False), (0.9, 2, 2, True), (0.9, 2, 1, False), (1.8, 2, 1, True), (None, 2, 2, False)],
)
def test_contention_is_other_processes_beyond_the_cores_left_free(other, cores, used, contended):
    assert MachineLoad(1.0, other, cores, used).contended is contended


def test_the_meter_reads_other_processes_from_proc_stat(monkeypatch, tmp_path):
    """Busy jiffies (steal counted, idle and iowait not) less this process's CPU time, per second of wall time."""
    stat = tmp_path / "stat"
    monkeypatch.setattr(threads, "PROC_STAT", stat)
    tick = threads.os.sysconf("SC_CLK_TCK")
    clock = iter([10.0, 12.0])
    own = iter([1.0, 2.5])
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(threads, "_own_seconds", lambda: next(own))
    stat.write_text(f"cpu  {100 * tick} 0 0 {900 * tick} 0 0 0 0 0 0\ncpu0 ...\n")
    meter = threads.LoadMeter()
    # 2 s later: 1 s more user, 1 s more system, 0.5 s more steal, 9 s more idle; this process took 1.5 s of it
    stat.write_text(f"cpu  {101 * tick} 0 {1 * tick} {909 * tick} 0 0 0 {tick // 2} 0 0\n")
    assert meter.reading().other_cores == pytest.approx((2.5 - 1.5) / 2, abs=0.01)


def test_a_contended_replay_says_so(run_cli, lora_trace, tmp_path, monkeypatch, one_thread_after):
    """A replay whose timed runs saw other processes take the cores its threads needed: a warning and the cost table
    say so, and the result records it with the threads chosen."""
    import kvprof.replay.engine

    class BusyMachine(threads.LoadMeter):
        def reading(self) -> MachineLoad:
            return MachineLoad(2.0, 1.7, 2, 2)

    monkeypatch.setattr(kvprof.replay.engine, "LoadMeter", BusyMachine)
    args = ["--policy", "fullshared", "--limit", "1", "--repeats", "1", "--threads", "2", "--device", "cpu"]
    code, out, err = run_cli("replay", lora_trace, *args, "--out", tmp_path)
    assert code == 0, err
    assert "running 2 torch threads (--threads)" in out
    assert "WARNING: CONTENDED: other processes used 1.7 of 2 cores beside its 2 torch threads while it timed" in out
    result = json.loads((tmp_path / "replay.json").read_text())
    assert result["timing"]["load"] == {"seconds": 2.0, "other_cores": 1.7, "cores": 2, "threads": 2, "contended": True}
    environment = result["environment"]
    assert environment["cpu_threads"] == 2 and environment["threads_chosen"] == "2 torch threads (--threads)"
    assert set(environment["load"]) == {"seconds", "other_cores", "cores", "threads", "contended"}


def test_the_environment_panel_shows_threads_and_load(tmp_path):
    from kvprof.report.dashboard import environment_table

    load = {"seconds": 9.0, "other_cores": 1.3, "cores": 2, "threads": 2, "contended": True}
    result = {"environment": {"torch": "2.13.0", "cpu_threads": 2, "load": load}}
    (row,) = environment_table([(tmp_path / "replay.json", result)]).rows
    assert row[4] == "torch 2.13.0, 2 CPU threads, other processes' load 1.3 of 2 cores (contended)"
