"""kvprof at real model shapes and long traces: wall time, peak memory and the replay's own overhead, per trace length.

    python scripts/scale_bench.py OUT_DIR [--shape qwen3-0.6b] [--layers 28] [--tokens 1024,2048,4096]
        [--calls 6] [--policy fullshared --policy prelrshared --policy cacheblend] [--device cpu] [--dtype auto]
        [--kv-budget-share 0.25] [--no-plan]

For each shape (a public model's configuration, `SHAPES`, with random weights; `--layers` keeps its first N layers so
a small machine can run it, and sweeping it gives the growth against layers), OUT_DIR/SHAPE-LLAYERS/ holds the model
with three LoRA adapters (rank 16 on the attention layers' projections, one A shared, so every low-rank policy runs)
and the demo world's tokenizer (the trace's ids are ordinary ids of it; the embedding keeps the shape's vocabulary).
On a hybrid shape (`HYBRID_SHAPES`) the replay runs FullShared and no anchors are fitted: the other families and anchor
pools need per-token K/V in every layer, and kvprof refuses them there. For each trace length
T, a shape trace of `--calls` agent calls whose prefills add up to T tokens (16 output tokens each) is imported
(`kvprof capture --shapes`), replayed (`kvprof replay`, one representative policy per family by default, one timed
prefill per turn), and imported again with role prompts for the agents to fit anchors on (`kvprof fit-anchors`
takes prompt-mode traces). The replay and fit-anchors each run with `--plan` first: their rows show the planned
peak and time beside the measured ones. With `--kv-budget-share`, the replay runs again with its stored caches held
within that share of the stored peak it measured (`--kv-budget`; at least 1.25 times what one lockstep step holds:
the dense run's stores beside the largest policy's), and whether every number matched the unbounded run.
Every step is its own process, as a user runs it;
each reports its wall time and peak resident memory, and the replay also the time inside the model's modules
(embedding, decoder layers, final norm, head: timed by forward hooks), the setup before its first forward (imports,
loading), the self-check's time (`kvprof.replay.self_check`: its forwards count as the model's) and the tail after
its last forward (report, files, exit): kvprof's own overhead is the rest, as a share of the time after the setup
("own") and of the time from the first forward to the last ("running"). Prints
one row per step and length, the growth exponents (log-log slope of time and memory against T, and of the dense
run's FLOPs for comparison), and writes OUT_DIR/scale.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AGENTS = ("plan", "act", "reflect")
OUTPUT_TOKENS = 16
# The public configurations' sizes (their config.json on the hub), random weights.
SHAPES = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500_000.0,
    ),
    # a hybrid: ten short-convolution layers and six attention layers (at these indices); its feed-forward width
    # 6656 is adjusted to 4608 as its checkpoints are
    "lfm2-350m": dict(
        model_type="lfm2", hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=6656, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3, vocab_size=65536, tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500_000.0,
    ),
}  # fmt: skip
HYBRID_SHAPES = {"lfm2-350m"}  # shapes with recurrent layers

# Run inside each step's process: the CLI, then its peak RSS (and, with HOOKS, the time in the model's modules, when
# its first and last forwards began and ended, and the self-check's time and time in the model) as the last line of
# stderr. The hooks go in once the command has chosen its threads: torch imported earlier would leave the command too
# little of its start to measure the machine's load on (`kvprof.threads`).
CHILD = """
import json, sys, time
from pathlib import Path
began = time.perf_counter()
timed = {"model_s": 0.0, "setup_s": 0.0, "last_s": 0.0, "self_check_s": 0.0, "self_check_model_s": 0.0}
def started(module, args):
    module._kvprof_started = time.perf_counter()
    timed["setup_s"] = timed["setup_s"] or module._kvprof_started - began
def ended(module, args, output):
    now = time.perf_counter()
    timed["model_s"] += now - module._kvprof_started
    timed["last_s"] = now - began
