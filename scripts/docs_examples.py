"""The documentation's example outputs, produced by running the commands they show.

    python scripts/docs_examples.py list
    python scripts/docs_examples.py run NAME [NAME ...]

Each example is a named list of kvprof command lines. `run` executes them for real from the repository root (where
`world` is a link to the shipped demo world, `kvprof/demo/assets`; `run` makes it if missing) and writes what the
terminal shows (`$ COMMAND`, then its stdout and stderr) to `docs/examples/NAME.txt`, which the pages include with
`--8<-- "docs/examples/NAME.txt"`. Paths of this machine are written relative to the repository root (or `~`), so
nothing machine-specific is shown. Results go under `runs/` (ignored by git).

An example may need files another command writes (`needs`); when one is missing, its `setup` commands run first,
and their output is not recorded. Tables are rendered `WIDTH` columns wide.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO / "docs" / "examples"
WIDTH = 200
# `kvprof ARGS` runs as this program, so that the result tables are as wide as a terminal would show them (kvprof's
# console is 140 columns wide when stdout is not a terminal).
KVPROF = f"import kvprof.ui as ui; ui.console.width = {WIDTH}; from kvprof.cli import main; main()"


@dataclass(frozen=True)
class Example:
    """Command lines whose terminal output one docs page shows."""

    commands: tuple[str, ...]
    needs: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    # keep the output from the first line that starts with this text (a long command's summary at its end)
    keep_from: str = ""
    # environment variables the commands run with (e.g. quieting a library's warnings)
    env: tuple[tuple[str, str], ...] = ()


FIT_PROMPT_POOLS = (
    "kvprof fit-anchors --limit 12 --out runs/fit-anchors",
    "kvprof fit-anchors --limit 12 --rank full --anchors-per-slot 20 --out runs/fit-anchors-full",
)
DROIDSPEAK_PROFILES = (
    "kvprof replay world/sample_traces/lora_long.jsonl --policy droidspeak"
    " --policy-option droidspeak.profile_out=runs/droidspeak-lora.json --out runs/droidspeak-profile-lora",
    "kvprof replay world/sample_traces/prompt_long.jsonl --policy droidspeak"
    " --policy-option droidspeak.profile_out=runs/droidspeak-prompt.json --out runs/droidspeak-profile-prompt",
)
CODEBOOK_REPLAY = (
    " --online --policy fullshared --policy kvcomm --policy kvcmas"
    " --policy-option kvcmas.chain=chain --policy-option kvcmas.chain=star"
)

EXAMPLES: dict[str, Example] = {
    "demo": Example(("kvprof demo --out runs/demo",), keep_from="kvprof demo ("),
    "demo-evaluate": Example(("python -m kvprof.demo.evaluate --threads 1",)),
    "codebook-heldout": Example(
        (
            "kvprof replay kvprof/demo/assets/codebook/sample_traces/heldout.jsonl"
            f"{CODEBOOK_REPLAY} --out runs/replay-codebook",
        )
    ),
    "codebook-standing": Example(
        (
            "kvprof replay kvprof/demo/assets/codebook/sample_traces/standing.jsonl"
            f"{CODEBOOK_REPLAY} --out runs/replay-codebook-standing",
        )
    ),
    "capture": Example(
        (
            "kvprof capture --model world/model --workflow world/workflow_lora.toml"
            " --tasks world/tasks/heldout.jsonl --limit 20 --out runs/capture",
        )
    ),
    "import-chat": Example(
        (
            "kvprof import-chat world/sample_logs/prompt_short_chat.jsonl --model world/model"
            " --chat-template world/chat_template.jinja --workflow world/workflow_prompt.toml --out runs/import",
        )
    ),
    "import-otlp": Example(
        (
            "kvprof import-chat world/sample_logs/prompt_short_otlp.json --model world/model"
            " --chat-template world/chat_template.jinja --workflow world/workflow_prompt.toml --out runs/import-otlp",
            "kvprof replay runs/import-otlp/trace.jsonl --policy fullshared --out runs/replay-otlp",
        )
    ),
    "replay-import": Example(
        ("kvprof replay runs/import/trace.jsonl --online --out runs/replay-import",),
        needs=("runs/import/trace.jsonl",),
        setup=(
            "kvprof import-chat world/sample_logs/prompt_short_chat.jsonl --model world/model"
            " --chat-template world/chat_template.jinja --workflow world/workflow_prompt.toml --out runs/import",
        ),
    ),
    "inspect-prompt": Example(("kvprof inspect world/sample_traces/prompt_short.jsonl --divergences 4",)),
    "inspect": Example(
        ("kvprof inspect runs/capture/trace.jsonl --model world/model",),
        needs=("runs/capture/trace.jsonl",),
        setup=(
            "kvprof capture --model world/model --workflow world/workflow_lora.toml"
            " --tasks world/tasks/heldout.jsonl --limit 20 --out runs/capture",
        ),
    ),
    "inspect-hybrid": Example(
        (
            "kvprof inspect runs/qwen3_5/capture/trace.jsonl --model runs/qwen3_5/world/model --device cpu"
            " --dtype float32",
        ),
        needs=("runs/qwen3_5/capture/trace.jsonl",),
        setup=(
            "python scripts/tiny_hybrid_world.py runs/qwen3_5/world",
            "kvprof capture --model runs/qwen3_5/world/model --workflow runs/qwen3_5/world/workflow_lora.toml"
            " --tasks runs/qwen3_5/world/tasks.jsonl --out runs/qwen3_5/capture --device cpu --dtype float32",
        ),
        env=(("TRANSFORMERS_VERBOSITY", "error"),),  # transformers' notes on its reference kernels
    ),
    "inspect-hybrid-group-chat": Example(
        ("kvprof inspect runs/group-chat/trace.jsonl --model runs/qwen3_5-demo/model --device cpu --dtype float32",),
        needs=("runs/group-chat/trace.jsonl", "runs/qwen3_5-demo/model"),
        setup=(
            "kvprof import-chat world/sample_logs/prompt_short_group_chat.jsonl --model world/model"
            " --chat-template world/chat_template.jinja --workflow world/workflow_prompt.toml --out runs/group-chat",
            "python scripts/tiny_hybrid_world.py runs/qwen3_5-demo --like world/model",
        ),
        keep_from="checkpointed prefix reuse",
        env=(("TRANSFORMERS_VERBOSITY", "error"),),
    ),
    "rank-analysis": Example(("kvprof rank-analysis --out runs/rank",)),
    "replay-lp": Example(("kvprof replay --policy rebaseshared --schedule lp --out runs/replay-lp",)),
    "replay-online": Example(("kvprof replay --online --out runs/replay",)),
    "droidspeak-profiles": Example((*DROIDSPEAK_PROFILES, "cat runs/droidspeak-lora.json")),
    "replay-selective-lora": Example(
        (
            "kvprof replay --policy all --policy-option droidspeak.profile=runs/droidspeak-lora.json --online"
            " --out runs/replay-selective-lora",
        ),
        needs=("runs/droidspeak-lora.json",),
        setup=DROIDSPEAK_PROFILES,
    ),
    "replay-selective-prompt": Example(
        (
            "kvprof replay world/sample_traces/prompt_short.jsonl --policy all"
            " --policy-option droidspeak.profile=runs/droidspeak-prompt.json --online"
            " --out runs/replay-selective-prompt",
        ),
        needs=("runs/droidspeak-prompt.json",),
        setup=DROIDSPEAK_PROFILES,
    ),
    "droidspeak-blocks-prompt": Example(
        (
            "kvprof replay world/sample_traces/prompt_short.jsonl --policy droidspeak"
            " --policy-option droidspeak.ratio=0.25 --policy-option droidspeak.ratio=0.5"
            " --policy-option droidspeak.profile=runs/droidspeak-prompt.json --repeats 1"
            " --out runs/droidspeak-blocks-prompt",
        ),
        needs=("runs/droidspeak-prompt.json",),
        setup=DROIDSPEAK_PROFILES,
    ),
    "replay-delta": Example(
        (
            "kvprof replay world/sample_traces/prompt_tune.jsonl --skip 12 --policy fullshared --policy graphflow"
            " --policy kvcomm --policy kvcmas --policy-option kvcmas.chain=chain"
            " --policy-option kvcmas.chain=star"
            " --policy-option kvcmas.anchors=runs/fit-anchors/anchors.safetensors"
            " --policy-option kvcomm.anchors=runs/fit-anchors-full/anchors.safetensors"
            " --policy-option graphflow.anchors=runs/fit-anchors-full/anchors.safetensors --online"
            " --out runs/replay-delta",
        ),
        needs=("runs/fit-anchors/anchors.safetensors", "runs/fit-anchors-full/anchors.safetensors"),
        setup=FIT_PROMPT_POOLS,
    ),
    "replay-ray": Example(
        (
            "kvprof replay world/sample_traces/lora_short.jsonl --policy fullshared --policy droidspeak --ray"
            " --ray-workers 2 --out runs/replay-ray",
        )
    ),
    "ray-bench": Example(("python scripts/ray_bench.py runs/ray-bench --rounds 3",)),
    "fit-anchors": Example((FIT_PROMPT_POOLS[0],)),
    "tune-tau": Example(("kvprof tune-tau --out runs/tune-tau",)),
    "tune-tau-kl": Example(
        (
            "kvprof tune-tau --max-kl 3e-8 --no-online --anchors runs/tune-tau/anchors.safetensors"
            " --out runs/tune-tau-kl",
        ),
        needs=("runs/tune-tau/anchors.safetensors",),
        setup=("kvprof tune-tau --out runs/tune-tau",),
    ),
    "tune-tau-rho": Example(
        (
            "kvprof tune-tau --target-rho 0.8 --no-online --anchors runs/tune-tau/anchors.safetensors"
            " --out runs/tune-tau-rho",
        ),
        needs=("runs/tune-tau/anchors.safetensors",),
        setup=("kvprof tune-tau --out runs/tune-tau",),
    ),
    "replay-tuned": Example(
        (
            "kvprof replay world/sample_traces/prompt_tune.jsonl --skip 12 --tuned runs/tune-tau/tuned.json"
            " --policy fullshared --online --out runs/replay-tuned",
        ),
        needs=("runs/tune-tau/tuned.json",),
        setup=("kvprof tune-tau --out runs/tune-tau",),
    ),
    # a Markdown table (kernels.md includes it as one): ptxas' registers and spills of every shipped configuration
    "simulate-validation": Example(
        (
            "kvprof simulate tests/data/simulate/replay.json --calibration tests/data/simulate/serve_bench.json"
            " --fit-load 1 --qps 2 --duration 60 --out runs/simulate-validation",
        ),
    ),
    "simulate-kvcmas": Example(
        (
            "kvprof simulate runs/replay-delta/replay.json --device-model a100 --shapes --shared-tokens 8192"
            " --shared-tokens 32768 --qps 1 --qps 8 --duration 300 --out runs/simulate-kvcmas",
        ),
        needs=("runs/replay-delta/replay.json",),
        setup=("python scripts/docs_examples.py run replay-delta",),
    ),
    "simulate-precache": Example(
        (
            "kvprof simulate runs/demo-full/replay/replay.json --device-model a100 --shapes --qps 0.5 --qps 2"
            " --duration 300 --out runs/simulate-precache",
        ),
        needs=("runs/demo-full/replay/replay.json",),
        setup=("kvprof demo --full --out runs/demo-full",),
    ),
    "recommend": Example(
        tuple(
            "kvprof recommend lora=runs/demo/replay/replay.json prompt=runs/demo/prompt_sharing/replay.json"
            f" --target 'accuracy-drop<=1pt, kl<=0.01, ttft-p90<=150ms, load={load}qps' --fit-replay --split 0.5"
            f" --duration 60 --out runs/recommend-{load}qps"
            for load in (2, 32)
        ),
        needs=("runs/demo/replay/replay.json", "runs/demo/prompt_sharing/replay.json"),
        setup=("kvprof demo --out runs/demo",),
    ),
    "kernels-aot": Example(("python tests/test_kernels_aot.py",)),
    "bench": Example(("kvprof bench --device cpu --seq-lens 256 --ranks 16 --threads 1 --out runs/bench",)),
}


def scrub(text: str) -> str:
    """The output with this machine's paths made relative: the repository root, then the home directory."""
    root = str(REPO)
    text = text.replace(root + "/", "").replace(root, ".")
    return text.replace(str(Path.home()) + "/", "~/")


