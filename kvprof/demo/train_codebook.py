"""Train the codebook world (`kvprof.demo.codebook`) from scratch on CPU: tokenizer, a two-layer model, world files.

    python -m kvprof.demo.train_codebook [--out DIR] [--seed N]

Phases (each with a progress bar; timings, losses and per-call held-out accuracy go to OUT/training.json):

1. tokenizer — byte-level BPE on the training tasks' texts; every word the solution looks up in one hop (a key
   entry, a symbol, a colour, a dock, a ship) must be one token, or training stops.
2. recall — multi-query associative recall drills on the world's words (`dock symbol` pairs, then the docks again in
   another order, each followed by its symbol), 256 short sequences a step. They grow the induction circuit the
   manifest lookup needs (a previous-token head in layer 1, a head in layer 2 that attends to the token after an
   earlier occurrence of the current one); on the task alone it did not appear in 2,000+ steps.
3. lookup — the workflow (every role on every turn, `kvprof.demo.data`) with a third of the tasks asking for the
   symbol at the dock instead of its colour, and check drills (manifest, then its docks in shuffled order, each
   followed by its symbol or its colour in the agent's key): the second layer learns to find the asked dock.
4. decode — the same plus decode drills (the key, then symbols each followed by their colour): the first layer
   learns to look each manifest symbol up in the key, which is what makes the shared tokens' K/V depend on the
   agent that computed them.
5. world — workflow file, held-out and long tasks.

Measured with the defaults (seed 0, 2 threads, 35 minutes): the recall drills never made their abrupt transition
(loss 1.09 after 4,000 steps; a probe with the same drills and model made it between steps 1,250 and 1,500), so
the lookup and decode phases stayed at chance on the colour (per call: finish 28 %, reviewer 21 %); nothing is
shipped from it yet (docs/design.md, "The codebook world").

Deterministic for a fixed seed and thread count. The loss is taken on output (and drill answer) tokens only: the
rest of a trajectory is random keys and manifests, nothing to model.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import torch
import typer

from kvprof.demo import codebook
from kvprof.demo.codebook import ROLE_PROMPTS, ROLES, CodebookTask, make_tasks, workflow_spec
from kvprof.demo.data import IGNORE, Example, batches, collate, own_turn_examples, sample_examples
from kvprof.demo.tokenizer import train_bpe
from kvprof.demo.train import _tail, model_config, train_loop
from kvprof.demo.world import write_tasks, write_workflow_toml
from kvprof.fileio import write_json
from kvprof.ui import progress


@dataclass
class TrainConfig:
    """Everything that decides the weights (with the seed); recorded in training.json."""

    seed: int = 0
    threads: int = 2
    tokenizer_tasks: int = 2000
    vocab_size: int = 600
    hidden: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 384
    max_positions: int = 4096
    recall_steps: int = 4000
    recall_batch: int = 256
    recall_lr: float = 3e-3
    lookup_steps: int = 3000
    decode_steps: int = 7000
    lr: float = 2e-3
    warmup: int = 50
    pool_tasks: int = 64
    symbol_share: float = 0.5  # symbol-asking tasks per colour task in the lookup and decode phases
    token_budget: int = 4096
    eval_tasks: int = 100
    heldout_tasks: int = 250
    long_tasks: int = 4


def build_tokenizer(tasks: list[CodebookTask], vocab_size: int):
    """Byte-level BPE on `codebook.corpus(tasks)` (`kvprof.demo.tokenizer.train_bpe`); refuses a vocabulary that
    splits one of `codebook.vocabulary_words()`."""
    tokenizer = train_bpe(codebook.corpus(tasks), vocab_size, max_length=4096)
    split = [word for word in codebook.vocabulary_words() if len(tokenizer.encode(" " + word)) != 1]
    if split:
        raise RuntimeError(f"the tokenizer splits {split[:5]}; raise vocab_size")
    return tokenizer


# ---------------------------------------------------------------------------------------------------- drills


def _word_ids(tokenizer, words) -> list[int]:
    return [tokenizer.encode(" " + word, add_special_tokens=False)[0] for word in words]


def recall_stream(tokenizer, cfg: TrainConfig) -> Iterator[list[Example]]:
    """Endless batches of associative recall: 2–8 `key value` pairs (keys: docks and ships; values: symbols and
    colours), then every key again in shuffled order followed by its value; loss on those values."""
    keys = _word_ids(tokenizer, codebook.DOCKS + codebook.SHIPS)
    values = _word_ids(tokenizer, codebook.SYMBOLS + codebook.COLOURS)
    rng = random.Random(f"{cfg.seed}/recall")
    while True:
        batch = []
        for _ in range(cfg.recall_batch):
            chosen = rng.sample(keys, rng.randint(2, 8))
            pairs = [(key, rng.choice(values)) for key in chosen]
            context = [token for pair in pairs for token in pair]
            rng.shuffle(pairs)
            queries = [token for pair in pairs for token in pair]
            targets = [False] * len(context) + [index % 2 == 1 for index in range(len(queries))]
            batch.append(Example(tokens=context + queries, targets=targets, role="recall"))
        yield batch


def _key(task: CodebookTask, role: str) -> dict[str, str]:
    """`role`'s key for `task`: symbol → colour, read back from its private text."""
    entries = task.task.private[role].split()[1:-1]  # "Key:" entries "."
    return {entry[:2]: entry[2:] for entry in entries}


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def check_drill(tokenizer, task: CodebookTask, asks: str, rng: random.Random) -> Example:
    """A role's prefix, the asked ship's manifest as an observation, then its docks in shuffled order each followed
    by its symbol (`asks="symbol"`) or the role's colour for it; loss on the check line."""
    role = rng.choice(ROLES)
    key = _key(task, role)
    prefix = _encode(tokenizer, ROLE_PROMPTS[role] + task.task.private[role])
    observation = _encode(tokenizer, workflow_spec().observation_template.format(observation=task.manifest_text))
    cargo = list(task.cargo)
    rng.shuffle(cargo)
    line = " ,".join(f" {dock} {symbol if asks == 'symbol' else key[symbol]}" for dock, symbol in cargo)
    check = _encode(tokenizer, "Check:" + line + "\n")
    context = prefix + observation
    return Example(tokens=context + check, targets=[False] * len(context) + [True] * len(check), role=role)