def hook_model(original):
    def post_init(model):
        original(model)
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers"):
            return
        final_norm = getattr(inner, "norm", None) or getattr(inner, "embedding_norm", None)  # LFM2's name for it
        modules = [inner.embed_tokens, *inner.layers, final_norm, getattr(model, "lm_head", None)]
        for module in filter(None, modules):
            module.register_forward_pre_hook(started)
            module.register_forward_hook(ended)
    return post_init
def time_self_check(checking):
    def check_on_model(*args, **kwargs):
        started, model_before = time.perf_counter(), timed["model_s"]
        try:
            return checking(*args, **kwargs)
        finally:
            timed["self_check_s"] += time.perf_counter() - started
            timed["self_check_model_s"] += timed["model_s"] - model_before
    return check_on_model
if sys.argv[1] == "hooks":
    import kvprof.commands.common as common
    choose = common.use_threads
    def use_threads(threads):
        choice = choose(threads)
        import transformers
        import kvprof.replay.self_check as self_check
        transformers.PreTrainedModel.post_init = hook_model(transformers.PreTrainedModel.post_init)
        self_check.check_on_model = time_self_check(self_check.check_on_model)
        return choice
    common.use_threads = use_threads
from kvprof.cli import main
sys.argv = ["kvprof", *sys.argv[2:]]
try:
    main()
finally:
    # VmHWM: this address space's peak (ru_maxrss would keep the parent's from before the exec)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    peak = int(status["VmHWM"].split()[0]) * 1024
    print("SCALE " + json.dumps({"peak_rss_bytes": peak, **timed}), file=sys.stderr)
