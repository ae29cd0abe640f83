"""DroidSpeak: reuse the shared cache; recompute a contiguous block of critical layers for every reused token.

Paper: DroidSpeak (Liu et al., 2024; arXiv:2411.02820), the selective-recompute baseline of LRAgent, PReCache (30 %
ratio) and KVCMAS (ρ = 0.9, 0.8). The block is recomputed from the hidden states entering
it (the residual stream the token's first processing agent left, stored: d_model per token, counted in memory; none
for a block at layer 0), with the acting agent's adapter and positions, over the blended cache; every other layer's
K/V are reused. Approximate: outside the block the K/V are another agent's, and the block starts from another
agent's hidden state (exact only at layer 0). LRAgent reports it up to 2.6 points below NonShared.

- `ratio` R: a block of max(1, round(R·layers)) layers for R > 0 (R = 0: FullShared; R = 1: NonShared); on few layers
  the ratio run is a multiple of 1/layers (0.25 on the 4-layer demo for R = 0.1–0.3), reported as measured.
- The block (kvprof's proxy, approximate): the window with the largest summed deviation ‖C_reused − C_dense‖² /
  ‖C_dense‖² over K and V of the reused span in a layer profile; DroidSpeak profiles each layer's effect on task
  quality offline. `profile=FILE` loads one, `profile_out=FILE` writes one; without one the first trajectory
  replayed calibrates (every reused layer recomputed: exact, charged to TTFT, recompute ratio 1) and the block is
  chosen when the next starts.
- Moved spans (`kvprof.policies.moved`) are served re-aligned; the block starts from the hidden states their source
  turn held, used at the reader's positions as they are (as DroidSpeak reuses a sender's), and for the new tokens
  between them from their own forward.

Phases: TTFT — FullShared's context, the block's recompute; decode — one token (its block-entry hidden state kept);
after the turn — FullShared's commit and the new tokens' hidden states stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvprof.claims.papers import DROIDSPEAK, LRAGENT, LRAGENT_SETTING
from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.fileio import NUMBER, check_fields, is_json, read_json_file, write_json
from kvprof.model.buffers import GrowingTensor
from kvprof.model.runtime import ChunkForward, Runtime
from kvprof.policies.fullshared import FullSharedContext
from kvprof.policies.options import Option
from kvprof.policies.selective import Blend, SelectiveRecompute, ratio_option
from kvprof.policies.turns import Chunk

PROFILE_KIND = "kvprof.droidspeak-profile"
PROFILE_VERSION = 1


@dataclass
class LayerProfile:
    """Per-layer cache deviation of reused K/V against the agent's own: `error[l]` = Σ‖C_reused − C_dense‖² and
    `norm[l]` = Σ‖C_dense‖² over K and V of the reused spans of `turns` calibration turns."""

    error: list[float]
    norm: list[float]
    turns: int = 0

    @classmethod
    def empty(cls, layers: int) -> LayerProfile:
        return cls([0.0] * layers, [0.0] * layers)

    @property
    def deviation(self) -> list[float]:
        """Relative squared deviation per layer."""
        return [error / norm if norm else 0.0 for error, norm in zip(self.error, self.norm)]

    def add(self, other: LayerProfile) -> None:
        self.error = [a + b for a, b in zip(self.error, other.error)]
        self.norm = [a + b for a, b in zip(self.norm, other.norm)]
        self.turns += other.turns

    def block(self, size: int) -> tuple[int, int]:
        """The `size` consecutive layers [start, start + size) with the largest summed deviation (first on ties)."""
        deviation = self.deviation
        sums = [sum(deviation[start : start + size]) for start in range(len(deviation) - size + 1)]
        start = max(range(len(sums)), key=lambda index: (sums[index], -index))
        return start, start + size

    def to_json(self, model: str) -> dict:
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            "model": model,
            "layers": len(self.error),
            "turns": self.turns,
            "deviation": self.deviation,
            "error": self.error,
            "norm": self.norm,
        }

    @classmethod
    def read(cls, path: str, layers: int) -> LayerProfile:
        """A profile written by `profile_out`; refused if it is not one or has another number of layers."""
        fix = "pass a file written by --policy-option droidspeak.profile_out=FILE"
        payload = read_json_file(path, "DroidSpeak profile", fix)
        if not isinstance(payload, dict) or payload.get("kind") != PROFILE_KIND:
            raise KvprofError(f"{path} is not a DroidSpeak layer profile; {fix}.")
        if payload.get("layers") != layers:
            raise KvprofError(
                f"DroidSpeak profile {path} is for a model with {payload.get('layers')} layers, this one has "
                f"{layers}; profile this model (droidspeak.profile_out=FILE)."
            )
        check_fields(payload, {"error": list, "norm": list, "turns": int}, f"DroidSpeak profile {path}", fix)
        error, norm = payload["error"], payload["norm"]
        if not (len(error) == len(norm) == layers and all(is_json(x, NUMBER) for x in error + norm)):
            raise KvprofError(f"DroidSpeak profile {path} does not hold {layers} numbers in error and norm; {fix}.")
        return cls([float(x) for x in error], [float(x) for x in norm], payload["turns"])


@dataclass
class DroidSpeakContext(FullSharedContext):
    """states: block-entry hidden states of the turn's new tokens, (first timeline index, (1, n, d_model)) per
    forward or span; pieces: those of new tokens between moved spans; calibration: this turn's layer deviations."""

    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    calibration: LayerProfile | None = None