def decode_drill(tokenizer, task: CodebookTask, rng: random.Random) -> Example:
    """A role's prefix, then 3–8 symbols each followed by the colour its key gives them; loss on that line."""
    role = rng.choice(ROLES)
    key = _key(task, role)
    prefix = _encode(tokenizer, ROLE_PROMPTS[role] + task.task.private[role])
    symbols = rng.sample(codebook.SYMBOLS, rng.randint(3, 8))
    line = _encode(tokenizer, "Decode:" + " ,".join(f" {symbol} {key[symbol]}" for symbol in symbols) + "\n")
    return Example(tokens=prefix + line, targets=[False] * len(prefix) + [True] * len(line), role=role)


def task_stream(tokenizer, cfg: TrainConfig, salt: str, decode: bool) -> Iterator[list[Example]]:
    """Endless batches: pool p holds `pool_tasks` colour tasks and `symbol_share` × as many symbol tasks (every
    role on a random turn of each), a symbol and a colour check drill per task, and with `decode` a decode drill
    per task; grouped by length into `token_budget`-token batches."""
    spec = workflow_spec()
    symbol_tasks = int(cfg.pool_tasks * cfg.symbol_share)
    pool = 0
    while True:
        rng = random.Random(f"{cfg.seed}/{salt}/{pool}")
        start = cfg.tokenizer_tasks + pool * cfg.pool_tasks
        tasks = make_tasks("train", cfg.pool_tasks, start=start) + make_tasks(
            "train", symbol_tasks, start=10**7 + start, asks="symbol"
        )
        examples = [ex for task in tasks for ex in sample_examples(spec, tokenizer, task, ROLES, rng)]
        examples += [check_drill(tokenizer, task, asks, rng) for task in tasks for asks in ("symbol", "colour")]
        if decode:
            examples += [decode_drill(tokenizer, task, rng) for task in tasks]
        yield from batches(examples, cfg.token_budget, rng)
        pool += 1


