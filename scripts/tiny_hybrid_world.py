"""Write a tiny untrained Qwen 3.5 world (`kvprof.model.tiny.hybrid_config`: three Gated DeltaNet layers, then an
attention layer, as Qwen 3.5 interleaves them) for the documentation's hybrid examples.

    python scripts/tiny_hybrid_world.py OUT                     # a world: model, adapters, workflows, tasks
    python scripts/tiny_hybrid_world.py OUT --like world/model  # a model only, of that model's tokenizer and sizes

With `--like`, OUT/model is a Qwen 3.5 hybrid of the given model's hidden size, heads and vocabulary (random weights)
with its tokenizer, so that a trace captured or imported for that model (the demo world's group chat) can be
inspected as if it were served by a hybrid.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path


def like(out: Path, model: str) -> Path:
    """A Qwen 3.5 hybrid of `model`'s sizes and tokenizer, at OUT/model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3_5TextConfig

    source = AutoConfig.from_pretrained(model)
    head = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    config = Qwen3_5TextConfig(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=4,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=head,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        linear_num_key_heads=source.num_key_value_heads,
        linear_num_value_heads=source.num_attention_heads,
        max_position_embeddings=source.max_position_embeddings,
        eos_token_id=source.eos_token_id,
        bos_token_id=source.bos_token_id,
        pad_token_id=source.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = out / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(model).save_pretrained(path)
    return path


def main() -> None:
    from kvprof.model.tiny import build_tiny_world, hybrid_config

    args = sys.argv[1:]
    if len(args) == 3 and args[1] == "--like":
        print(f"wrote {like(Path(args[0]), args[2])}")
        return
    (out,) = args
    world = build_tiny_world(out, configure=partial(hybrid_config, "qwen3_5_text"))
    print(f"wrote {world.model}, {world.lora_workflow}, {world.tasks}")


if __name__ == "__main__":
    main()
