"""K/V capture for one agent call, with the LoRA split of every projection and the states a replay needs.

One prefill of `input_ids` as one agent, observed through forward hooks, layer by layer (`capture_turn` parts):

- **kv**: the cache's K and V, keys post-RoPE, per layer (H_kv, L, D).
- **split** (lora mode): each projection's output as X·W0 (+ bias), from peft's `base_layer`, plus s·(X·A)·B, from
  `lora_B[name]`; q/k parts are rotated on their own (RoPE is linear; the key's adapter part at full width). With a
  q/k norm before RoPE (Qwen3, OLMo 2) the split is taken before the norm and RoPE (`ProjectionSplit.normalised`),
  the part a low-rank store shares; a value norm is refused.
- **hidden**: the residual stream entering each layer (where DroidSpeak-style recompute starts).
- **lr**: X·A_k of every loaded adapter k from peft's own `lora_A[k]` (PReCache's precomputed LR caches; with
  `agent=None`, ReBaseShared's neutral X_neut·A_k).

Only the selected layers and the `keep` token range are kept, copied to fp32 as each layer finishes; the forward stops
after the last selected layer. One sequence, no batch axis. DoRA and merged adapters are refused for split and lr.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.architecture import attention_of, decoder_layers
from kvprof.model.lora import QKV, projection_columns, projection_norm

PARTS = ("kv", "split", "hidden", "lr")
ROTATED = {"q_proj", "k_proj"}  # projections RoPE rotates
PER_HEAD = {"q_proj", "k_proj", "v_proj"}  # projections reshaped to (heads, L, D)


@dataclass
class ProjectionSplit:
    """A projection's output on the kept tokens = base X·W0 (+ bias) + adapter Σ s·(X·A)·B (zeros if none), fp32:
    `k_proj` (H_kv, L, D), `q_proj` (H, L, D) post-RoPE; `v_proj` (H_kv, L, D); others (L, out_features)."""

    base: torch.Tensor
    adapter: torch.Tensor
    normalised: bool = False

    @property
    def total(self) -> torch.Tensor:
        """base + adapter: the cached K / V for `k_proj` / `v_proj`, unless `normalised` (then pre-norm, pre-RoPE)."""
        return self.base + self.adapter


@dataclass
class LayerCapture:
    """One layer's capture of the kept tokens, fp32 (unrequested: None / empty): keys, values (H_kv, L, D) as cached;
    hidden (L, d_model); split: projection → `ProjectionSplit`; lr: projection → adapter → X·A (L, r), unscaled."""

    layer: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    split: dict[str, ProjectionSplit] = field(default_factory=dict)
    lr: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class TurnCapture:
    """One prefill as `agent` (None: adapters off): kept `token_ids`, `positions` (L,), `layers` index →
    `LayerCapture` in order."""

    agent: str | None
    token_ids: torch.Tensor
    positions: torch.Tensor
    layers: dict[int, LayerCapture]

    def __len__(self) -> int:
        return int(self.token_ids.numel())


class _Stop(Exception):
    """Raised by the hook of the last selected layer: the rest of the forward is not needed."""


def resolve_layers(layers: Iterable[int] | None, num_layers: int) -> list[int]:
    """Sorted distinct layer indices; None means all. Refuses indices outside [0, num_layers)."""
    if layers is None:
        return list(range(num_layers))
    chosen = sorted({int(layer) for layer in layers})
    bad = [layer for layer in chosen if not 0 <= layer < num_layers]
    if bad:
        what = f"layer {bad[0]} is" if len(bad) == 1 else f"layers {', '.join(map(str, bad))} are"
        raise KvprofError(
            f"{what} out of range: this model has {num_layers} layers (0-{num_layers - 1}); "
            "pass --layers within that range."
        )
    if not chosen:
        raise KvprofError("no layers selected; pass --layers with at least one layer index.")
    return chosen


def _projection(layer: torch.nn.Module, name: str, index: int) -> tuple[torch.nn.Module, slice | None]:
    """The module computing projection `name` in a layer and its columns (`kvprof.model.lora.projection_columns`)."""
    if name in QKV:
        return projection_columns(attention_of(layer, index), name, index)
    found = [(path, module) for path, module in layer.named_modules() if path.rsplit(".", 1)[-1] == name]
    if not found:
        present = sorted(
            {path.rsplit(".", 1)[-1] for path, module in layer.named_modules() if _is_projection(path, module)}
        )
        raise KvprofError(f"layer {index} has no projection {name!r}; its projections are {', '.join(present)}.")
    return min(found, key=lambda item: len(item[0]))[1], None


def _is_projection(path: str, module: torch.nn.Module) -> bool:
    """A model linear layer (plain or LoRA wrapper), not a LoRA layer's part."""
    inside_lora = any(part == "base_layer" or part.startswith("lora_") for part in path.split("."))
    return not inside_lora and (isinstance(module, torch.nn.Linear) or _is_lora(module))


