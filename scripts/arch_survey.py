"""kvprof on tiny models of many transformers architectures, each checked against its oracles through the CLI.

For every architecture named, a tiny untrained world (`kvprof.tiny`: 2 layers, 4 query and 2 key/value heads of 16
channels where the architecture allows, random attention biases, LoRA adapters on every attention projection) is
built from the architecture's own config class, and in lora and prompt mode:

- `kvprof capture` of one task, `kvprof rank-analysis` (layer 0: identical base parts in lora mode, a zero delta
  against the context-free encoding in prompt mode — the RoPE re-alignment), `kvprof replay --policy all`: the dense
  run reproduces the captured outputs and NonShared is exact;
- the selective-recompute policies at ratio 1 reproduce the dense run (their layer-by-layer path);
- lora mode: with one adapter for every agent, BaseShared and PreLRShared reproduce the dense run (the cache split).

A step ends "ok", "refused" (exit 2 and one `error:` sentence: kvprof declines the model, and says why) or "FAILED"
(a traceback, or an oracle that does not hold). Exits 1 if any step failed.

    python scripts/arch_survey.py OUT llama,qwen3,phi3,gemma2,...   # about a minute per architecture on 2 cores
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXACT = 1e-5  # relative K/V error of a run that must equal the dense one


def configure(arch: str):
    """(vocab size, EOS id) → a tiny config of `arch`, its own defaults except for the sizes."""
    from transformers import CONFIG_MAPPING

    from kvprof.tiny import tiny_sizes

    config_class = CONFIG_MAPPING[arch]
    defaults = config_class()

    def build(vocab: int, eos: int):
        sizes = tiny_sizes(vocab, eos)
        if not hasattr(defaults, "num_key_value_heads"):  # no grouped-query attention
            del sizes["num_key_value_heads"]
        if hasattr(defaults, "head_dim") and not isinstance(getattr(config_class, "head_dim", None), property):
            sizes["head_dim"] = 16
        if getattr(defaults, "sliding_window", None):
            sizes["sliding_window"] = 4096
        for name, value in (("num_local_experts", 4), ("num_experts", 4), ("num_experts_per_tok", 2)):
            if hasattr(defaults, name):
                sizes[name] = value
        if hasattr(defaults, "moe_intermediate_size"):
            sizes["moe_intermediate_size"] = 32
        return config_class(**sizes)

    return build


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


def survey(arch: str, root: Path) -> list[tuple[str, str, str]]:
    from kvprof.errors import KvprofError
    from kvprof.tiny import AGENTS, build_tiny_world

    steps: list[tuple[str, str, str]] = []
    try:
        world = build_tiny_world(root, arch=arch, configure=configure(arch))
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
            if mode == "lora":
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
            state, detail = cli(
                "replay",
                trace,
                "--policy",
                "baseshared",
                "--policy",
                "prelrshared",
                *same,
                "--repeats",
                "1",
                "--out",
                out / "same",
                "--device",
                "cpu",
            )
            if state == "ok":
                worst = max(worst_error(out / "same" / "replay.json").values())
                state, detail = ("ok" if worst < EXACT else "FAILED"), f"worst error {worst:.1e}"
            steps.append(("lora low-rank, one adapter", state, detail))
    return steps


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    root, archs = Path(sys.argv[1]), sys.argv[2].split(",")
    failed = False
    for arch in archs:
        for step, state, detail in survey(arch, root / arch):
            failed |= state == "FAILED"
            print(f"{arch:14} {step:28} {state:8} {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
