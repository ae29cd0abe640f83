"""An independent oracle of the published delta-correction algorithms (issue #32), run on the tensors kvprof runs on.

The oracle's math is written here from reading the authors' public code, not from kvprof:

- KVCOMM (delsiiin/KVCOMM at 38e6251, `KVCOMM/llm/kvcomm_engine.py`): the gate (`predict_as_anchor`: softmax over
  anchors of −‖X_V − A_V‖₂ over every layer, entropy −Σ w·log2(w + 1e-40) in float32, refused when it exceeds
  γ·log2 N or fewer than two anchors cover the candidate; the top-p activation cut-off), the per-token K and V weights
  (`_compute_anchor_weight_entry`: softmax of −mean |X − A| over layers, heads and dims), the correction
  (`offset_kv_cache_pair`: reference + Σ w·Δ_reader, layer 0 kept), pool admission and eviction (`set_anchor`'s
  `len > max_anchor_num` check before inserting, `update_anchor`'s first least-activated of the oldest `window`), and
  the reference of an agent's output (`gpt_chat.py`, `agen_kvcomm`: the response cache rotated back to position 0).
- KVCMAS (hjeon2k/KVCMAS at e2170cf, `KVCMAS/llm/kvcmas_engine.py`): the same weights and gate, the correction of a
  chained reference by Σ w·(Δ_reader − Δ_source), and one truncated SVD per layer of the (S × H_kv·D) matrix
  (`_svd_compress_delta` / `_rsvd_batched`: r·(S + H_kv·D) parameters per layer).

Modulo the deviations kvprof's policy docstrings list (exact SVD instead of the randomized range finder: the factors'
error is compared with the optimal one, not the factors; keys in the segment's frame; the candidate of a chained
reference compared with the anchor's cache of the same owner, base + Δ_source). The oracle imports none of kvprof's
math helpers; kvprof's pool, policies and replay only supply the identical inputs and the values under test. Inputs:
(a) a pool fitted by `kvprof.tuning.anchor_fit.fit_pool` on two trajectories of the demo's prompt world, with candidates
from a third, and dense caches recomputed here with the model's own forward and a RoPE written here; (b) synthetic
anchors at nearly equal distances (entropy near its maximum, where the gate's threshold and ties decide).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import kvprof
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant
from kvprof.policies.anchors import AnchorPool, Match
from kvprof.policies.delta import Decision, DeltaContext, DeltaCorrection, SharedSegment
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import read_trace
from kvprof.tuning.anchor_fit import fit_pool, observed_segments, truncated

TRACE = Path(kvprof.__file__).parent / "demo" / "assets" / "sample_traces" / "prompt_tune.jsonl"
FIT, HELD_OUT = (0, 1), 2  # the pool is fitted on two trajectories; candidates come from a third
ENTROPY_EPS = 1e-40  # KVCOMM predict_as_anchor's entropy_eps
TOP_P = 0.9  # KVCOMM predict_as_anchor's top_p
GAMMAS = (0.0, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0)
GATE_TOL = 1e-6  # gate weights and normalized entropy
KV_TOL = 1e-5  # relative Frobenius error of corrected / reference K and V


# ------------------------------------------------------------------------------------------ the oracle


def oracle_gate(candidate_values: torch.Tensor, anchor_values: list[torch.Tensor], gamma: float):
    """KVCOMM `predict_as_anchor` on a candidate (layers, H, L, D) and the anchors' values (each at least L long):
    (weights (N,) float32, H(w)/log2 N in float64, accepted). The decision is made as the code makes it, in float32:
    refused when fewer than two anchors, or when −Σ w·log2(w + ε) > γ·log2(N)."""
    length = candidate_values.shape[-2]
    if len(anchor_values) < 2:
        return None, 1.0, False
    stacked = torch.stack([a[..., :length, :] for a in anchor_values]).float()
    # the code's float32 norm over every dim but the anchors'; a float64 distance moves w by up to ~1e-6 here: the
    # distances are O(100) and softmax(−d) sees their float32 rounding
    diff = (candidate_values.float().unsqueeze(0) - stacked).norm(2, dim=tuple(range(1, stacked.dim())))
    weights = torch.softmax(-diff, dim=0)
    entropy32 = -(weights * (weights + ENTROPY_EPS).log2()).sum()
    refused = bool(entropy32 > gamma * torch.log2(torch.tensor(len(anchor_values))))
    w64 = weights.double()
    entropy64 = float(-(w64 * torch.log2(w64 + ENTROPY_EPS)).sum()) / math.log2(len(anchor_values))
    return weights, entropy64, not refused


def oracle_token_weights(candidate: torch.Tensor, anchors: list[torch.Tensor]) -> torch.Tensor:
    """KVCOMM `_compute_anchor_weight_entry` (placeholder part, temperature 1): per token, softmax over anchors of
    −mean |X − A| over layers, heads and head dims. candidate (layers, H, L, D) → (N, L)."""
    length = candidate.shape[-2]
    rows = []
    for anchor in anchors:
        difference = (candidate.double() - anchor[..., :length, :].double()).abs()
        rows.append(difference.permute(2, 0, 1, 3).reshape(length, -1).mean(dim=1))
    return torch.softmax(-torch.stack(rows), dim=0)


def oracle_corrected(
    reference: torch.Tensor, weights: torch.Tensor, reader_deltas: list[torch.Tensor], source_deltas: list[torch.Tensor]
) -> torch.Tensor:
    """reference + Σ_n w_n·(Δ_reader − Δ_source)_n per token on layers 1.., layer 0 the reference (KVCOMM
    `offset_kv_cache_pair` with Δ_source = 0; KVCMAS chain). reference (layers, H, L, D), weights (N, L)."""
    length = reference.shape[-2]
    total = torch.zeros(reference.shape, dtype=torch.float64)
    for w, reader, source in zip(weights, reader_deltas, source_deltas):
        term = (reader[..., :length, :] if reader.dim() else reader).double()
        term = term - (source[..., :length, :] if source.dim() else source).double()
        total += w.double()[None, None, :, None] * term
    out = reference.double() + total
    out[0] = reference[0].double()
    return out


class CodeSlot:
    """One placeholder's anchors as KVCOMM's `set_anchor` / `update_anchor` / `predict_as_anchor` keep them: an
    insertion-ordered message → activation count."""

    def __init__(self, capacity: int, window: int):
        self.capacity, self.window = capacity, window
        self.info: OrderedDict[str, int] = OrderedDict()

    def set_anchor(self, message: str) -> None:
        if len(self.info) > self.capacity:  # checked on every call, before inserting
            oldest = list(self.info.items())[: self.window]
            counts = [count for _, count in oldest]
            del self.info[oldest[counts.index(min(counts))][0]]  # the first least-activated
        if message not in self.info:
            self.info[message] = 0

    def activate(self, messages: list[str], weights: list[float]) -> None:
        """The accepted gate's cut-off: sorted by weight, every position up to the last whose cumulative weight is
        still below top_p; all of them when none is."""
        order = sorted(range(len(weights)), key=lambda i: -weights[i])
        cumulative, below = 0.0, []
        for position, index in enumerate(order):
            cumulative += weights[index]
            if cumulative < TOP_P:
                below.append(position)
        cutoff = below[-1] if below else len(order) - 1
        for index in order[: cutoff + 1]:
            self.info[messages[index]] += 1


def rope_shift(keys: torch.Tensor, shift: int, theta: float) -> torch.Tensor:
    """Llama RoPE (`rotate_half` pairing) rotating keys (..., L, D) by `shift` positions."""
    dim = keys.shape[-1]
    angles = shift / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = torch.cat([angles.cos()] * 2).float(), torch.cat([angles.sin()] * 2).float()
    half = dim // 2
    return keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


class DenseWorld:
    """Dense caches computed here: the model's own forward over an agent's prefix and a timeline, rows of a segment
    rotated back to positions 0..L−1."""

    def __init__(self, agents, runtime: Runtime):
        self.model = agents.model
        config = self.model.config
        parameters = getattr(config, "rope_parameters", None) or {}
        self.theta = float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.runtime = runtime
        self.names = [agent.name for agent in agents.spec.agents]

    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            cache = self.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        keys = torch.stack([layer.keys[0] for layer in cache.layers])
        values = torch.stack([layer.values[0] for layer in cache.layers])
        return keys, values  # (layers, H, T, D)

    def segment(self, prefix: list[int], tokens: list[int], start: int, end: int):
        keys, values = self.forward(prefix + tokens[:end])
        begin = len(prefix) + start
        rows = slice(begin, begin + end - start)
        return rope_shift(keys[..., rows, :], -begin, self.theta), values[..., rows, :]

    def common_prefix(self) -> list[int]:
        """The tokens every agent's prefix starts with (else BOS): what kvprof encodes an input after (its listed
        deviation from the code's template header)."""
        common: list[int] = []
        for column in zip(*(self.runtime.prefix(name) for name in self.names)):
            if len(set(column)) > 1:
                break
            common.append(column[0])
        bos = self.model.config.bos_token_id
        return common or ([bos] if bos is not None else [])

    def trajectory(self, traj) -> dict:
        """Per segment name: its SharedSegment and, per agent (None: the context-free encoding), (K, V)."""
        observed = observed_segments(self.runtime, traj)
        timeline = max((item.sequence for item in observed), key=len)
        assert all(timeline[: len(item.sequence)] == item.sequence for item in observed)  # one timeline
        full = {name: self.forward(self.runtime.prefix(name) + timeline) for name in self.names}
        common = self.common_prefix()
        out = {}
        for segment in (item.segment for item in observed):
            caches = {}
            for name in self.names:
                begin = len(self.runtime.prefix(name)) + segment.start
                keys, values = full[name]
                caches[name] = (
                    rope_shift(keys[..., begin : begin + segment.length, :], -begin, self.theta),
                    values[..., begin : begin + segment.length, :],
                )
            keys, values = self.forward(common + timeline[segment.start : segment.end])
            caches[None] = (
                rope_shift(keys[..., len(common) :, :], -len(common), self.theta),
                values[..., len(common) :, :],
            )
            out[segment.name] = (segment, caches)
        return out


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def agents():
    return load_agents_for_trace(TRACE, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def trajectories():
    return read_trace(TRACE).trajectories


@pytest.fixture(scope="module")
def world(agents, trajectories):
    """(runtime, the fitted full-dimensional pool, the oracle's dense caches of the fitted trajectories' segments by
    anchor name, the held-out trajectory's by slot)."""
    runtime = Runtime(agents)
    pool = fit_pool(runtime, [trajectories[i] for i in FIT], capacity=10)
    dense = DenseWorld(agents, runtime)
    fitted = {}
    for index in FIT:
        fitted.update(dense.trajectory(trajectories[index]))
    held = {segment.slot: (segment, caches) for segment, caches in dense.trajectory(trajectories[HELD_OUT]).values()}
    return runtime, pool, fitted, held


def stored(anchor, agent: str | None, part: int) -> torch.Tensor:
    """The pool's raw tensor (full-dimensional) or the oracle's product of its per-layer factors (U (layers, S, r),
    V (layers, r, H·D), columns h·D + d): the anchor's base (agent None) or agent's delta."""
    parts = (anchor.base_keys, anchor.base_values) if agent is None else anchor.deltas[agent]
    kept = parts[part]
    if kept.full is not None:
        return kept.full.float()
    product = kept.u.double() @ kept.v.double()  # (layers, S, H·D)
    return product.unflatten(-1, (kept.heads, -1)).transpose(1, 2).float()


def stored_cache(anchor, agent: str | None, part: int) -> torch.Tensor:
    """C_agent = base + Δ_agent from the pool's stored tensors (the base itself for its owner)."""
    base = stored(anchor, None, part)
    return base if agent == anchor.owner else base + stored(anchor, agent, part)


def policy(runtime: Runtime, name: str, **options: str) -> DeltaCorrection:
    built = PolicyVariant(name, options).build(runtime)
    assert isinstance(built, DeltaCorrection)
    return built


def candidates(pool: AnchorPool, held: dict, chain: bool):
    """(slot, source, reader, candidate (K, V) truncated to the slot's shortest anchor, segment) for every slot of the
    pool with two anchors: KVComm's references (an output's producer, an input's context-free encoding) or, with
    `chain`, KVCMAS's chained reference of an input (another reader's cache)."""
    for slot, anchors in pool.slots.items():
        if slot not in held or len(anchors) < 2:
            continue
        segment, caches = held[slot]
        length = min([segment.length] + [a.length for a in anchors])
        agents = sorted(set(anchors[0].agents()))
        if segment.is_output:
            sources = [segment.producer]
        elif chain:
            sources = agents
        else:
            sources = [None]
        for source in sources:
            keys, values = caches[source]
            for reader in agents:
                if reader != source:
                    yield slot, source, reader, (keys[..., :length, :], values[..., :length, :]), segment


# ------------------------------------------------------------------------------------------ 1. gate


def test_gate_and_entropy_on_the_fitted_pool(world):
    """KVComm's and KVCMAS's gate decision and normalized entropy on a candidate from a held-out trajectory, against
    the fitted pool's anchors (their caches of the candidate's owner), for a sweep of thresholds."""
    runtime, pool, _, held = world
    kvcomm = {gamma: policy(runtime, "kvcomm", gamma=str(gamma)) for gamma in GAMMAS}
    kvcmas = {gamma: policy(runtime, "kvcmas", tau=str(gamma)) for gamma in GAMMAS}
    worst_weight = worst_entropy = 0.0
    decisions = set()
    for slot, source, _, candidate, segment in {c[:2]: c for c in candidates(pool, held, chain=False)}.values():
        match = pool.match(slot, candidate, source, (), 1.0, per_token=False)
        anchor_values = [stored_cache(a, source, 1) for a in pool.slots[slot]]
        for gamma in GAMMAS:
            weights, entropy, accepted = oracle_gate(candidate[1], anchor_values, gamma)
            assert [a.name for a in match.anchors] == [a.name for a in pool.slots[slot]]
            worst_weight = max(worst_weight, float((match.weights - weights).abs().max()))
            worst_entropy = max(worst_entropy, abs(match.entropy - entropy))
            assert kvcomm[gamma].accepts(match) == accepted, (slot, gamma, entropy)
            if segment.is_output:
                assert kvcmas[gamma].accepts(match) == accepted, (slot, gamma, entropy)
            decisions.add(accepted)
    print(f"gate (fitted pool): max |Δw| {worst_weight:.2e}, max |ΔH/log2N| {worst_entropy:.2e}")
    assert worst_weight <= GATE_TOL and worst_entropy <= GATE_TOL
    assert decisions == {True, False}  # the sweep reaches both verdicts


def synthetic_pool(distances: list[float], length: int = 5, layers: int = 4):
    """Anchors at exactly the given Frobenius distances from a zero candidate (one-hot directions), owned by agent
    "a", each with random deltas for "b" and "c"; plus one anchor shorter than the candidate (never eligible)."""
    generator = torch.Generator().manual_seed(7)
    shape = (layers, 2, length, 4)
    pool = AnchorPool(10, 5, None)
    for index, distance in enumerate(distances):
        keys, values = torch.zeros(shape), torch.zeros(shape)
        values.view(-1)[index * 7] = distance
        keys.view(-1)[index * 5 + 1] = distance * 0.5
        keys += 1e-3 * torch.randn(shape, generator=generator)
        anchor = pool.add("s", f"n{index}", "a", keys, values)
        for agent in ("b", "c"):
            pool.add_delta(
                anchor,
                agent,
                keys + torch.randn(shape, generator=generator),
                values + torch.randn(shape, generator=generator),
            )
    short_shape = (layers, 2, length - 1, 4)
    short = pool.add("s", "short", "a", torch.zeros(short_shape), torch.zeros(short_shape))
    pool.add_delta(short, "b", torch.ones(short_shape), torch.ones(short_shape))
    return pool, (torch.zeros(shape), torch.zeros(shape))


@pytest.mark.parametrize(
    "distances, accepted_at_one",
    [
        ([4.0, 4.02, 3.98, 4.01, 4.03], True),  # near-uniform: entropy just below its maximum
        ([4.0, 4.0, 4.0, 4.0], True),  # exactly uniform, N = 4: H = log2 N exactly, a tie, which accepts
        ([4.0, 4.0, 4.0], False),  # exactly uniform, N = 3: w = 1/3 rounds up, H is a hair above log2 3
        ([4.0], False),  # one anchor (the short one does not cover the candidate): always refused
    ],
)
def test_gate_near_uniform(world, distances, accepted_at_one):
    """Gate weights, entropy and verdicts where the entropy is at or near its maximum (γ = 1 is the tie), and on both
    sides of the threshold just around the entropy."""
    runtime = world[0]
    pool, candidate = synthetic_pool(distances, layers=runtime.num_layers)
    match = pool.match("s", candidate, "a", (), 1.0, per_token=False)
    anchor_values = [a.base_values.full for a in pool.slots["s"] if a.length >= candidate[1].shape[-2]]
    weights, entropy, accepted = oracle_gate(candidate[1], anchor_values, 1.0)
    assert len(match.anchors) == len(distances) and accepted == accepted_at_one
    if weights is not None:
        print(f"gate (near-uniform {len(distances)}): |Δw| {float((match.weights - weights).abs().max()):.2e}, "
              f"|ΔH| {abs(match.entropy - entropy):.2e}, H/log2N = {entropy:.9f}")  # fmt: skip
        assert torch.allclose(match.weights, weights, rtol=0, atol=GATE_TOL)
        assert abs(match.entropy - entropy) <= GATE_TOL
        assert entropy > 0.999
    edges = [entropy - 1e-5, entropy + 1e-5] if weights is not None and entropy < 1 - 1e-5 else []
    for gamma in [0.3, 0.999, 1.0, *edges]:
        accepted = oracle_gate(candidate[1], anchor_values, gamma)[2]
        assert policy(runtime, "kvcomm", gamma=repr(gamma)).accepts(match) == accepted, gamma
        assert policy(runtime, "kvcmas", tau=repr(gamma)).accepts(match) == accepted, gamma


# ------------------------------------------------------------------------------------------ 2. corrected K/V


def check_correction(runtime, pool, held, name, options, chain):
    """Per-token K/V weights and the corrected K/V of every (slot, source, reader) against the oracle, on the pool's
    stored tensors (test_chained_comparison_tensor checks them against the oracle's dense forwards)."""
    delta_policy = policy(runtime, name, **options)
    worst = {"weights": 0.0, "kv": 0.0}
    checked = 0
    for slot, source, reader, candidate, segment in candidates(pool, held, chain):
        match = pool.match(slot, candidate, source, (reader,), 1.0, per_token=True)
        anchors = pool.slots[slot]
        decision = Decision(segment, source, candidate, True, True, match=match)
        corrected = delta_policy.corrected_kv(reader, decision, DeltaContext(kv=[], reused=0))
        for part in (0, 1):
            compared = [stored_cache(a, source, part) for a in anchors]
            zero = torch.zeros(())
            reader_deltas = [zero if reader == a.owner else stored(a, reader, part) for a in anchors]
            source_deltas = [zero if source == a.owner else stored(a, source, part) for a in anchors]
            weights = oracle_token_weights(candidate[part], compared)
            kvprof_weights = match.value_weights if part else match.key_weights
            worst["weights"] = max(worst["weights"], float((kvprof_weights.double() - weights).abs().max()))
            expected = oracle_corrected(candidate[part], weights, reader_deltas, source_deltas)
            worst["kv"] = max(worst["kv"], rel(corrected[part], expected))
            assert torch.equal(corrected[part][0], candidate[part][0])  # layer 0 untouched
            assert rel(corrected[part], candidate[part]) > 1e-3  # the correction does something
        checked += 1
    print(f"{name} {options}: {checked} corrections, "
          f"max |Δw| {worst['weights']:.2e}, max rel K/V {worst['kv']:.2e}")  # fmt: skip
    assert checked >= 10
    assert worst["weights"] <= GATE_TOL and worst["kv"] <= KV_TOL


@pytest.mark.parametrize(
    "name, options, chain",
    [("kvcomm", {}, False), ("kvcmas", {"chain": "chain"}, True)],
)
def test_corrected_kv_on_the_fitted_pool(world, name, options, chain):
    """Full-dimensional anchors: KVComm (reference + Σ w·Δ_reader) and KVCMAS chain (Σ w·(Δ_reader − Δ_source))."""
    runtime, pool, _, held = world
    if name == "kvcmas":
        options = {**options, "rank": "1000"}  # corrected_kv takes the pool's tensors; the rank only counts FLOPs
    check_correction(runtime, pool, held, name, options, chain)


def test_corrected_kv_low_rank_kvcmas(world):
    """KVCMAS's rank-r pool: the fused low-rank correction (per-token weights folded into U's rows) against the
    oracle's sum over the reconstructed factors."""
    runtime, pool, _, held = world
    check_correction(runtime, truncated(pool, 8), held, "kvcmas", {"chain": "chain", "rank": "8"}, True)


def test_corrected_kv_near_uniform(world):
    runtime = world[0]
    pool, (keys, values) = synthetic_pool([4.0, 4.02, 3.98, 4.01], layers=world[0].num_layers)
    generator = torch.Generator().manual_seed(3)
    candidate = (keys + 0.1 * torch.randn(keys.shape, generator=generator), values)
    segment = SharedSegment(0, 5, "a", "s", "x", "out")
    match = pool.match("s", candidate, "a", ("b",), 1.0, per_token=True)
    anchors = match.anchors
    corrected = policy(runtime, "kvcomm").corrected_kv(
        "b", Decision(segment, "a", candidate, True, True, match=match), DeltaContext(kv=[], reused=0)
    )
    for part in (0, 1):
        stored = [(a.base_values if part else a.base_keys).full for a in anchors]
        reader = [a.deltas["b"][part].full for a in anchors]
        weights = oracle_token_weights(candidate[part], stored)
        got = match.value_weights if part else match.key_weights
        expected = oracle_corrected(candidate[part], weights, reader, [torch.zeros_like(d) for d in reader])
        print(f"near-uniform correction part {part}: |Δw| {float((got.double() - weights).abs().max()):.2e}, "
              f"rel K/V {rel(corrected[part], expected):.2e}")  # fmt: skip
        assert float((got.double() - weights).abs().max()) <= GATE_TOL
        assert rel(corrected[part], expected) <= KV_TOL
        assert torch.equal(corrected[part][0], candidate[part][0])


# ------------------------------------------------------------------------------------------ 3. references


@pytest.mark.parametrize(
    "name, options",
    [("kvcomm", {}), ("kvcmas", {"chain": "chain"}), ("kvcmas", {"chain": "star"})],
)
def test_reference_of_a_segment(world, agents, trajectories, monkeypatch, name, options):
    """Replayed with an empty frozen pool (every gate refuses: every cache is dense), each decision's reference is
    the cache the code corrects from: an output's producer's in-context cache rotated back to positions 0..L−1; an
    input's context-free encoding (KVComm), its first reader's cache (KVCMAS star) or its previous reader's (KVCMAS
    chain), recomputed here by a dense forward."""
    runtime = world[0]
    recorded = []
    original = DeltaCorrection.decide

    def spy(self, agent, segment, shared, context):
        decision = original(self, agent, segment, shared, context)
        recorded.append((agent, list(shared), decision))
        return decision

    monkeypatch.setattr(DeltaCorrection, "decide", spy)
    traj = trajectories[HELD_OUT]
    replay_trace(agents, [traj], [PolicyVariant(name, {**options, "pool": "frozen"})])
    dense = DenseWorld(agents, runtime)
    runtime.serve_trajectory(traj)
    common = dense.common_prefix()
    readers: dict[str, list[str]] = {}
    worst, kinds = 0.0, set()
    for agent, shared, decision in recorded:
        segment = decision.segment
        assert not decision.corrected  # all dense
        history = readers.setdefault(segment.name, [segment.producer])
        if segment.is_output or options.get("chain") == "star":
            owner = segment.producer
        elif name == "kvcmas":
            owner = history[-1]
        else:
            owner = None
        assert decision.source == owner
        if owner is None:
            keys, values = dense.forward(common + shared[segment.start : segment.end])
            expected = (
                rope_shift(keys[..., len(common) :, :], -len(common), dense.theta),
                values[..., len(common) :, :],
            )
        else:
            expected = dense.segment(runtime.prefix(owner), shared, segment.start, segment.end)
        for got, want in zip(decision.reference, expected):
            assert got.shape == want.shape
            worst = max(worst, rel(got, want))
        if segment.is_output:
            encoded = dense.forward(common + shared[segment.start : segment.end])[1][..., len(common) :, :]
            assert rel(decision.reference[1], encoded) > 1e-2  # not the context-free encoding
        kinds.add((segment.is_output, owner == segment.producer))
        history.append(agent)
    print(f"{name} {options}: {len(recorded)} references, max rel K/V {worst:.2e}")
    assert worst <= KV_TOL
    assert (True, True) in kinds and any(not output for output, _ in kinds)
    if options.get("chain") == "chain":
        assert (False, False) in kinds  # some input is read from a reader other than its producer


# ------------------------------------------------------------------------------------------ 4. chained comparison


def test_chained_comparison_tensor(world):
    """An anchor's cache of agent s (what a chained candidate owned by s is compared with) is base + Δ_s: the
    oracle's own dense forward of s on the anchor's trajectory, for every anchor and agent; and the gate weights of
    a chained candidate are the oracle's against those caches, not against the bare bases."""
    _, pool, fitted, held = world
    worst = 0.0
    for anchors in pool.slots.values():
        for anchor in anchors:
            caches = fitted[anchor.name][1]
            for agent in ([] if anchor.owner else [None]) + anchor.agents():
                for part in (0, 1):
                    got = anchor.cache(agent, anchor.length, bool(part))
                    worst = max(worst, rel(got, caches[agent][part]))
    print(f"anchor caches vs dense forwards: max rel {worst:.2e}")
    assert worst <= KV_TOL
    differs = 0
    for slot, source, _, candidate, segment in {c[:2]: c for c in candidates(pool, held, chain=True)}.values():
        if segment.is_output:
            continue
        match = pool.match(slot, candidate, source, (), 1.0, per_token=False)
        anchor_values = [stored_cache(a, source, 1) for a in pool.slots[slot]]
        weights = oracle_gate(candidate[1], anchor_values, 0.3)[0]
        assert torch.allclose(match.weights, weights, rtol=0, atol=GATE_TOL)
        bare = oracle_gate(candidate[1], [a.base_values.full for a in pool.slots[slot]], 0.3)[0]
        differs += not torch.allclose(match.weights, bare, rtol=0, atol=1e-4)
    assert differs > 0  # like for like matters on this pool


# ------------------------------------------------------------------------------------------ 5. low-rank factors


@pytest.mark.parametrize("rank", [4, 32])
def test_low_rank_factors_are_per_layer_and_optimal(world, rank):
    """Per layer, one rank-r factorisation of the (S × H_kv·D) matrix (column h·D + d): r_eff·(S + H_kv·D) parameters
    with r_eff = min(r, S, H_kv·D), and the reconstruction error of the best rank-r approximation (Eckart–Young:
    sqrt of the tail singular energy), however the factors are found."""
    runtime, pool, *_ = world
    low = truncated(pool, rank)
    layers, heads, head_dim = runtime.num_layers, runtime.kv_heads, runtime.head_dim
    parameters = worst = 0
    for slot, anchors in pool.slots.items():
        for anchor, factored in zip(anchors, low.slots[slot]):
            parts = [(anchor.base_keys, factored.base_keys), (anchor.base_values, factored.base_values)]
            for agent, pair in anchor.deltas.items():
                parts += list(zip(pair, factored.deltas[agent]))
            for full, stored in parts:
                tensor = full.full
                length = tensor.shape[-2]
                keep = min(rank, length, heads * head_dim)
                per_layer = [stored.u[layer].numel() + stored.v[layer].numel() for layer in range(layers)]
                assert per_layer == [keep * (length + heads * head_dim)] * layers
                parameters += sum(per_layer)
                rebuilt = stored.dense(length)
                for layer in range(layers):
                    matrix = tensor[layer].permute(1, 0, 2).reshape(length, heads * head_dim).double()
                    approx = rebuilt[layer].permute(1, 0, 2).reshape(length, heads * head_dim).double()
                    sigma = torch.linalg.svdvals(matrix)
                    optimal = float(sigma[keep:].pow(2).sum().sqrt())
                    error = float(torch.linalg.vector_norm(matrix - approx))
                    scale = max(float(torch.linalg.vector_norm(matrix)), 1e-30)  # layer 0's deltas are 0
                    worst = max(worst, abs(error - optimal) / scale)
    print(f"rank {rank}: max |error − optimal| / ‖M‖ {worst:.2e}")
    assert worst <= 1e-5
    assert low.nbytes() == parameters * 4  # float32


# ------------------------------------------------------------------------------------------ 6. eviction


def test_eviction_after_a_scripted_sequence():
    """V = 3, window 2: adds and accepted matches, against KVCOMM's set_anchor / update_anchor / top-p cut-off."""
    pool, code = AnchorPool(3, 2, None), CodeSlot(3, 2)
    tiny = torch.zeros(1, 1, 2, 2)

    def add(name):
        pool.add("s", name, "a", tiny, tiny)
        code.set_anchor(name)

    def activate(names, weights):
        anchors = [pool.anchor("s", name) for name in names]
        AnchorPool.activate(Match(anchors, "a", torch.tensor(weights), 0.0))
        code.activate(names, weights)

    def state():
        return [(a.name, a.activations) for a in pool.slots["s"]]

    script = [
        lambda: [add(f"a{i}") for i in range(4)],  # the check precedes the insert: V + 1 = 4 anchors
        lambda: activate(["a0", "a1", "a2", "a3"], [0.05, 0.5, 0.3, 0.15]),  # cumsum .5 .8 .95: a1, a2 only
        lambda: add("a4"),  # oldest two a0 (0), a1 (1): a0 goes
        lambda: activate(["a1", "a2", "a3", "a4"], [0.92, 0.03, 0.03, 0.02]),  # top alone ≥ 0.9: all four
        lambda: add("a5"),  # oldest two a1 (2), a2 (2): a tie, the first goes
        lambda: activate(["a3", "a5"], [0.4, 0.6]),  # a5 alone (cumsum .6), a3 crosses 0.9
        lambda: add("a6"),  # a2 (2), a3 (1): a3 goes
        lambda: add("a7"),  # a2 (2), a4 (1): a4 goes though a6 (0) is less activated, outside the window
        lambda: activate(["a2", "a5", "a6", "a7"], [0.3, 0.35, 0.2, 0.15]),  # cumsum .35 .65 .85: three
    ]
    for step in script:
        step()
        assert state() == list(code.info.items())
    assert state() == [("a2", 3), ("a5", 2), ("a6", 1), ("a7", 0)]


def test_eviction_when_a_second_reader_adds_its_delta():
    """KVCOMM's set_anchor checks the slot's size on every dense reader's call, also when it only adds that reader's
    delta to an existing anchor: a slot at V + 1 loses one more anchor per further reader."""
    pool, code = AnchorPool(2, 2, None), CodeSlot(2, 2)
    tiny = torch.zeros(1, 1, 2, 2)
    for name in ("b0", "b1", "b2"):
        anchor = pool.add("s", name, "a", tiny, tiny)
        code.set_anchor(name)
    pool.trim("s")  # a second reader of b2, computed densely: DeltaCorrection.learn checks the size first
    pool.add_delta(anchor, "c", tiny, tiny)
    code.set_anchor("b2")
    assert [a.name for a in pool.slots["s"]] == list(code.info)