"""


def build_model(folder: Path, shape: str, layers: int | None, dtype: str) -> None:
    """SHAPE's configuration (its first `layers` layers) with random weights, three shared-A LoRA adapters and the
    demo tokenizer, in `folder` (kept when it exists)."""
    if (folder / "model" / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from kvprof.demo.assets import demo_world
    from kvprof.model.tiny import attention_targets, build_adapter
    from kvprof.model.tiny import build_model as initialised

    sizes = dict(SHAPES[shape])
    if layers:
        sizes["num_hidden_layers"] = layers
    tokenizer = AutoTokenizer.from_pretrained(demo_world().model)
    config = AutoConfig.for_model(
        **sizes, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
    )
    torch.manual_seed(0)
    model = initialised(config)
    targets = attention_targets(model)
    for index, agent in enumerate(AGENTS):
        adapter = folder / "adapters" / agent
        model = build_adapter(model, adapter, seed=index + 1, rank=16, targets=targets, shared_a_seed=99)
    if dtype in ("bfloat16", "float16"):
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


def shape_csv(path: Path, tokens: int, calls: int) -> None:
    """`calls` agent calls in turn (plan, act, reflect, ...) whose prefills add up to `tokens`."""
    sizes = [tokens // calls + (index < tokens % calls) for index in range(calls)]
    rows = [f"{AGENTS[index % len(AGENTS)]},{size},{OUTPUT_TOKENS}" for index, size in enumerate(sizes)]
    path.write_text("agent,prefill_len,decode_len\n" + "\n".join(rows) + "\n")


def step(name: str, args: list[str], hooks: bool = False) -> dict:
    """One kvprof command in its own process: wall seconds, peak RSS and (with `hooks`) seconds in the model."""
    started = time.perf_counter()
    command = [sys.executable, "-c", CHILD, "hooks" if hooks else "plain", *args]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if run.returncode:
        last = (run.stderr.strip() or run.stdout).splitlines()
        sys.exit(f"{name} failed: {last[-2] if len(last) > 1 and last[-1].startswith('SCALE') else last[-1]}")
    measured = json.loads(run.stderr.strip().splitlines()[-1].removeprefix("SCALE "))
    return {"wall_s": round(seconds, 2), **measured}


def point(
    folder: Path,
    tokens: int,
    calls: int,
    policies: list[str],
    device: str,
    dtype: str,
    budget_share: float,
    plan: bool,
    anchors: bool = True,
) -> dict:
    """Capture (shape import), replay and (with `anchors`) fit-anchors at one trace length, each after its plan; with
    `budget_share`, the replay again with its stores held within that share of the stored peak it measured."""
    run = folder / f"T{tokens}"
    run.mkdir(parents=True, exist_ok=True)
    shape_csv(run / "shape.csv", tokens, calls)
    agents = [arg for agent in AGENTS for arg in ("--agent", f"{agent}={folder / 'adapters' / agent}")]
    common = ["--device", device, "--dtype", dtype]
    capture = ["capture", "--shapes", str(run / "shape.csv"), "--model", str(folder / "model"), *agents]
    result = {"tokens": tokens, "capture": step("capture", [*capture, "--out", str(run / "capture")])}
    trace = str(run / "capture" / "trace.jsonl")
    policy_flags = [arg for policy in policies for arg in ("--policy", policy)]
    replay = ["replay", trace, *policy_flags, "--repeats", "1", *common]
    result["replay"] = planned_step("replay", [*replay, "--out", str(run / "replay")], plan, hooks=True)
    replayed = json.loads((run / "replay" / "replay.json").read_text())
    result["dense_flops"] = replayed["dense"]["summary"]["flops"]
    result["analytic_peak_bytes"] = {
        label: entry["summary"]["allocator_peak_bytes"] for label, entry in replayed["policies"].items()
    }
    if budget_share:
        dense = replayed["dense"]["summary"]["peak_memory_bytes"]
        policies = [entry["summary"]["peak_memory_bytes"] for entry in replayed["policies"].values()]
        # at least what one lockstep step holds (the dense run's stores beside the largest policy's), with room
        budget = int(max(budget_share * (dense + sum(policies)), 1.25 * (dense + max(policies))))
        budgeted = [*replay, "--kv-budget", str(budget), "--out", str(run / "replay-budget")]
        result["replay_budget"] = planned_step("replay --kv-budget", budgeted, plan) | {"budget_bytes": budget}
        result["replay_budget"]["same_numbers"] = same_numbers(run / "replay", run / "replay-budget")
    if not anchors:
        return result
    roles = [arg for agent in AGENTS for arg in ("--role", f"{agent}=You are the {agent} agent of a team.")]
    prompt_capture = ["capture", "--shapes", str(run / "shape.csv"), "--model", str(folder / "model"), *roles]
    step("capture (prompt mode)", [*prompt_capture, "--out", str(run / "capture-prompt")])
    fit = ["fit-anchors", str(run / "capture-prompt" / "trace.jsonl"), "--out", str(run / "anchors"), *common]
    result["fit_anchors"] = planned_step("fit-anchors", fit, plan)
    return result


def planned_step(name: str, args: list[str], plan: bool, hooks: bool = False) -> dict:
    """`step` after its `--plan` (into the same --out) where `plan`: the measured step with the plan's predicted peak
    and time."""
    if not plan:
        return step(name, args, hooks)
    step(f"{name} --plan", [*args, "--plan"])
    out = Path(args[args.index("--out") + 1])
    planned = json.loads((out / "plan.json").read_text())
    measured = step(name, args, hooks)
    return measured | {"plan_peak_bytes": planned["peak_bytes"]["host"], "plan_seconds": planned["expected_seconds"]}


NUMBERS = ("kl", "top1", "reused", "prefilled", "flops")


def same_numbers(first: Path, second: Path) -> bool:
    """Whether two replays' turns have the same KL, agreement, reuse, prefill and FLOPs, run by run."""
    a, b = (json.loads((folder / "replay.json").read_text()) for folder in (first, second))
    runs = [("dense", a["dense"], b["dense"])] + [(k, v, b["policies"][k]) for k, v in a["policies"].items()]
    return all(
        [t.get(key) for t in x["turns"] for key in NUMBERS] == [t.get(key) for t in y["turns"] for key in NUMBERS]
        for _, x, y in runs
    )