def _is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _normalised(attention: torch.nn.Module, name: str, index: int) -> bool:
    """Whether the projection is normalised before RoPE (split taken before the norm); refuses a value norm."""
    if projection_norm(attention, name) is None:
        return False
    if name == "v_proj":
        raise KvprofError(
            f"layer {index} normalises v_proj before caching, so its cached values do not split into base + adapter; "
            "this model's cache cannot be split."
        )
    return True


def _check_plain_lora(module: torch.nn.Module, name: str, index: int) -> None:
    if _is_lora(module):
        if getattr(module, "merged", False):
            raise KvprofError(
                f"layer {index} {name}: the LoRA adapter is merged into the weights, so its output "
                "cannot be split; load the adapters unmerged."
            )
        if getattr(module, "lora_variant", None):
            raise KvprofError(
                f"layer {index} {name}: a LoRA variant ({', '.join(module.lora_variant)}, e.g. DoRA) "
                "has no separate adapter output; kvprof splits plain LoRA adapters only."
            )


class _LayerRecorder:
    """Forward hooks of one selected layer: each projection's input, base output and adapter outputs."""

    def __init__(self, index: int, layer: torch.nn.Module, keep: slice):
        self.index, self.layer, self.keep = index, layer, keep
        self.modules: dict[str, torch.nn.Module] = {}
        self.columns: dict[str, slice] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] = {}
        self.adapter: dict[str, torch.Tensor] = {}
        self.normalised: set[str] = set()
        self.result = LayerCapture(layer=index)

    def hooks(self, projections: Sequence[str], want_split: bool) -> list:
        handles = []
        attention = attention_of(self.layer, self.index)
        for name in projections:
            module, columns = _projection(self.layer, name, self.index)
            if want_split and _normalised(attention, name, self.index):
                self.normalised.add(name)
            _check_plain_lora(module, name, self.index)
            self.modules[name] = module
            self.columns[name] = columns or slice(None)
            base = module.base_layer if _is_lora(module) else module
            handles.append(base.register_forward_hook(self._on_base(name)))
            if want_split and _is_lora(module):
                for adapter, lora_b in module.lora_B.items():
                    handles.append(lora_b.register_forward_hook(self._on_lora_b(name, module.scaling[adapter])))
        return handles

    def _on_base(self, name: str):
        def hook(module, args, output):
            self.inputs[name] = args[0]
            self.base[name] = output[..., self.columns[name]]

        return hook

    def _on_lora_b(self, name: str, scaling: float):
        def hook(module, args, output):
            part = output[:, self.keep, self.columns[name]].float() * scaling  # kept tokens only, summed in fp32
            self.adapter[name] = self.adapter[name] + part if name in self.adapter else part

        return hook