@torch.inference_mode()
def per_call_accuracy(model, tokenizer, tasks: list[CodebookTask]) -> dict[str, float]:
    """Held-out per-call exact match by canonical turn (`act:search`, `act:finish`, `reflect`): the fraction whose
    whole gold output is the greedy argmax at every position, teacher-forced on gold inputs."""
    spec = workflow_spec()
    names = ("act:search", "act:finish", "reflect")
    by_turn: dict[str, list[Example]] = {name: [] for name in names}
    for task in tasks:
        for name, example in zip(names, own_turn_examples(spec, tokenizer, task)):
            by_turn[name].append(example)
    result = {}
    for name, examples in by_turn.items():
        input_ids, labels, _ = collate(examples, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids).logits[:, :-1]
        hit = (logits.argmax(-1) == labels[:, 1:]) | (labels[:, 1:] == IGNORE)
        result[name] = round(float(hit.all(dim=1).float().mean()), 3)
    return result


# ---------------------------------------------------------------------------------------------------- phases


def run(out: Path, cfg: TrainConfig) -> dict:
    """All phases into `out`; returns the training record (also written to OUT/training.json)."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"config": asdict(cfg), "phases": {}}
    eval_tasks = make_tasks("heldout", cfg.eval_tasks, start=10_000)
    started = time.perf_counter()
    with progress() as bar:

        def phase(name: str, steps: int, stream: Iterator[list[Example]], lr: float) -> None:
            job = bar.add_task(name, total=steps)
            began = time.perf_counter()

            def step(index: int, loss: float) -> None:
                bar.update(job, completed=index + 1, description=f"{name} loss {loss:.3f}")

            model.train()
            losses = train_loop(
                model, list(model.parameters()), stream, steps, lr, cfg.warmup, tokenizer.pad_token_id, step
            )
            record["phases"][name] = {
                "seconds": round(time.perf_counter() - began, 1),
                "final_loss": _tail(losses),
                "per_call_heldout": per_call_accuracy(model, tokenizer, eval_tasks),
            }

        began = time.perf_counter()
        tokenizer = build_tokenizer(make_tasks("train", cfg.tokenizer_tasks), cfg.vocab_size)
        tokenizer.save_pretrained(out / "model")
        record["phases"]["tokenizer"] = {"seconds": round(time.perf_counter() - began, 1), "vocab_size": len(tokenizer)}
        torch.manual_seed(cfg.seed)
        config = model_config(cfg, tokenizer)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config)
        phase("recall", cfg.recall_steps, recall_stream(tokenizer, cfg), cfg.recall_lr)
        phase("lookup", cfg.lookup_steps, task_stream(tokenizer, cfg, "lookup", decode=False), cfg.lr)
        phase("decode", cfg.decode_steps, task_stream(tokenizer, cfg, "decode", decode=True), cfg.lr)
        model.save_pretrained(out / "model")
        record["parameters"] = sum(p.numel() for p in model.parameters())
        write_workflow_toml(out / "workflow_prompt.toml", workflow_spec())
        write_tasks(out / "tasks" / "heldout.jsonl", make_tasks("heldout", cfg.heldout_tasks))
        write_tasks(out / "tasks" / "long.jsonl", make_tasks("long", cfg.long_tasks))
    record["seconds"] = round(time.perf_counter() - started, 1)
    write_json(out / "training.json", record)
    return record


def main(
    out: Annotated[Path, typer.Option("--out", help="Output directory (default: the packaged assets).")] = Path(
        __file__
    ).parent
    / "assets"
    / "codebook",
    seed: Annotated[int, typer.Option("--seed", help="Seed of every random choice.")] = 0,
) -> None:
    """Train the codebook world (see module docstring) and print its per-call held-out accuracy."""
    record = run(out, TrainConfig(seed=seed))
    print(json.dumps(record["phases"], indent=1))


if __name__ == "__main__":
    typer.run(main)