def slope(points: list[dict], value) -> float | None:
    """Least-squares slope of log(value) against log(tokens)."""
    pairs = [(math.log(p["tokens"]), math.log(value(p))) for p in points if value(p) > 0]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    return sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread if spread else None


def report(points: list[dict]) -> dict:
    """Print one row per length and step (measured against planned); the growth exponents."""
    print(
        f"{'T':>7} {'step':18} {'wall s':>8} {'plan s':>7} {'peak RSS GiB':>13} {'plan GiB':>9} {'setup s':>8} "
        f"{'check s':>8} {'model s':>8} {'own':>5} {'running':>8} {'tail s':>7}"
    )
    for p in points:
        for name in ("capture", "replay", "replay_budget", "fit_anchors"):
            if name not in p:
                continue
            m = p[name]
            hooked = bool(m["model_s"])
            own = f"{1 - m['model_s'] / (m['wall_s'] - m['setup_s']):.0%}" if hooked else ""
            running = f"{1 - m['model_s'] / (m['last_s'] - m['setup_s']):.0%}" if hooked else ""
            timed = [f"{m[key]:.1f}" if hooked else "" for key in ("setup_s", "self_check_s", "model_s")]
            tail = f"{m['wall_s'] - m['last_s']:.1f}" if hooked else ""
            plan_s = f"{m['plan_seconds']:.1f}" if "plan_seconds" in m else ""
            plan_gib = f"{m['plan_peak_bytes'] / 2**30:.2f}" if "plan_peak_bytes" in m else ""
            row = f"{p['tokens']:>7} {name:18} {m['wall_s']:>8.1f} {plan_s:>7} {m['peak_rss_bytes'] / 2**30:>13.2f}"
            print(f"{row} {plan_gib:>9} {timed[0]:>8} {timed[1]:>8} {timed[2]:>8} {own:>5} {running:>8} {tail:>7}")
            if name == "replay_budget":
                print(f"{'':>7} {'':18} budget {m['budget_bytes'] / 2**30:.2f} GiB, same numbers: {m['same_numbers']}")
    exponents = {
        "dense_flops": slope(points, lambda p: p["dense_flops"]),
        "replay_wall": slope(points, lambda p: p["replay"]["wall_s"]),
        "replay_model": slope(points, lambda p: p["replay"]["model_s"]),
        "replay_peak_rss": slope(points, lambda p: p["replay"]["peak_rss_bytes"]),
        "fit_anchors_wall": slope(points, lambda p: p["fit_anchors"]["wall_s"] if "fit_anchors" in p else 0),
    }
    print("growth against T (log-log slope): " + ", ".join(f"{k} {v:.2f}" for k, v in exponents.items() if v))
    return exponents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="keep the shape's first N layers")
    parser.add_argument("--tokens", default="1024,2048,4096", help="comma-separated trace lengths")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--policy", action="append", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--kv-budget-share", type=float, default=0.0, help="replay again within this share of the stores"
    )
    parser.add_argument("--no-plan", action="store_true", help="run the steps without planning them first")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    hybrid = args.shape in HYBRID_SHAPES
    policies = args.policy or (["fullshared"] if hybrid else ["fullshared", "prelrshared", "cacheblend"])
    folder = args.out / f"{args.shape}-L{args.layers or SHAPES[args.shape]['num_hidden_layers']}"
    build_model(folder, args.shape, args.layers, args.dtype)
    points = [
        point(
            folder,
            int(tokens),
            args.calls,
            policies,
            args.device,
            args.dtype,
            args.kv_budget_share,
            not args.no_plan,
            anchors=not hybrid,
        )
        for tokens in args.tokens.split(",")
    ]
    exponents = report(points)
    record = {"shape": args.shape, "layers": args.layers, "policies": policies, "points": points, "growth": exponents}
    (folder / "scale.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {folder / 'scale.json'}")


if __name__ == "__main__":
    main()
