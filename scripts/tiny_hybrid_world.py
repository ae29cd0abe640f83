"""Write a tiny untrained Qwen 3.5 world (three Gated DeltaNet layers, then an attention layer, as Qwen 3.5
interleaves them; the sizes of tests/test_hybrid.py) for the documentation's hybrid example.

    python scripts/tiny_hybrid_world.py OUT
"""

from __future__ import annotations

import sys


def qwen3_5(vocab: int, eos: int):
    from transformers import Qwen3_5TextConfig

    from kvprof.model.tiny import tiny_sizes

    linear = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2}
    return Qwen3_5TextConfig(**tiny_sizes(vocab, eos, layers=4), head_dim=16, linear_num_value_heads=4, **linear)


def main() -> None:
    from kvprof.model.tiny import build_tiny_world

    (out,) = sys.argv[1:]
    world = build_tiny_world(out, configure=qwen3_5)
    print(f"wrote {world.model}, {world.lora_workflow}, {world.tasks}")


if __name__ == "__main__":
    main()
