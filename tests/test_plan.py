"""The plan before a run (`--plan`): probes on the model's first layers extrapolated to all of them, what it predicts
against what the run then holds, refusals where it does not fit; the cut configs of hybrid families; --kv-budget at
the command line (the numbers under a budget: tests/test_branches.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from conftest import capture_tiny_trace
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from typer.main import get_command

from kvprof.cli import app
from kvprof.commands.planning import arguments_of
from kvprof.errors import KvprofError
from kvprof.model.architecture import weights_bytes
from kvprof.model.first_layers import first_layers_config, layer_kinds_of_config, smallest_probe
from kvprof.model.tiny import build_tiny_world, tiny_config
from kvprof.planning.plan import peak_at_layers, probe_layers_for, require_budget_floor
from kvprof.results.plan import PlanProbe, PlanResult
from kvprof.results.replay import ReplayResult

POLICIES = ("--policy", "fullshared", "--policy", "cacheblend")


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """A tiny world of six layers wide enough that a layer's weights and caches show in the process's memory, and a
    lora-mode trace of it."""
    root = tmp_path_factory.mktemp("six_layers")
    world = build_tiny_world(root / "world", configure=lambda vocab, eos: tiny_config(vocab, eos, 256, 6, 8, 4))
    return world, capture_tiny_trace(world, world.lora_workflow, root / "trace.jsonl")


@pytest.fixture(scope="module")
def planned(six_layers, tmp_path_factory):
    """The plan of a two-policy replay of the six-layer world, then that replay in a process of its own."""
    world, trace = six_layers
    out = tmp_path_factory.mktemp("planned")
    line = ["replay", str(trace), *POLICIES, "--limit", "1", "--repeats", "1", "--device", "cpu", "--out", str(out)]
    planning = subprocess.run([sys.executable, "-m", "kvprof", *line, "--plan"], capture_output=True, text=True)
    assert planning.returncode == 0, planning.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "kvprof", *line], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return world, out, planning.stdout, run.stdout


def test_the_plan_extrapolates_weights_and_stores_exactly(planned):
    """Two probes (2 and 4 of 6 layers); the weights and every run's stored peak are linear in the layers, so the
    plan's are the whole model's to the byte."""
    world, out, said, _ = planned
    plan = PlanResult.read(out / "plan.json")
    assert [probe.layers for probe in plan.probes] == [2, 4] and plan.layers == 6
    assert "plan (2 and 4 of 6 layers probed)" in said and "wrote" in said
    assert plan.weights_bytes == weights_bytes(AutoModelForCausalLM.from_pretrained(world.model))
    replayed = ReplayResult.read(out / "replay.json")
    runs = {"dense": replayed.dense.summary, **{label: run.summary for label, run in replayed.policies.items()}}
    assert plan.stored_peak_bytes == {label: summary.peak_memory_bytes for label, summary in runs.items()}


def test_each_probe_records_its_peak_call_by_call(planned):
    """The probes (same command, same calls) record a peak from each call's start to the next (that it starts
    again: `test_call_peaks_start_again_at_each_call`)."""
    _, out, _, _ = planned
    plan = PlanResult.read(out / "plan.json")
    calls = [probe.call_peak_host_bytes for probe in plan.probes]
    if calls[0] is None:
        pytest.skip("VmHWM cannot start again here (not Linux)")
    assert len(calls[0]) == len(calls[1]) > 2  # one per call and one after the last, alike in both probes


def probe(layers: int, calls: list[int] | None) -> PlanProbe:
    """A probe of `layers` layers whose host peaks call by call are `calls` (MiB)."""
    mib = [2**20 * peak for peak in calls] if calls is not None else None
    return PlanProbe(
        layers=layers,
        seconds=1.0,
        peak_host_bytes=max(mib or [2**20]),
        peak_device_bytes=None,
        process_bytes=0,
        weights_bytes=None,
        stored_peak_bytes={},
        call_peak_host_bytes=mib,
    )


def test_the_planned_peak_follows_each_call_on_its_line():
    """On a cut model a turn's activations (the same on any number of layers) top memory early; on the whole model
    the stores (per layer) top it late. The probes' peaks alone extrapolate the early moment's; call by call, the
    plan follows the late one."""
    early_then_late = [probe(2, [1000, 800]), probe(6, [1100, 1200])]
    assert peak_at_layers(early_then_late, "host", 28) == pytest.approx(2**20 * (800 + 100 * 26))
    overall_only = [probe(2, None), probe(6, None)]
    overall_only[0].peak_host_bytes, overall_only[1].peak_host_bytes = 1000 * 2**20, 1200 * 2**20
    assert peak_at_layers(overall_only, "host", 28) == pytest.approx(2**20 * (1000 + 50 * 26))
    other_calls = [probe(2, [1000, 800]), probe(6, [1100, 1200, 900])]  # not the same calls: the overall line
    assert peak_at_layers(other_calls, "host", 28) == pytest.approx(2**20 * (1000 + 50 * 26))


def test_probes_run_the_threads_the_planning_command_chose(monkeypatch):
    """A probe started right after another would choose its threads from the machine the other just left; it runs
    the planning command's instead (or the command line's --threads)."""
    from kvprof.planning import plan as planning

    lines = []
    monkeypatch.setattr(
        planning, "run_probe", lambda command, line, layers, scratch: lines.append(line) or probe(4, None)
    )
    config = CONFIG_MAPPING["llama"](num_hidden_layers=4)
    planning.make_plan("replay", lambda layers: ["trace.jsonl"], config, "cpu", None, threads=3)
    planning.make_plan("replay", lambda layers: ["trace.jsonl", "--threads", "1"], config, "cpu", None, threads=3)
    assert lines == [["trace.jsonl", "--threads", "3"], ["trace.jsonl", "--threads", "1"]]


@pytest.mark.parametrize("layers, probes", [(28, [2, 6]), (12, [2, 6]), (11, [2, 4]), (5, [2, 4]), (4, [4])])
def test_probes_at_k_and_3k_layers_where_the_line_reaches_far(layers, probes):
    assert probe_layers_for(CONFIG_MAPPING["llama"](num_hidden_layers=layers)) == probes


CALL_PEAKS_RECORDED = """
import sys, torch
from kvprof.profiling import CALL_PEAKS
CALL_PEAKS.record()
if CALL_PEAKS.host is None:
    sys.exit(3)
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed (glibc's defaults: handed back)
del block
CALL_PEAKS.mark()
small = torch.ones(8 * 2**20 // 4)
host, _ = CALL_PEAKS.finish()
print(host[0] - host[1])
"""


def test_call_peaks_start_again_at_each_call():
    """The 64 MiB block freed before the mark counts in the first call's peak, not the second's."""
    done = subprocess.run([sys.executable, "-c", CALL_PEAKS_RECORDED], capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip("VmHWM cannot start again here (not Linux)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 40 * 2**20


def test_the_plan_is_a_dashboard_section(planned, run_cli, tmp_path):
    _, out, _, _ = planned
    code, _, err = run_cli("report", out / "plan.json", "--out", tmp_path / "report.html")
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    assert "Plan of kvprof replay (6 layers)" in page and "plan (2 and 4 of 6 layers probed)" in page


def test_the_plan_predicts_the_peak_memory_and_a_run_shows_it_first(planned):
    _, out, _, ran = planned
    plan = PlanResult.read(out / "plan.json")
    replayed = ReplayResult.read(out / "replay.json")
    assert replayed.envelope and replayed.envelope.environment
    measured = replayed.envelope.environment.peak_host_bytes
    assert measured and abs(plan.peak_bytes["host"] - measured) <= 0.15 * measured
    assert plan.working_bytes > 0 and plan.fits
    assert ran.splitlines()[1].startswith("plan (2 and 4 of 6 layers probed)")


def test_a_run_whose_plan_does_not_fit_is_refused_before_it_loads(six_layers, planned, run_cli, tmp_path, monkeypatch):
    _, trace = six_layers
    _, out, _, _ = planned
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "plan.json").write_text((out / "plan.json").read_text())
    plan = PlanResult.read(folder / "plan.json")
    monkeypatch.setattr("kvprof.planning.plan.free_host_bytes", lambda: plan.peak_bytes["host"] - 1)
    line = ["replay", str(trace), *POLICIES, "--limit", "1", "--repeats", "1", "--device", "cpu", "--out", folder]
    code, _, err = run_cli(*line)
    assert code == 2 and "host memory at its peak" in err, err
    assert "--policy" in err and "--limit" in err and "--kv-budget" in err, err
    assert err.count("\n") == 1 and not (folder / "replay.json").exists()


def test_a_kv_budget_below_one_lockstep_step_is_refused(planned):
    """The dense run's stores stay while the policies compare against its turn: a budget below them and the largest
    policy's cannot hold, and the plan says what would."""
    _, out, _, _ = planned
    plan = PlanResult.read(out / "plan.json")
    stored = dict(plan.stored_peak_bytes)
    floor = stored.pop("dense") + max(stored.values())
    require_budget_floor(dataclasses.replace(plan, kv_budget_bytes=floor))
    with pytest.raises(KvprofError, match=r"below what one step of the replay holds at once .* or more\.$"):
        require_budget_floor(dataclasses.replace(plan, kv_budget_bytes=floor - 1))


@pytest.mark.parametrize(
    "line",
    [
        ["replay", "t.jsonl", "--policy", "fullshared", "--policy=cacheblend", "--repeats", "1", "--online"],
        ["replay", "t.jsonl", "--policy-option", "cacheblend.ratio=0.3", "--kv-budget", "2GiB", "--strict"],
        ["fit-anchors", "t.jsonl", "--rank", "full", "--limit", "3", "--role", "plan=You plan."],
        ["tune-tau", "t.jsonl", "--grid", "0,1", "--no-online", "--max-kl", "0.01"],
    ],
)
def test_a_command_line_is_rebuilt_from_its_parameters(line):
    """What the probes run: the command line of the parameters a command received, parsed again, gives them back."""
    command = get_command(app).commands[line[0]]  # type: ignore[attr-defined]
    params = command.make_context(line[0], line[1:]).params
    rebuilt = arguments_of(line[0], params)
    assert command.make_context(line[0], rebuilt).params == params


@pytest.mark.parametrize(
    "arch, layers, probe",
    [("qwen3_5_text", 8, 4), ("lfm2", 8, 3), ("nemotron_h", 8, 4), ("gemma3_text", 12, 6), ("llama", 4, 2)],
)
def test_a_probe_holds_every_layer_kind_of_a_hybrid(arch, layers, probe):
    """The first layers a probe keeps hold every kind (and at least two layers); the cut config keeps the first
    layers' kinds, a per-layer list's first entries and only the indices below the cut, and builds that model."""
    import torch

    if arch == "lfm2":  # its attention layers as indices
        config = CONFIG_MAPPING[arch](num_hidden_layers=layers, full_attn_idxs=[2, 6])
    elif arch == "nemotron_h":
        kinds = ["mamba", "moe", "attention", "mlp"] * 2
        config = CONFIG_MAPPING[arch](num_hidden_layers=layers, layers_block_type=kinds)
    else:
        config = CONFIG_MAPPING[arch](num_hidden_layers=layers)
    assert smallest_probe(config) == probe
    cut = first_layers_config(config, probe)
    assert cut.num_hidden_layers == probe and config.num_hidden_layers == layers
    assert layer_kinds_of_config(cut) == layer_kinds_of_config(config)[:probe]
    if arch == "lfm2":
        assert cut.full_attn_idxs == [2]
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for name, value in small.items():
        if hasattr(cut, name):
            setattr(cut, name, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cut)
    assert len(model.model.layers) == probe


def test_kv_budget_at_the_command_line(six_layers, run_cli, tmp_path):
    _, trace = six_layers
    line = ["replay", trace, "--policy", "fullshared", "--limit", "1", "--repeats", "1", "--device", "cpu"]
    code, _, err = run_cli(*line, "--kv-budget", "64KiB", "--out", tmp_path / "budget")
    assert code == 0, err
    moved = ReplayResult.read(tmp_path / "budget" / "replay.json").kv_budget
    assert moved and moved["budget_bytes"] == 65536 and moved["parks"] > 0 and moved["moved_bytes"] > 0
    code, _, err = run_cli(*line, "--kv-budget", "lots", "--out", tmp_path / "bad")
    assert code == 2 and "--kv-budget 'lots' is not a size" in err
    code, _, err = run_cli(*line, "--kv-budget", "1GiB", "--ray", "--out", tmp_path / "ray")
    assert code == 2 and "without --ray" in err
