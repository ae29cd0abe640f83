"""The oracle of a capture: peft's own generation, on adapters loaded apart from kvprof (for the adapter and
architecture tests)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM

from kvprof.trace import read_trace


def assert_peft_generations(model: Path, adapters: dict[str, Path], out: Path) -> None:
    """Every turn of the trace captured to OUT/capture is peft's own greedy generation on `model` with its agent's
    adapter (loaded here, apart from kvprof), token for token."""
    import torch
    from peft import PeftModel

    trace = read_trace(out / "capture" / "trace.jsonl")
    first, *others = adapters
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model), adapters[first], adapter_name=first
    )
    for agent in others:
        peft_model.load_adapter(adapters[agent], adapter_name=agent)
    turns = 0
    for trajectory in trace.trajectories:
        for turn in trajectory.turns:
            peft_model.set_adapter(turn.agent)
            output = trajectory.output_tokens(turn)
            ids = torch.tensor([trajectory.input_tokens(turn)])
            generated = peft_model.generate(ids, max_new_tokens=len(output), do_sample=False)[0, ids.shape[1] :]
            assert generated.tolist() == output, (trajectory.id, turn.agent)
            turns += 1
    assert turns >= 6