class _Capture:
    """State shared by the hooks of one `capture_turn` call."""

    def __init__(
        self,
        agents: AgentSet,
        keep: slice,
        positions: torch.Tensor,
        last_layer: int,
    ):
        self.agents, self.keep, self.positions = agents, keep, positions
        self.ropes = agents.ropes  # found before any hook is attached (finding them runs the model)
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(Rope) → its cos, sin at the kept tokens
        self.last_layer = last_layer

    def span(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Kept tokens of `tensor` along `axis`, copied to fp32."""
        index = [slice(None)] * tensor.dim()
        index[axis] = self.keep
        return tensor[tuple(index)].float().clone()

    def shape(self, flat: torch.Tensor, name: str, layer: int, kept: bool = False, rotate: bool = True) -> torch.Tensor:
        """(1, L, out) → `ProjectionSplit` layout of the kept tokens, fp32 (q/k rotated unless `rotate` is False)."""
        rows = flat[0].float() if kept else self.span(flat[0], 0)
        if name not in PER_HEAD:
            return rows
        per_head = rows.view(rows.shape[0], -1, self.agents.cache_shapes[layer][1]).transpose(0, 1)
        if name in ROTATED and rotate:
            rope = self.ropes[layer]
            if id(rope) not in self.tables:
                self.tables[id(rope)] = rope.tables(self.positions[self.keep])
            per_head = rope.rotate(per_head, *self.tables[id(rope)])
        return per_head.contiguous()


def _check_parts(agents: AgentSet, parts: Sequence[str] | None) -> Sequence[str]:
    """The parts to capture (default: all the mode has), refused in one sentence when unknown or not in this mode."""
    lora = agents.spec.mode == "lora"
    if parts is None:
        parts = PARTS if lora else ("kv", "hidden")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise KvprofError(f"unknown capture part {', '.join(sorted(unknown))}; use {', '.join(PARTS)}.")
    if ("split" in parts or "lr" in parts) and not lora:
        raise KvprofError("the 'split' and 'lr' parts need LoRA agents (lora mode); this agent set is in prompt mode.")
    return parts


def _check_input(
    device: torch.device,
    input_ids: Sequence[int] | torch.Tensor,
    positions: torch.Tensor | None,
    keep: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The input ids (L,), their positions (L,) and the kept token range, refused in one sentence when they do not
    fit together."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)
    length = ids.numel()
    if length == 0:
        raise KvprofError("capture_turn got an empty input; pass at least one token.")
    pos = torch.arange(length, device=device) if positions is None else torch.as_tensor(positions, device=device)
    if pos.shape != (length,):
        raise KvprofError(f"positions has shape {tuple(pos.shape)}, expected ({length},): one position per token.")
    start, end = keep if keep is not None else (0, length)
    if not 0 <= start < end <= length:
        raise KvprofError(f"keep=({start}, {end}) is not a token range inside the {length}-token input.")
    return ids, pos, (start, end)


def capture_turn(
    agents: AgentSet,
    agent: str | None,
    input_ids: Sequence[int] | torch.Tensor,
    layers: Iterable[int] | None = None,
    parts: Sequence[str] | None = None,
    projections: Sequence[str] = ("k_proj", "v_proj"),
    positions: torch.Tensor | None = None,
    keep: tuple[int, int] | None = None,
    lr_adapters: Sequence[str] | None = None,
) -> TurnCapture:
    """Prefill `input_ids` (L,) as `agent` (None: adapters off) and capture `parts` → `TurnCapture` (fp32, on the
    model's device).

    parts: "kv", "split", "hidden", "lr" (default: all the mode has); positions (L,): default 0..L−1 (pass them after
    an uncached prefix); keep: (start, end); lr_adapters: default every adapter targeting the projection."""
    parts = _check_parts(agents, parts)
    ids, pos, (start, end) = _check_input(agents.device, input_ids, positions, keep)
    length = ids.numel()
    blocks = decoder_layers(agents.base_model)
    chosen = resolve_layers(layers, len(blocks))
    adapter_names = list(agents.adapters) if lr_adapters is None else list(lr_adapters)
    missing = set(adapter_names) - set(agents.adapters)
    if missing:
        raise KvprofError(f"unknown adapter {', '.join(sorted(missing))}; loaded: {', '.join(agents.adapters)}.")

    state = _Capture(agents, slice(start, end), pos, chosen[-1])

    from transformers import DynamicCache

    from kvprof.model.latent import oriented

    cache = oriented(DynamicCache(config=agents.config), agents.latent)
    recorders = {index: _LayerRecorder(index, blocks[index], state.keep) for index in chosen}
    handles = []
    try:
        for index, recorder in recorders.items():
            handles += _register(blocks[index], recorder, state, cache, parts, projections, adapter_names)
        with agents.activate(agent), torch.no_grad():  # not inference_mode: callers may update the tensors
            try:
                agents.base_model.get_decoder()(
                    input_ids=ids[None], position_ids=pos[None], cache=cache, use_cache=True
                )
            except _Stop:
                pass
    except torch.OutOfMemoryError:
        raise KvprofError(
            f"capturing a {length}-token input ran out of memory; select fewer --layers, lower "
            "--max-tokens, or use a larger device."
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    return TurnCapture(
        agent=agent,
        token_ids=ids[start:end].clone(),
        positions=pos[start:end].clone(),
        layers={index: recorders[index].result for index in chosen},
    )


def _register(
    block: torch.nn.Module,
    recorder: _LayerRecorder,
    state: _Capture,
    cache,
    parts: Sequence[str],
    projections: Sequence[str],
    adapters: list[str],
) -> list:
    """Hook one decoder layer for a capture; returns the hook handles."""
    handles = recorder.hooks(projections, "split" in parts) if "split" in parts or "lr" in parts else []
    if "hidden" in parts:
        handles.append(block.register_forward_pre_hook(_hidden_hook(state, recorder), with_kwargs=True))
    handles.append(block.register_forward_hook(_finish_hook(state, recorder, cache, parts, projections, adapters)))
    return handles


def _down_projection(module: torch.nn.Module, adapter: str, x: torch.Tensor) -> torch.Tensor:
    """X·A of one adapter, computed as peft computes it in its forward (dropout is the identity in eval)."""
    lora_a = module.lora_A[adapter]
    return lora_a(module.lora_dropout[adapter](x.to(lora_a.weight.dtype)))


def _hidden_hook(state: _Capture, recorder: _LayerRecorder):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        recorder.result.hidden = state.span(hidden[0], 0)

    return hook


def _finish_hook(
    state: _Capture,
    recorder: _LayerRecorder,
    cache,
    parts: Sequence[str],
    projections: Sequence[str],
    adapter_names: Sequence[str],
):
    """After a selected layer: copy its K/V from the cache, build the splits and LR activations, drop the rest."""

    def hook(module, args, output):
        index, result = recorder.index, recorder.result
        if "kv" in parts:
            cached = cache.layers[index]
            if cached.keys.shape[-2] != state.positions.numel():
                raise KvprofError(
                    f"layer {index} keeps only {cached.keys.shape[-2]} of the {state.positions.numel()} "
                    "input tokens in its cache (sliding window); pass a shorter input (--max-tokens)."
                )
            result.keys = state.span(cached.keys[0], 1)
            result.values = state.span(cached.values[0], 1)
        for name, module_ in recorder.modules.items():
            if "split" in parts:
                normalised = name in recorder.normalised
                base = state.shape(recorder.base[name], name, index, rotate=not normalised)
                adapter = recorder.adapter.get(name)  # already cut to the kept tokens
                result.split[name] = ProjectionSplit(
                    base=base,
                    adapter=(
                        torch.zeros_like(base)
                        if adapter is None
                        else state.shape(adapter, name, index, kept=True, rotate=not normalised)
                    ),
                    normalised=normalised,
                )
            if "lr" in parts and _is_lora(module_):
                result.lr[name] = {
                    adapter: state.span(_down_projection(module_, adapter, recorder.inputs[name])[0], 0)
                    for adapter in adapter_names
                    if adapter in module_.lora_A
                }
        recorder.inputs.clear()
        recorder.base.clear()
        recorder.adapter.clear()
        if index == state.last_layer:
            raise _Stop

    return hook
