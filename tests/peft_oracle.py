"""Oracles computed apart from kvprof, for the adapter and architecture tests: a capture is the model's own greedy
generation (peft's, with each agent's adapter loaded here; the base model's in prompt mode), and re-aligning a
cached key is the model's own key at the other position."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvprof.traces.trace import read_trace

SHIFT = 29  # positions the re-alignment oracle moves an input by


def assert_peft_generations(model: Path, adapters: dict[str, Path], out: Path, capture: str = "capture") -> None:
    """Every turn of the trace captured to OUT/CAPTURE is the model's own greedy generation with its agent's adapter
    (loaded here, apart from kvprof), token for token; with no `adapters` (prompt mode), the base model's."""
    from peft import PeftModel

    trace = read_trace(out / capture / "trace.jsonl")
    generator = AutoModelForCausalLM.from_pretrained(model)
    if adapters:
        first, *others = adapters
        generator = PeftModel.from_pretrained(generator, adapters[first], adapter_name=first)
        for agent in others:
            generator.load_adapter(adapters[agent], adapter_name=agent)
    turns = 0
    for trajectory in trace.trajectories:
        for turn in trajectory.turns:
            if adapters:
                generator.set_adapter(turn.agent)
            output = trajectory.output_tokens(turn)
            ids = torch.tensor([trajectory.input_tokens(turn)])
            generated = generator.generate(ids, max_new_tokens=len(output), do_sample=False)[0, ids.shape[1] :]
            assert generated.tolist() == output, (trajectory.id, turn.agent)
            turns += 1
    assert turns >= 6


def assert_keys_realign(model: Path, layers: list) -> None:
    """For every attention layer of `model` (`layers`: its `kvprof.model.rope.LayerRopes`, recurrent layers skipped):
    the keys the model caches for an input at positions SHIFT.. are kvprof's re-rotation of those it caches at
    0.. by SHIFT (its own RoPE, or none), to float32 rounding, while the keys do move (the check is not empty)."""
    from kvprof.model.latent import latent_layers, oriented
    from kvprof.model.rope import rotate_keys

    base = AutoModelForCausalLM.from_pretrained(model).eval()
    ids = torch.arange(3, 40)[None]
    caches = []
    for start in (0, SHIFT):
        cache = oriented(DynamicCache(config=base.config), latent_layers(base))
        with torch.inference_mode():
            base(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None], cache=cache)
        caches.append(cache)
    moved = 0
    for index, (at_start, shifted) in enumerate(zip(*(cache.layers for cache in caches))):
        if not hasattr(at_start, "keys"):  # a recurrent layer
            continue
        realigned = rotate_keys(at_start.keys, SHIFT, layers[index])
        assert (realigned - shifted.keys).norm() <= 1e-4 * shifted.keys.norm(), index
        moved += int((at_start.keys - shifted.keys).norm() > 1e-2 * shifted.keys.norm())
    assert moved > 0
