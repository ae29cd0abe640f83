"""`kvprof rank-analysis` and kvprof.rank.analysis on tiny-world traces: values checked independently, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from kvprof.claims.rank import EXTENSION
from kvprof.commands.rank_analysis import parse_layers
from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.rope import rotate_keys
from kvprof.rank.analysis import agent_sequence, analyze_trace, pair_span, select_agents
from kvprof.traces.trace import Trace, read_trace, write_trace


def _analyze(path, **kwargs):
    trace = read_trace(path)
    agents = load_agents_for_trace(path, device="cpu", dtype="float32")
    names = select_agents(trace, kwargs.pop("names", None))
    return agents, trace, analyze_trace(agents, trace, names, kwargs.pop("layers", [0, 1]), **kwargs)


@pytest.fixture(scope="module")
def lora_analysis(lora_trace):
    return _analyze(lora_trace)


@pytest.fixture(scope="module")
def prompt_analysis(prompt_trace):
    return _analyze(prompt_trace)


def _numpy_effective_rank(matrix: np.ndarray, reference: np.ndarray) -> float:
    """exp(entropy(σ/Σσ)), σ below the fp32 rounding floor of `reference` (numpy's matrix_rank tolerance) zeroed."""
    sigma = scipy.linalg.svdvals(matrix)
    floor = scipy.linalg.svdvals(reference)[0] * max(reference.shape) * np.finfo(np.float32).eps
    sigma = np.where(sigma > floor, sigma, 0.0)
    return float(np.exp(scipy.stats.entropy(sigma / sigma.sum())))


def test_lora_values_match_an_independent_computation(lora_analysis):
    agents, trace, result = lora_analysis
    traj = trace.trajectories[0]
    pair = next(p for p in result.pairs if (p.trajectory, p.source, p.target) == (traj.id, "plan", "act"))
    caches, sequences = {}, {}
    for name in ("plan", "act"):
        turn = [t for t in traj.turns if t.agent == name][-1]
        sequences[name] = traj.input_tokens(turn) + traj.output_tokens(turn)
        with agents.activate(name), torch.no_grad():
            caches[name] = agents.model(input_ids=torch.tensor([sequences[name]])).cache
    # lora mode, append-only layout: the shared span is the common prefix of what both agents hold
    first, second = sequences["plan"], sequences["act"]
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    assert pair.tokens == common
    for layer in (0, 1):
        for kv, attr in (("K", "keys"), ("V", "values")):
            flat = {
                name: getattr(caches[name].layers[layer], attr)[0, :, :common]
                .permute(1, 0, 2)
                .reshape(common, -1)
                .numpy()
                .astype(np.float64)
                for name in caches
            }
            delta = flat["act"] - flat["plan"]
            values = pair.layers[layer][kv].values
            assert values["delta_rank"] == pytest.approx(_numpy_effective_rank(delta, flat["act"]), abs=1e-6)
            assert values["delta_relative"] == pytest.approx(
                np.linalg.norm(delta) / np.linalg.norm(flat["act"]), rel=1e-9
            )
            cos = (
                np.sum(flat["act"] * flat["plan"], 1)
                / np.linalg.norm(flat["act"], axis=1)
                / np.linalg.norm(flat["plan"], axis=1)
            )
            assert values["cache_cosine"] == pytest.approx(cos.mean(), abs=1e-9)


def test_lora_base_caches_agree_at_layer_0_and_adapter_outputs_do_not(lora_analysis):
    _, _, result = lora_analysis
    means = result.layer_means()
    for kv in ("K", "V"):
        # every agent feeds the same embeddings into layer 0, so X·W0 is identical there
        assert means[0][kv]["base_cosine"] == pytest.approx(1.0, abs=1e-6)
        assert abs(means[0][kv]["adapter_cosine"]) < 0.5
        assert means[0][kv]["delta_relative"] > 0.1
    # layer 0, V: the same X feeds both agents, so the adapter output X·A·B·s has rank ≤ r = 4 and
    # Δ = X·(A_j·B_j − A_i·B_i)·s rank ≤ 2r = 8 (the measured values are exactly 4 and 8 on this world)
    for pair in result.pairs:
        values = pair.layers[0]["V"].values
        assert values["adapter_energy99"] <= 4 and values["delta_energy99"] <= 8 and values["delta_rank"] <= 8
    assert {c.paper for c in result.claims()} == {"LRAgent", "KVCMAS"}
    assert all(c.holds is not None for c in result.claims())


def test_prompt_mode_realigns_keys_before_subtracting(prompt_analysis):
    _, trace, result = prompt_analysis
    traj = trace.trajectories[0]
    plan, act = agent_sequence(traj, "plan"), agent_sequence(traj, "act")
    span = pair_span(traj, plan, act)
    assert len(span) and bool((span.shift != 0).all())  # the shared tokens really sit at other positions
    means = result.layer_means()
    for kv in ("K", "V"):
        # layer 0 sees only token embeddings: after re-alignment the two caches agree to rounding, rank 0
        assert means[0][kv]["delta_relative"] < 1e-5
        assert means[0][kv]["delta_rank"] == 0.0 and means[0][kv]["cache_rank"] > 1
        # layer 1 attends over different role prompts: a real, measurable delta
        assert means[1][kv]["delta_relative"] > 1e-3 and means[1][kv]["delta_rank"] > 1
    lragent = [c for c in result.claims() if c.paper == "LRAgent"]
    assert len(lragent) == 1 and lragent[0].holds is None


def _flat(states: torch.Tensor) -> np.ndarray:
    """(H, n, D) → (n, H·D) float64, one row per token."""
    return states.permute(1, 0, 2).reshape(states.shape[1], -1).numpy().astype(np.float64)


def test_prompt_mode_deltas_against_the_context_free_reference(prompt_analysis):
    agents, trace, result = prompt_analysis
    # one record per agent and segment of its pair spans, at the segment's offset in what the agent holds
    expected = {(p.trajectory, name, seg) for p in result.pairs for name in (p.source, p.target) for seg in p.segments}
    assert {(r.trajectory, r.agent, r.segment) for r in result.segments} == expected
    trajectories = {traj.id: traj for traj in trace.trajectories}
    for record in result.segments:
        assert agent_sequence(trajectories[record.trajectory], record.agent).spans[record.segment] == (
            record.start,
            record.start + record.tokens,
        )
    means = result.context_free_means()
    for kv in ("K", "V"):
        # layer 0 sees only token embeddings: the segment's cache is its context-free encoding, re-aligned
        assert means[0][kv]["delta_rank"] == 0.0 and means[0][kv]["delta_relative"] < 1e-5
        assert means[0][kv]["reference_cosine"] == pytest.approx(1.0, abs=1e-6) and means[0][kv]["cache_rank"] > 1
        # layer 1 attends over the role prompt and the context before the segment, which the reference lacks
        assert means[1][kv]["delta_relative"] > 1e-3 and means[1][kv]["delta_rank"] > 1
    # one record, computed independently: the agent's own prefill against the segment prefilled alone
    record = max(result.segments, key=lambda r: (r.start > 0, r.tokens))
    traj = trajectories[record.trajectory]
    turn = [t for t in traj.turns if t.agent == record.agent][-1]
    with torch.no_grad():
        own = agents.model(input_ids=torch.tensor([traj.input_tokens(turn) + traj.output_tokens(turn)])).cache
        alone = agents.model(input_ids=torch.tensor([traj.segments[record.segment].tokens[: record.tokens]])).cache
    rope = agents.ropes[1]
    rows = slice(record.start, record.start + record.tokens)
    for kv, attr in (("K", "keys"), ("V", "values")):
        cache = getattr(own.layers[1], attr)[0, :, rows]
        reference = getattr(alone.layers[1], attr)[0]
        if kv == "K":
            reference = rotate_keys(reference, record.start, rope)
        delta = _flat(cache) - _flat(reference)
        values = record.layers[1][kv].values
        assert values["delta_rank"] == pytest.approx(_numpy_effective_rank(delta, _flat(cache)), abs=1e-5)
        assert values["delta_relative"] == pytest.approx(np.linalg.norm(delta) / np.linalg.norm(_flat(cache)), rel=1e-5)
    # the KVCMAS verdicts name the context-free delta, the paper's quantity; the tiny world's segments are short
    kvcmas = [c for c in result.claims() if c.paper == "KVCMAS"]
    assert len(kvcmas) == 2
    assert all("context-free" in c.quantity and "the paper's quantity" in c.quantity for c in kvcmas)
    assert "context-free reference" in kvcmas[0].statement and EXTENSION not in kvcmas[0].statement
    layer_mean = {kv: sum(means[layer][kv]["delta_rank"] for layer in (0, 1)) / 2 for kv in ("K", "V")}
    assert kvcmas[0].measured == f"K {layer_mean['K']:.2f}, V {layer_mean['V']:.2f}"
    assert "all" in kvcmas[0].detail and "no matrix here can have rank above" in kvcmas[0].detail
    payload = result.to_dict()["context_free"]
    assert [entry["layer"] for entry in payload["layer_means"]] == [0, 1]
    assert len(payload["segments"]) == len(result.segments) and "delta_rank" in payload["metrics"]


def test_lora_mode_labels_the_delta_between_agents_as_kvprofs_extension(lora_analysis):
    _, _, result = lora_analysis
    assert result.segments == [] and result.to_dict()["context_free"] is None
    for claim in result.claims():
        if claim.paper == "KVCMAS":
            assert claim.statement.endswith(f"[{EXTENSION}]") and EXTENSION in claim.quantity
        else:
            assert "the paper's quantity" in claim.quantity


def test_per_head_max_tokens_and_agent_subset(lora_trace):
    _, _, result = _analyze(lora_trace, names=["plan", "reflect"], layers=[1], max_tokens=40, per_head=True)
    assert result.layers == [1] and result.agents == ["plan", "reflect"]
    assert {(p.source, p.target) for p in result.pairs} == {("plan", "reflect")}
    assert all(p.tokens <= 40 and p.bound == min(p.tokens, 16) for p in result.pairs)
    assert all(p.layers[1]["K"].values["delta_rank"] <= 16 for p in result.pairs)


def test_parse_layers():
    assert parse_layers("0,2") == [0, 2] and parse_layers("0-3") == [0, 1, 2, 3]
    assert parse_layers("1, 3-4") == [1, 3, 4] and parse_layers(None) is None
    for bad in ("a", "3-1", "1-"):
        with pytest.raises(KvprofError, match="--layers"):
            parse_layers(bad)


def test_cli_prints_tables_verdicts_and_writes_results(run_cli, lora_trace, tmp_path):
    code, out, err = run_cli("rank-analysis", lora_trace, "--out", tmp_path, "--device", "cpu")
    assert code == 0, err
    assert "effective rank per layer, lora mode" in out and "cross-agent similarity" in out
    assert out.count("LRAgent:") == 2 and out.count("KVCMAS:") == 2
    result = json.loads((tmp_path / "rank_analysis.json").read_text())
    assert result["schema"] == "kvprof.result.rank_analysis" and result["layers"] == [0, 1]
    assert result["mode"] == "lora" and len(result["claims"]) == 4 and len(result["layer_means"]) == 2
    assert {"delta_rank", "base_cosine", "adapter_cosine"} <= set(result["layer_means"][0]["K"])
    assert result["context_free"] is None and all(claim["quantity"] for claim in result["claims"])
    page = (tmp_path / "rank_analysis.html").read_text()
    assert page.count("Plotly.newPlot") == 9 and "published claims" in page  # 3 curves, 2 spectra, 4 heatmaps
    # `kvprof report` renders the same result file
    code, out, err = run_cli("report", tmp_path / "rank_analysis.json", "--out", tmp_path / "dashboard.html")
    assert code == 0, err
    assert "effective rank per layer, lora mode" in out
    assert (tmp_path / "dashboard.html").read_text().count("Plotly.newPlot") == 9


def test_cli_is_deterministic(run_cli, prompt_trace, tmp_path):
    for name in ("a", "b"):
        code, out, err = run_cli(
            "rank-analysis", prompt_trace, "--out", tmp_path / name, "--layers", "1", "--device", "cpu", "--seed", "3"
        )
        assert code == 0, err
        assert "delta against the context-free reference per layer, prompt mode" in out
        assert out.count("KVCMAS: deltas against the context-free reference") == 1
    first, second = (json.loads((tmp_path / name / "rank_analysis.json").read_text()) for name in ("a", "b"))
    assert [entry["layer"] for entry in first["context_free"]["layer_means"]] == [1]
    for key in ("created", "seconds", "args"):  # args differ by --out only
        first.pop(key), second.pop(key)
    for result in (first, second):  # the machine's load while each ran: measured, not computed
        assert set(result["environment"].pop("load")) == {"seconds", "other_cores", "cores", "threads", "contended"}
    assert first == second
    assert (tmp_path / "a/rank_analysis.html").read_text() == (tmp_path / "b/rank_analysis.html").read_text()


def _rewrite(path, out, header=None, trajectories=None):
    trace = read_trace(path)
    return write_trace(out, Trace(header or trace.header, trajectories or trace.trajectories))


def test_bad_input_is_one_clear_error(run_cli, lora_trace, prompt_trace, tmp_path):
    trace = read_trace(lora_trace)
    one_agent = replace(
        trace.header,
        workflow={
            **trace.header.workflow,
            "agents": [a for a in trace.header.workflow["agents"] if a["name"] == "plan"],
        },
    )
    first_turns = [replace(t, turns=t.turns[:1]) for t in trace.trajectories]
    single = _rewrite(lora_trace, tmp_path / "single.jsonl", one_agent, first_turns)
    private = read_trace(prompt_trace)
    for traj in private.trajectories:
        for segment in traj.segments.values():
            segment.scope = "private"
    unshared = write_trace(tmp_path / "unshared.jsonl", private)
    cases = [
        ((single,), "only plan is selected"),
        ((lora_trace, "--agents", "plan"), "only plan is selected"),
        ((lora_trace, "--agents", "plan,critic"), "'critic', which the trace does not have"),
        ((lora_trace, "--layers", "0-5"), "layers 2, 3, 4, 5 are out of range: this model has 2 layers"),
        ((lora_trace, "--layers", "x"), "--layers 'x' is not a list of layer indices"),
        ((lora_trace, "--max-tokens", "0"), "--max-tokens 0 must be at least 1"),
        ((unshared,), "no shared segment is held by two of the agents"),
        ((tmp_path / "missing.jsonl",), "does not exist"),
    ]
    for args, message in cases:
        code, out, err = run_cli("rank-analysis", *args, "--out", tmp_path / "out", "--device", "cpu")
        assert code == 2, (args, out, err)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and message in lines[0], (args, err)
        assert "Traceback" not in err
