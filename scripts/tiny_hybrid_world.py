"""Write a tiny untrained Qwen 3.5 world (`kvprof.model.tiny.hybrid_config`: three Gated DeltaNet layers, then an
attention layer, as Qwen 3.5 interleaves them) for the documentation's hybrid example.

    python scripts/tiny_hybrid_world.py OUT
"""

from __future__ import annotations

import sys
from functools import partial


def main() -> None:
    from kvprof.model.tiny import build_tiny_world, hybrid_config

    (out,) = sys.argv[1:]
    world = build_tiny_world(out, configure=partial(hybrid_config, "qwen3_5_text"))
    print(f"wrote {world.model}, {world.lora_workflow}, {world.tasks}")


if __name__ == "__main__":
    main()
