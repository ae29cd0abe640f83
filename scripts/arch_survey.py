"""kvprof on tiny models of many transformers architectures, each checked against its oracles through the CLI.

For every architecture named, a tiny untrained world (`kvprof.model.tiny`: 2 layers, or as many as its own per-layer
pattern takes to hold each kind of layer once — Gemma 3's sixth, global layer; 4 query and 2 key/value heads of 16
channels where the architecture allows, random attention biases, LoRA adapters on every attention projection) is
built from the architecture's own config class, and in lora and prompt mode:

- `kvprof capture` of one task, `kvprof rank-analysis` (layer 0: identical base parts in lora mode, a zero delta
  against the context-free encoding in prompt mode — the RoPE re-alignment), `kvprof replay --policy all`: the dense
  run reproduces the captured outputs and NonShared is exact;
- the selective-recompute policies at ratio 1 reproduce the dense run (their layer-by-layer path);
- lora mode: with one adapter for every agent, BaseShared reproduces the dense run and PreLRShared FullShared's, turn
  by turn (the cache split; both move the same spans).
- hybrids (recurrent layers): prompt-mode FullShared under each checkpoint rule (vllm and sglang every 16 tokens,
  message boundaries) reproduces the dense run while its calls resume from kept states, and with Activated LoRA
  agents (invoked by "NAME:") ALoRAShared reproduces NonShared (KL ≤ 1e-6), prefilling less.

A step ends "ok", "refused" (exit 2 and one `error:` sentence: kvprof declines the model, and says why) or "FAILED"
(a traceback, or an oracle that does not hold). Exits 1 if any step failed.

    python scripts/arch_survey.py OUT llama,qwen3,phi3,gemma2,...   # about a minute per architecture on 2 cores
    python scripts/arch_survey.py OUT gpt_oss,gemma2,mistral --window 24   # windows shorter than the traces
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXACT = 1e-5  # relative K/V error of a run that must equal the dense one
LONG_WINDOW = 4096  # tokens: a window or chunk longer than any trace of the tiny world
# Hybrids whose config classes default to one kind of layer: recurrent layers before an attention layer, as the
# released models start (LFM2's first attention layer is its third; Granite 4.0-H's mamba layers come first)
# Gemma 4's global layers have heads of their own size (here 32 channels against 16) and each layer its own input
# embedding (its full vocabulary would dwarf the tiny model: the tiny one)
GEMMA4_SIZES = dict(head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16)
HYBRID_LAYERS = {
    "lfm2": ["conv", "conv", "full_attention", "conv"],
    "granitemoehybrid": ["linear_attention"] * 3 + ["full_attention"],
}


def configure(arch: str, window: int = LONG_WINDOW):
    """(vocab size, EOS id) → a tiny config of `arch`, its own defaults except for the sizes; a sliding window or
    attention chunk of `window` tokens where the architecture has one."""
    from transformers import CONFIG_MAPPING

    from kvprof.model.tiny import MLA_SIZES, tiny_sizes

    config_class = CONFIG_MAPPING[arch]
    defaults = config_class()

    def has(name: str) -> bool:  # a per-layer attribute (Gemma 4's head_dim) raises on the global config
        try:
            return hasattr(defaults, name)
        except Exception:  # noqa: BLE001 (whatever the config class raises for it)
            return False

    def build(vocab: int, eos: int):
        sizes = tiny_sizes(vocab, eos, layers=len(HYBRID_LAYERS.get(arch, ())) or pattern_layers(defaults))
        if arch in HYBRID_LAYERS:
            sizes["layer_types"] = HYBRID_LAYERS[arch]
        if arch == "gemma4_text":
            sizes.update(GEMMA4_SIZES, vocab_size_per_layer_input=vocab)
        if not has("num_key_value_heads"):  # no grouped-query attention
            del sizes["num_key_value_heads"]
        if has("kv_lora_rank"):  # multi-head latent attention: its own head sizes, head_dim derived from them
            sizes.update(MLA_SIZES)
        elif has("head_dim") and not isinstance(getattr(config_class, "head_dim", None), property):
            sizes["head_dim"] = 16
        for name in ("sliding_window", "attention_chunk_size"):
            if getattr(defaults, name, None):
                sizes[name] = window
        for name, value in (
            ("num_local_experts", 4),
            ("num_experts", 4),
            ("n_routed_experts", 4),
            ("num_experts_per_tok", 2),
        ):
            if has(name):
                sizes[name] = value
        if has("moe_intermediate_size"):
            sizes["moe_intermediate_size"] = 32
        return config_class(**sizes)

    return build


def pattern_layers(defaults) -> int:
    """The fewest layers (at least 2) whose start of the architecture's own per-layer pattern (`layer_types`,
    `no_rope_layers`) holds every kind of layer it has: Gemma 3's sixth (global) layer, SmolLM3's fourth (NoPE)."""
    needed = 2
    for name in ("layer_types", "no_rope_layers"):
        pattern = list(getattr(defaults, name, None) or [])
        for kind in set(pattern):
            needed = max(needed, pattern.index(kind) + 1)
    return needed


def cli(*args) -> tuple[str, str]:
    """Run kvprof; ("ok" | "refused" | "FAILED", detail)."""
    done = subprocess.run(["kvprof", *map(str, args)], capture_output=True, text=True)
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode == 0:
        return "ok", ""
    if done.returncode == 2 and "Traceback" not in done.stderr and lines and "error:" in lines[-1]:
        return "refused", lines[-1][lines[-1].index("error:") + 7 :]
    return "FAILED", lines[-1] if lines else f"exit {done.returncode}"


def worst_error(path: Path) -> dict[str, float]:
    policies = json.loads(path.read_text())["policies"]
    return {label: max(e["summary"]["k_error"], e["summary"]["v_error"]) for label, e in policies.items()}


def one_adapter_error(path: Path) -> float:
    """With one adapter for every agent the cache split is exact: BaseShared (which moves no span) equals the dense
    run, and PreLRShared equals FullShared turn by turn (both move the same spans, whose deeper layers differ from the
    dense run's as their context does). The worst relative K/V difference of either."""
    policies = json.loads(path.read_text())["policies"]
    worst = worst_error(path)["baseshared-code"]
    for low_rank, full in zip(policies["prelrshared"]["turns"], policies["fullshared"]["turns"], strict=True):
        for ours, theirs in zip(low_rank["layers"], full["layers"], strict=True):
            worst = max(worst, abs(ours["k_error"] - theirs["k_error"]), abs(ours["v_error"] - theirs["v_error"]))
    return worst


def survey(arch: str, root: Path, window: int = LONG_WINDOW) -> list[tuple[str, str, str]]:
    from kvprof.errors import KvprofError
    from kvprof.model.tiny import AGENTS, build_tiny_world

    steps: list[tuple[str, str, str]] = []
    try:
        world = build_tiny_world(root, arch=arch, configure=configure(arch, window))
    except KvprofError as err:  # kvprof cannot find the layers to adapt, as its commands would not
        return [("build", "refused", str(err))]
    except Exception as err:  # noqa: BLE001 (the survey reports whatever building the world raised)
        return [("build", "FAILED", f"{type(err).__name__}: {str(err)[:160]}")]
    for mode, workflow in (("lora", world.lora_workflow), ("prompt", world.prompt_workflow)):
        out = root / mode
        state, detail = cli(
            "capture",
            "--model",
            world.model,
            "--workflow",
            workflow,
            "--tasks",
            world.tasks,
            "--limit",
            "1",
            "--out",
            out / "capture",
            "--device",
            "cpu",
        )
        steps.append((f"{mode} capture", state, detail))
        if state != "ok":
            continue
        trace = out / "capture" / "trace.jsonl"
        state, detail = cli("rank-analysis", trace, "--out", out / "rank", "--device", "cpu")
        if state == "ok":
            analysis = json.loads((out / "rank" / "rank_analysis.json").read_text())
            first = analysis["layers"][0]
            if first != 0:  # a hybrid's first attention layer reads what its recurrent layers made of the context
                detail = f"layers {analysis['layers']} analysed: no attention layer reads its input alone (no oracle)"
            elif mode == "lora":
                value = analysis["layer_means"][0]["K"]["base_cosine"]
                state = "ok" if abs(value - 1) < 1e-6 else "FAILED"
                detail = f"layer 0 base cosine {value:.6f}"
            else:
                value = analysis["context_free"]["layer_means"][0]["K"]["delta_relative"]
                state = "ok" if value < 1e-5 else "FAILED"
                detail = f"layer 0 context-free key delta {value:.1e}"
        steps.append((f"{mode} rank-analysis", state, detail))
        state, detail = cli(
            "replay", trace, "--policy", "all", "--repeats", "1", "--out", out / "all", "--device", "cpu"
        )
        if state == "ok":
            result = json.loads((out / "all" / "replay.json").read_text())
            nonshared = worst_error(out / "all" / "replay.json")["nonshared"]
            agreement = result["dense"]["summary"]["trace_agreement"]
            state = "ok" if agreement == 1.0 and nonshared == 0.0 else "FAILED"
            detail = f"{len(result['policies'])} variants, {len(result.get('skipped', {}))} skipped"
            if result.get("skipped"):
                expected = ("-mode", "share their down-projection A")  # other mode's policies; tiny adapters' own A
                reasons = {r for r in result["skipped"].values() if not any(text in r for text in expected)}
                detail += "".join(f"; skipped: {reason}" for reason in sorted(reasons))
        steps.append((f"{mode} replay --policy all", state, detail))
        for name in ("cacheblend", "droidspeak", "relaycaching"):
            flags = ("--policy", name, "--policy-option", f"{name}.ratio=1", "--repeats", "1")
            state, detail = cli("replay", trace, *flags, "--out", out / f"{name}1", "--device", "cpu")
            if state == "ok":
                worst = max(worst_error(out / f"{name}1" / "replay.json").values())
                state, detail = ("ok" if worst < EXACT else "FAILED"), f"worst error {worst:.1e}"
            steps.append((f"{mode} {name} ratio=1", state, detail))
        if mode == "lora":
            same = [arg for name in AGENTS for arg in ("--agent", f"{name}={world.adapter('act')}")]
            policies = ("--policy", "baseshared", "--policy", "prelrshared", "--policy", "fullshared")
            state, detail = cli(
                "replay", trace, *policies, *same, "--repeats", "1", "--out", out / "same", "--device", "cpu"
            )
            if state == "ok":
                worst = one_adapter_error(out / "same" / "replay.json")
                state, detail = ("ok" if worst < EXACT else "FAILED"), f"worst error {worst:.1e}"
            steps.append(("lora low-rank, one adapter", state, detail))
        if mode == "prompt" and hybrid(out / "all" / "replay.json"):
            steps += hybrid_prompt_steps(trace, out)
    if hybrid(root / "lora" / "all" / "replay.json"):
        steps.append(alora_step(world, root / "alora"))
    return steps


def hybrid(result: Path) -> bool:
    """Whether a replay result's model has recurrent layers."""
    return result.exists() and any(
        kind["attention"] == "recurrent" for kind in json.loads(result.read_text())["layers"]
    )


def hybrid_prompt_steps(trace: Path, out: Path) -> list[tuple[str, str, str]]:
    """Prompt-mode FullShared on a hybrid under each checkpoint rule: exact, and resuming from kept states."""
    steps = []
    for rule, interval in (("vllm", ["--checkpoint-interval", "16"]), ("sglang", ["--checkpoint-interval", "16"]),
                           ("boundaries", [])):  # fmt: skip
        flags = ("--policy", "fullshared", "--checkpoints", rule, *interval, "--repeats", "1")
        state, detail = cli("replay", trace, *flags, "--out", out / f"full-{rule}", "--device", "cpu")
        if state == "ok":
            summary = json.loads((out / f"full-{rule}" / "replay.json").read_text())["policies"]["fullshared"][
                "summary"
            ]
            worst = worst_error(out / f"full-{rule}" / "replay.json")["fullshared"]
            exact = worst < EXACT and summary["kl"] <= 1e-6 and summary["reuse_per_token"] > 0
            state = "ok" if exact else "FAILED"
            detail = f"worst error {worst:.1e}, KL {summary['kl']:.1e}, reuse {summary['reuse_per_token']:.0%}"
        steps.append((f"prompt fullshared {rule}", state, detail))
    return steps


def alora_step(world, out: Path) -> tuple[str, str, str]:
    """Activated LoRA agents on a hybrid: ALoRAShared against NonShared (states kept at message boundaries)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvprof.model.tiny import AGENTS, attention_targets, build_adapter

    tokenizer = AutoTokenizer.from_pretrained(world.model)
    flags = []
    for seed, agent in enumerate(AGENTS):
        model = AutoModelForCausalLM.from_pretrained(world.model)
        invocation = tokenizer.encode(f"{agent}:", add_special_tokens=False)
        build_adapter(model, out / agent, 20 + seed, targets=attention_targets(model), invocation=invocation)
        flags += ["--agent", f"{agent}={out / agent}"]
    common = ("--device", "cpu")
    state, detail = cli(
        "capture", "--model", world.model, "--workflow", world.lora_workflow, "--tasks", world.tasks, "--limit", "1",
        *flags, "--out", out / "capture", *common,
    )  # fmt: skip
    if state != "ok":
        return "alora capture", state, detail
    policies = ("--policy", "nonshared", "--policy", "alorashared", "--checkpoints", "boundaries", "--repeats", "1")
    state, detail = cli("replay", out / "capture" / "trace.jsonl", *policies, "--out", out / "replay", *common)
    if state == "ok":
        runs = json.loads((out / "replay" / "replay.json").read_text())["policies"]
        nonshared, shared = runs["nonshared"]["summary"], runs["alorashared"]["summary"]
        exact = shared["kl"] <= 1e-6 and shared["prefilled"] < nonshared["prefilled"]
        state = "ok" if exact else "FAILED"
        detail = f"KL {shared['kl']:.1e}, prefilled {shared['prefilled']} of NonShared's {nonshared['prefilled']}"
    return "lora alorashared (aLoRA)", state, detail


def main() -> int:
    args = sys.argv[1:]
    window = LONG_WINDOW
    if len(args) == 4 and args[2] == "--window" and args[3].isdigit():
        window = int(args.pop())
        args.pop()
    if len(args) != 2:
        print("\n".join(line.strip() for line in __doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    root, archs = Path(args[0]), args[1].split(",")
    failed = False
    for arch in archs:
        for step, state, detail in survey(arch, root / arch, window):
            failed |= state == "FAILED"
            print(f"{arch:14} {step:28} {state:8} {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