def argv(command: str) -> list[str]:
    """The program a shown command line runs: `kvprof` and `python` as this interpreter."""
    words = shlex.split(command)
    if words[0] == "kvprof":
        return [sys.executable, "-c", KVPROF, *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def execute(command: str, extra: tuple[tuple[str, str], ...] = ()) -> str:
    """Run one command line from the repository root (with the `extra` environment variables); its stdout and stderr,
    as the terminal shows them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(WIDTH), **dict(extra)}
    done = subprocess.run(argv(command), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}")
    return done.stdout


def run(name: str) -> Path:
    """Run one example (its setup first where a file it needs is missing) and write its output file."""
    example = EXAMPLES[name]
    world = REPO / "world"
    if not world.exists():
        world.symlink_to(Path("kvprof") / "demo" / "assets")
    if any(not (REPO / need).exists() for need in example.needs):
        for command in example.setup:
            execute(command, example.env)
    shown = []
    for command in example.commands:
        output = execute(command, example.env)
        if example.keep_from:
            lines = output.splitlines(keepends=True)
            start = next((i for i, line in enumerate(lines) if line.startswith(example.keep_from)), 0)
            output = "".join(lines[start:])
        shown.append(f"$ {command}\n{output}")
    path = EXAMPLES_DIR / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scrub("".join(shown)).rstrip("\n") + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the registered examples and their commands")
    runner = sub.add_parser("run", help="run examples for real and write docs/examples/NAME.txt")
    runner.add_argument("names", nargs="+", choices=sorted(EXAMPLES), metavar="NAME")
    args = parser.parse_args()
    if args.action == "list":
        for name, example in EXAMPLES.items():
            print(f"{name}:")
            for command in example.commands:
                print(f"  $ {command}")
        return
    for name in args.names:
        print(f"wrote {run(name).relative_to(REPO)}")


if __name__ == "__main__":
    main()
