"""A tiny, untrained world built locally from a config: tokenizer, model, LoRA adapters, tasks, workflows.

For tests and trying commands offline: outputs are noise, every code path is real. `ARCHITECTURES` (same sizes,
tokenizer, adapters, tasks, workflows), each exercising a code path:

- `llama` (default): no biases, RoPE θ = 10⁴.
- `qwen2`: random non-zero q/k/v biases (an initialised Qwen2's are zero); θ = 10⁶.
- `mistral`: sliding window (`MISTRAL_WINDOW`) longer than any sequence: full-attention results through sliding
  masks and cache layers; θ = 10⁶.
- `qwen3`: per-head q_norm / k_norm before RoPE; head size 16 apart from hidden / heads; θ = 10⁶.
- `phi`: partial rotary (half of each head), random biases on every attention projection, `dense` output,
  LayerNorm, parallel attention and MLP.
- `phi3`: fused `qkv_proj`, adapted as one module, split by column blocks.

    python -m kvprof.model.tiny DIR [ARCH]   # writes DIR/model, DIR/adapters/{plan,act,reflect},
                                       DIR/adapters_shared_a/..., # DIR/tasks.jsonl,
                                       # DIR/workflow_lora.toml, DIR/workflow_prompt.toml
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvprof.model.architecture import attention_of, decoder_layers, recurrent_of

AGENTS = ("plan", "act", "reflect")
ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "phi", "phi3")
MISTRAL_WINDOW = 4096  # tokens; longer than any sequence the tiny world produces
# A tiny multi-head latent attention layer (DeepSeek V3, Kimi K2): a 32-channel cached latent, an 8-channel RoPE
# key, 16-channel heads, each query head its own expanded key and value head (as the real configs have it), one
# expert group
MLA_SIZES = dict(
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
    n_group=1,
    topk_group=1,
)
BIAS_STD = 0.1  # of the random q/k/v biases, comparable to X·W0 (std ≈ 0.16 in the tiny model)
CORPUS = [
    "Question: Where was the father of Kalomir born? plan: search Kalomir, then his father.",
    "act: search[Kalomir] Observation: Kalomir is a painter with father Tevren and birthplace Norvash.",
    "act: finish[Norvash] reflect: answer[Norvash] No results for Tevren.",
]


@dataclass
class TinyWorld:
    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    def adapter(self, name: str) -> Path:
        return self.root / "adapters" / name

    def shared_a_adapter(self, name: str) -> Path:
        """Adapters that share one down-projection A (only B differs), for BaseLRShared."""
        return self.root / "adapters_shared_a" / name

    @property
    def tasks(self) -> Path:
        return self.root / "tasks.jsonl"

    @property
    def lora_workflow(self) -> Path:
        return self.root / "workflow_lora.toml"

    @property
    def prompt_workflow(self) -> Path:
        return self.root / "workflow_prompt.toml"


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (any text encodes) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")


def tiny_sizes(vocab_size: int, eos_id: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    """Config fields making a model tiny, common to every architecture (EOS also BOS and padding; untied)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
    )


def tiny_config(
    vocab_size: int,
    eos_id: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    arch: str = "llama",
):
    """The transformers config of a tiny model of architecture `arch` (one of `ARCHITECTURES`)."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, PhiConfig, Qwen2Config, Qwen3Config

    common = tiny_sizes(vocab_size, eos_id, hidden, layers, heads, kv_heads)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope)
    if arch == "mistral":
        return MistralConfig(**common, head_dim=hidden // heads, sliding_window=MISTRAL_WINDOW, rope_parameters=rope)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, rope_parameters=rope)
    if arch == "phi":
        return PhiConfig(**common, rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if arch == "phi3":
        return Phi3Config(**common, rope_parameters=rope)
    raise ValueError(f"unknown architecture {arch!r}; use one of {', '.join(ARCHITECTURES)}")


HYBRIDS = ("qwen3_5_text", "granitemoehybrid", "lfm2")  # recurrent layers first, as the released models start


def hybrid_config(arch: str, vocab_size: int, eos_id: int):
    """A tiny hybrid (one of `HYBRIDS`, 4 layers): Qwen 3.5's three Gated DeltaNet layers then attention, Granite
    4.0-H's three Mamba-2 layers then attention (NoPE, 4 experts), LFM2's conv, conv, attention, conv."""
    from transformers import GraniteMoeHybridConfig, Lfm2Config, Qwen3_5TextConfig

    common = tiny_sizes(vocab_size, eos_id, layers=4)
    if arch == "qwen3_5_text":
        linear = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2}
        return Qwen3_5TextConfig(**common, head_dim=16, linear_num_value_heads=4, **linear)
    if arch == "granitemoehybrid":
        mamba = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1}
        experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
        layers = ["mamba"] * 3 + ["attention"]
        return GraniteMoeHybridConfig(**common, **experts, **mamba, mamba_chunk_size=16, layer_types=layers)
    if arch == "lfm2":
        return Lfm2Config(**common, layer_types=["conv", "conv", "full_attention", "conv"])
    raise ValueError(f"unknown hybrid {arch!r}; use one of {', '.join(HYBRIDS)}")


def build_model(config):
    """An initialised causal LM for `config` (seeded by the caller), with non-zero random q/k/v biases if it has
    biases (see module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "self_attn.dense.bias")):
                parameter.normal_(0.0, BIAS_STD)
    return model