class DroidSpeak(SelectiveRecompute):
    name = "droidspeak"
    paper = DROIDSPEAK
    options = {
        "ratio": ratio_option("0.2", "the share of layers recomputed (a contiguous block)"),
        "profile": Option(
            "", labelled=False, help="a layer profile (JSON) to choose the block from; empty: profile on the replay"
        ),
        "profile_out": Option(
            "", labelled=False, help="write the layer profile (JSON) the policy profiled to this file"
        ),
    }
    published = (
        Published(
            LRAGENT, "main results, accuracy", LRAGENT_SETTING, "accuracy drop up to 2.6 points against NonShared"
        ),
    )
    context_type = DroidSpeakContext
    timeline_state = (*SelectiveRecompute.timeline_state, "states")
    # Without a profile file it profiles on the first trajectory it replays and uses that block for the others.
    trajectory_independent = False
    calibrating = False  # set by __init__; reset() runs first, from SharingPolicy.__init__

    @classmethod
    def independent_of_trajectories(cls, options: dict[str, str]) -> bool:
        """With a profile file it profiles nothing: each trajectory is replayed alone."""
        return bool(options.get("profile"))

    def __init__(self, runtime: Runtime, **options: str):
        super().__init__(runtime, **options)
        layers = runtime.num_layers
        self.size = 0 if self.ratio == 0 else max(1, min(layers, round(self.ratio * layers)))
        self.profile = LayerProfile.empty(layers)
        self.block: tuple[int, int] = (0, self.size)
        self.calibrating = False
        if 0 < self.size < layers:
            if self.settings["profile"]:
                self.profile = LayerProfile.read(str(self.settings["profile"]), layers)
                self.block = self.profile.block(self.size)
            else:
                self.calibrating = True
                self.block = (0, layers)

    def notes(self) -> list[str]:
        start, end = self.block
        layers = self.runtime.num_layers
        block = f"layer {start}" if end - start == 1 else f"layers {start}–{end - 1}"
        ran = f"recomputes {block} of {layers} (ratio {self.size / layers:.2f} of layers)"
        if not 0 < self.size < layers:
            return [f"{ran}; no profile needed"]
        if self.settings["profile"]:
            return [f"{ran}, chosen from the profile {self.settings['profile']} ({self.profile.turns} turns)"]
        if self.calibrating:
            return [
                f"profiled on this replay: its only trajectory was calibration ({self.profile.turns} turns that "
                "reused a cache, served by recomputing every layer); pass a profile (droidspeak.profile=FILE) or "
                "more trajectories"
            ]
        return [
            f"{ran}, chosen from a profile of this replay's first trajectory ({self.profile.turns} turns that reused "
            "a cache, served by recomputing every layer and counted in its results); pass droidspeak.profile=FILE "
            "to use a profile from other trajectories"
        ]

    @property
    def needs_hidden(self) -> bool:
        return self.block[0] > 0

    def forget_spans(self) -> None:
        super().forget_spans()
        self.kept_states: dict[int, tuple[int, torch.Tensor]] = {}  # source turn -> (lo, (1, hi − lo, d_model))

    def keep_span_source(self, turn: int, lo: int, hi: int) -> None:
        """Also keep the turn's block-entry hidden states, for moved spans read later."""
        super().keep_span_source(turn, lo, hi)
        if self.needs_hidden and self.states is not None:
            self.kept_states[turn] = (lo, self.states.view(hi)[:, lo:hi].clone())

    def piece_hook(self, context: FullSharedContext) -> Callable[[int, ChunkForward], None] | None:
        if not self.needs_hidden:
            return None
        assert isinstance(context, DroidSpeakContext)
        start = self.block[0]

        def keep(begin: int, forward: ChunkForward) -> None:
            assert forward.residual is not None
            context.pieces.append((begin, forward.residual[start][:1]))

        return keep

    def extended_states(self, context: DroidSpeakContext) -> list[tuple[int, torch.Tensor]]:
        """Block-entry hidden states of the context past its reused tokens, in order: new tokens' from their forwards,
        a moved span's as its source turn held them (not re-aligned)."""
        spans = {(span.begin, span.end): span for span in self.moved_now}
        parts = list(context.pieces)
        for begin, end in context.moved_spans:
            span = spans[(begin, end)]
            lo, states = self.kept_states[span.source]
            parts.append((begin, states[:, span.source_begin - lo : span.source_begin - lo + end - begin]))
        return sorted(parts, key=lambda part: part[0])

    def reset(self) -> None:
        super().reset()
        self.states: GrowingTensor | None = None  # (1, ≥ N, d_model): hidden states entering the block, per token
        if self.calibrating and self.profile.turns:
            self.calibrating = False
            self.block = self.profile.block(self.size)

    def recomputes(self) -> bool:
        return self.size > 0

    def recompute(self, blend: Blend, ids: list[int], context: FullSharedContext) -> None:
        assert isinstance(context, DroidSpeakContext)
        start, end = self.block
        count = len(ids)
        positions = blend.positions(count)
        if start == 0:
            hidden = self.stack.embed(ids)
        else:
            assert self.states is not None  # needs_hidden: every stored token's state was kept
            extended = self.extended_states(context)
            hidden = torch.cat([self.states.view(context.reused), *(states for _, states in extended)], dim=1)
        if not self.calibrating:
            blend.carry(start, end, hidden, positions)
            return
        before = [  # copies: the blend overwrites the reused span in place
            tuple(blend.reused(layer, side, count).float().clone() for side in (0, 1)) for layer in range(start, end)
        ]
        blend.carry(start, end, hidden, positions)
        profile = LayerProfile.empty(self.runtime.num_layers)
        profile.turns = 1
        for layer, reused in zip(range(start, end), before):
            for side in (0, 1):
                dense = blend.reused(layer, side, count).float()
                profile.error[layer] += float((reused[side] - dense).pow(2).sum())
                profile.norm[layer] += float(dense.pow(2).sum())
        context.calibration = profile

    def on_prefill(self, agent: str, context: FullSharedContext, forward: ChunkForward, start: int) -> float:
        self._keep_states(context, forward, start)
        return 0.0

    def on_decode_step(self, agent: str, context: FullSharedContext, forward: ChunkForward, start: int) -> float:
        self._keep_states(context, forward, start)
        return 0.0

    def _keep_states(self, context: FullSharedContext, forward: ChunkForward, start: int) -> None:
        """Keep the hidden states entering the block of the forward's tokens the store does not hold yet."""
        if forward.residual is None:
            return
        assert isinstance(context, DroidSpeakContext)
        skip = max(len(self.producers) - start, 0)
        states = forward.residual[self.block[0]][:1, skip:]
        if states.shape[1]:
            context.states.append((start + skip, states))

    def make_room(self, agent: str, shared: list[int]) -> None:
        super().make_room(agent, shared)
        if self.states is not None:
            self.states.make_room(self.with_output(len(shared)))

    def commit(self, chunk: Chunk[FullSharedContext]) -> float:
        flops = super().commit(chunk)
        context = chunk.context
        assert isinstance(context, DroidSpeakContext)
        extended = self.extended_states(context) if self.needs_hidden else []
        for first, states in [*extended, *context.states]:
            if self.states is None:
                self.states = GrowingTensor.of(states, 1)
            else:
                self.states.write(first, states)
        if context.calibration is not None:
            self.profile.add(context.calibration)
            if self.settings["profile_out"]:
                write_json(
                    str(self.settings["profile_out"]),
                    self.profile.to_json(str(self.runtime.agents.base_model.config.name_or_path)),
                )
        return flops

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().live_tensors()
        if self.states is not None:
            tensors["hidden states"] = [self.states.view(len(self.producers))]
        if self.kept_states:
            tensors["moved spans' hidden states"] = [states for _, states in self.kept_states.values()]
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        sizes = super().analytic_bytes()
        runtime = self.runtime
        if self.states is not None:
            sizes["hidden states"] = len(self.producers) * runtime.hidden_size * runtime.dtype.itemsize
        if self.kept_states:
            tokens = sum(states.shape[1] for _, states in self.kept_states.values())
            sizes["moved spans' hidden states"] = tokens * runtime.hidden_size * runtime.dtype.itemsize
        return sizes
