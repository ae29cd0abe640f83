"""vLLM's hybrid block size B for public hybrid models, from the sizes their published configs give (written here),
on one GPU with bf16 weights and K/V: the table of docs/models.md, "Checkpointed prefix reuse on hybrids".

    python scripts/hybrid_block_sizes.py

A recurrent layer's state as vLLM stores it (vllm-project/vllm `vllm/model_executor/layers/mamba/mamba_utils.py`,
commit 2afe1e8573cf51b73569ae1d35f59078a2032a91, `MambaStateShapeCalculator`): a Gated DeltaNet layer keeps a
convolution state of (kernel - 1) x (2 * key heads * key size + value heads * value size) and a state of value heads
x key size x value size; a Mamba-2 layer a convolution state of (kernel - 1) x (heads * head size + 2 * groups *
state size) and a state of heads x head size x state size. The convolution state is in the model's dtype; the other
in the dtype the config asks for (`mamba_ssm_dtype`, `mamba_ssm_cache_dtype`), else the model's. (At the commit read,
a Gated DeltaNet layer keeps both in the model's dtype, which gives Qwen3.5-4B B = 272; the 528 vLLM 0.19.1 logs for
it is what an fp32 state gives, so the table follows the config's `mamba_ssm_dtype` and shows both.) One attention layer
keeps 2 * KV heads * head size * 2 bytes per token. B comes from both through
`kvprof.traces.checkpoints.vllm_hybrid_block_size`. Where vLLM's own log of B is public, the table's last column
names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprof.traces.checkpoints import vllm_hybrid_block_size

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Hybrid:
    """A hybrid's recurrent layer (`state_bytes`) and attention layer (KV heads x head size), and where from."""

    name: str
    layer: str
    state_bytes: int
    kv_heads: int
    head_size: int
    source: str
    logged: str = ""

    @property
    def token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_size * BF16

    @property
    def block(self) -> int:
        return vllm_hybrid_block_size(self.state_bytes, self.token_bytes)


def gated_deltanet(key_heads: int, value_heads: int, key_size: int, value_size: int, kernel: int, state: int) -> int:
    conv = (kernel - 1) * (2 * key_heads * key_size + value_heads * value_size) * BF16
    return conv + value_heads * key_size * value_size * state


def mamba2(heads: int, head_size: int, groups: int, state_size: int, kernel: int, state: int) -> int:
    conv = (kernel - 1) * (heads * head_size + 2 * groups * state_size) * BF16
    return conv + heads * head_size * state_size * state


MODELS = (
    Hybrid(
        "Qwen3.5-4B",
        "Gated DeltaNet: 16 key, 32 value heads of 128, kernel 4; fp32 state",
        gated_deltanet(16, 32, 128, 128, 4, FP32),
        4,
        256,
        "config.json (hidden 2560, 32 layers, `mamba_ssm_dtype` float32), read from a published copy: "
        "huggingface.co/halen214/st01",
        "528 (vllm-project/vllm#40696)",
    ),
    Hybrid(
        "Qwen3.5-4B, bf16 state",
        "the same, the state in the model's dtype",
        gated_deltanet(16, 32, 128, 128, 4, BF16),
        4,
        256,
        "as above",
    ),
    Hybrid(
        "Qwen3.5-27B",
        "Gated DeltaNet: 16 key, 48 value heads of 128, kernel 4; fp32 state",
        gated_deltanet(16, 48, 128, 128, 4, FP32),
        4,
        256,
        "model card of a quantization of Qwen/Qwen3.5-27B (24 query, 4 KV heads of 256, 48 DeltaNet layers); 48 "
        "value heads of 128 x 128; 16 key heads: Modular MAX's Qwen3_5Config",
        "784 on Qwen3.6-27B, the same shapes (vllm-project/vllm#36010)",
    ),
    Hybrid(
        "Granite-4.0-H-Micro",
        "Mamba-2: 64 heads of 64, state 128, 1 group, kernel 4; bf16 state",
        mamba2(64, 64, 1, 128, 4, BF16),
        8,
        64,
        "config.json (hidden 2048, 40 layers of which 4 attention, 32 query and 8 KV heads), read from a published "
        "copy: huggingface.co/anuj6316/granite",
    ),
    Hybrid(
        "Nemotron-H-8B",
        "Mamba-2: 128 heads of 64, state 128, 8 groups, kernel 4; bf16 state",
        mamba2(128, 64, 8, 128, 4, BF16),
        8,
        128,
        "NemotronHConfig's defaults (NemotronH-v0.1: hidden 4096, 52 layers; 32 query and 8 KV heads of 128), "
        "vLLM's and transformers' config class",
    ),
    Hybrid(
        "Nemotron-H-8B, fp32 SSM cache",
        "the same, `mamba_ssm_cache_dtype` float32",
        mamba2(128, 64, 8, 128, 4, FP32),
        8,
        128,
        "as above",
    ),
)


def main() -> None:
    print("| model | recurrent layer | state bytes | K/V bytes per token | B | vLLM's own log |")
    print("|---|---|---:|---:|---:|---|")
    for model in MODELS:
        print(
            f"| {model.name} | {model.layer} | {model.state_bytes:,} | {model.token_bytes:,} | {model.block} | "
            f"{model.logged or '–'} |"
        )
    print()
    for model in MODELS:
        print(f"- {model.name}: {model.source}")


if __name__ == "__main__":
    main()