def build_adapter(
    model,
    path: Path,
    seed: int,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    shared_a_seed: int | None = None,
    invocation: list[int] | None = None,
    task_type: str | None = "CAUSAL_LM",
):
    """Save a LoRA adapter with random non-zero A and B; `shared_a_seed`: A from that seed (shared A);
    `invocation`: an aLoRA invoked by those ids (`task_type` as saved)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    if invocation is not None:
        config.alora_invocation_tokens, config.task_type = invocation, task_type
    peft_model = get_peft_model(model, config)
    if shared_a_seed is not None:
        generator = torch.Generator().manual_seed(shared_a_seed)
        for name, module in peft_model.named_modules():
            if name.endswith("lora_A.default"):
                module.weight.data = (
                    torch.randn(module.weight.shape, generator=generator) / module.weight.shape[1] ** 0.5
                )
    peft_model.save_pretrained(path)
    return peft_model.unload()


def attention_targets(model) -> tuple[str, ...]:
    """The linear layers of the first attention layer (the tiny adapters' targets)."""
    index, layer = next((i, layer) for i, layer in enumerate(decoder_layers(model)) if recurrent_of(layer) is None)
    attention = attention_of(layer, index)
    return tuple(
        sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in attention.named_modules()
                if isinstance(module, torch.nn.Linear)
            }
        )
    )


def build_tiny_world(
    root: str | Path, seed: int = 0, arch: str = "llama", configure: Callable[[int, int], object] | None = None
) -> TinyWorld:
    """Write the tiny world of `arch` under `root`; its paths. `configure(vocab, eos)` replaces `tiny_config` (any
    causal LM: `scripts/arch_survey.py`)."""
    world = TinyWorld(Path(root))
    world.root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    if configure is None:
        config = tiny_config(len(tokenizer), tokenizer.eos_token_id, arch=arch)
    else:
        config = configure(len(tokenizer), tokenizer.eos_token_id)
    model = build_model(config)
    model.save_pretrained(world.model)
    tokenizer.save_pretrained(world.model)
    targets = attention_targets(model)
    for index, name in enumerate(AGENTS):
        model = build_adapter(model, world.adapter(name), seed=seed + 1 + index, targets=targets)
    for index, name in enumerate(AGENTS):
        model = build_adapter(
            model, world.shared_a_adapter(name), seed=seed + 11 + index, targets=targets, shared_a_seed=seed + 10
        )
    with open(world.tasks, "w", encoding="utf-8") as handle:
        for index, (person, place) in enumerate([("Kalomir", "Norvash"), ("Tevren", "Osmadal"), ("Brinoth", "Quessa")]):
            task = {
                "id": f"tiny{index}",
                "question": f"Where was {person} born?",
                "answer": place,
                "documents": {person: f"{person} is a painter with birthplace {place}."},
            }
            if index:  # per-task private notes of different lengths (prompt mode reads them after the role prompt)
                task["private"] = {
                    name: f"Notes: {person} {'is known ' * (i + index)}.\n" for i, name in enumerate(AGENTS)
                }
            handle.write(json.dumps(task) + "\n")
    agents_lora = "".join(f'[agents.{name}]\nadapter = "adapters/{name}"\n' for name in AGENTS)
    world.lora_workflow.write_text(
        f'system_prompt = "Answer with the search tool.\\n"\nmax_new_tokens = 8\nmax_rounds = 2\n{agents_lora}'
    )
    prompts = {
        "plan": "You plan the next search step.\n",
        "act": "You act: search[NAME] or finish[ANSWER].\n",
        "reflect": "You are the reviewer. Give the final answer as answer[ANSWER] after checking.\n",
    }
    agents_prompt = "".join(f"[agents.{name}]\nprompt = {json.dumps(text)}\n" for name, text in prompts.items())
    world.prompt_workflow.write_text(f"max_new_tokens = 8\nmax_rounds = 2\n{agents_prompt}")
    return world


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] and sys.argv[2] not in ARCHITECTURES:
        sys.exit(f"usage: python -m kvprof.model.tiny DIR [{'|'.join(ARCHITECTURES)}]")
    print(build_tiny_world(sys.argv[1], arch=sys.argv[2] if len(sys.argv) == 3 else "llama").root)
