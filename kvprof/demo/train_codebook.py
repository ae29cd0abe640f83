"""Train the codebook world (`kvprof.demo.codebook`) from scratch on CPU: tokenizer, a two-layer model, world files.

    python -m kvprof.demo.train_codebook [--out DIR] [--seed N]

Phases (tokenizer, recall, keys, lookup, decode, world), their targets and measured steps: docs/demo-worlds.md
("The codebook world"). Each checks every 250 steps and stops at its target or step budget; records in
OUT/training.json. Deterministic for a fixed seed and thread count; loss on output and drill-answer tokens only.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
import typer

from kvprof.demo import codebook
from kvprof.demo.codebook import ROLE_PROMPTS, ROLES, CodebookTask, make_tasks, workflow_spec
from kvprof.demo.data import IGNORE, Example, batches, collate, own_turn_examples, sample_examples
from kvprof.demo.tokenizer import train_bpe
from kvprof.demo.train import _tail, model_config, train_loop
from kvprof.demo.world import write_tasks, write_workflow_toml
from kvprof.fileio import write_json
from kvprof.profiling import torch_settings
from kvprof.ui import progress

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerFast


@dataclass
class TrainConfig:
    """Everything that decides the weights (with the seed); recorded in training.json."""

    seed: int = 0
    threads: int = 2
    tokenizer_tasks: int = 2000
    vocab_size: int = 600
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 768
    max_positions: int = 4096
    recall_steps: int = 2000  # at most; ends once the mean loss of the last 20 steps is below recall_done_loss
    recall_done_loss: float = 0.05
    recall_batch: int = 256
    recall_lr: float = 3e-3
    keys_steps: int = 1500  # at most; ends like the recall phase
    lookup_steps: int = 2000  # at most; ends once symbol tasks' held-out reviewer is at least done_accuracy
    decode_steps: int = 6000  # at most; ends once colour tasks' held-out finish and reviewer are at least done_accuracy
    done_accuracy: float = 0.95
    check_every: int = 250
    lr: float = 2e-3
    warmup: int = 50
    pool_tasks: int = 64
    symbol_share: float = 0.5  # symbol-asking tasks per colour task in the lookup and decode phases
    token_budget: int = 4096
    eval_tasks: int = 100
    heldout_tasks: int = 250
    long_tasks: int = 4


def build_tokenizer(tasks: list[CodebookTask], vocab_size: int):
    """Byte-level BPE on `codebook.corpus(tasks)`; refuses one that splits a `codebook.vocabulary_words()` word."""
    tokenizer = train_bpe(codebook.corpus(tasks), vocab_size, max_length=4096)
    split = [word for word in codebook.vocabulary_words() if len(tokenizer.encode(" " + word)) != 1]
    if split:
        raise RuntimeError(f"the tokenizer splits {split[:5]}; raise vocab_size")
    return tokenizer


# ---------------------------------------------------------------------------------------------------- drills


def _word_ids(tokenizer, words) -> list[int]:
    return [tokenizer.encode(" " + word, add_special_tokens=False)[0] for word in words]


def recall_stream(tokenizer, cfg: TrainConfig) -> Iterator[list[Example]]:
    """Endless recall batches: 2–8 `key value` pairs (docks/ships → symbols/colours), then the keys shuffled, each
    followed by its value (the loss)."""
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


def key_stream(tokenizer, cfg: TrainConfig) -> Iterator[list[Example]]:
    """Endless key-lookup batches (interleaved with `recall_stream`'s): 4–12 entries, then their symbols shuffled,
    each followed by its colour (the loss)."""
    recall = recall_stream(tokenizer, cfg)
    rng = random.Random(f"{cfg.seed}/keys")
    while True:
        batch = next(recall)[: cfg.recall_batch // 2]
        while len(batch) < cfg.recall_batch:
            symbols = rng.sample(codebook.SYMBOLS, rng.randint(4, 12))
            key = {symbol: rng.choice(codebook.COLOURS) for symbol in symbols}
            context = _word_ids(tokenizer, [codebook.entry(symbol, colour) for symbol, colour in key.items()])
            rng.shuffle(symbols)
            queries = [token for symbol in symbols for token in _word_ids(tokenizer, [symbol, key[symbol]])]
            targets = [False] * len(context) + [index % 2 == 1 for index in range(len(queries))]
            batch.append(Example(tokens=context + queries, targets=targets, role="keys"))
        yield batch


def _key(task: CodebookTask, role: str) -> dict[str, str]:
    """`role`'s key for `task`: symbol → colour, read back from its private text."""
    entries = task.task.private[role].split()[1:-1]  # "Key:" entries "."
    return {entry[:2]: entry[2:] for entry in entries}


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def check_drill(tokenizer, task: CodebookTask, asks: str, rng: random.Random) -> Example:
    """A role's prefix, the asked manifest, then its docks shuffled each followed by its symbol (`asks="symbol"`) or
    the role's colour; loss on the check line."""
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
    """Endless batches: per pool, `pool_tasks` colour tasks and `symbol_share` × as many symbol tasks (every role on a
    random turn), a symbol and a colour check drill per task (+ a decode drill with `decode`), in
    `token_budget`-token batches."""
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
    """Held-out per-call exact match by canonical turn (`act:search`, `act:finish`, `reflect`), teacher-forced."""
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


@dataclass
class _Phases:
    """The training phases of one model, each recorded in `record` (seconds, steps, final loss, held-out checks)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    cfg: TrainConfig
    bar: Progress
    record: dict
    eval_tasks: list[CodebookTask]
    eval_symbol_tasks: list[CodebookTask]

    def train(self, name: str, steps: int, stream: Iterator[list[Example]], lr: float, bf16: bool, done) -> None:
        """Up to `steps` steps, ending once `done(check)` holds (checked and recorded every `check_every` steps)."""
        job = self.bar.add_task(name, total=steps)
        began = time.perf_counter()
        checks: list[dict] = []

        def step(index: int, loss: float) -> None:
            self.bar.update(job, completed=index + 1, description=f"{name} loss {loss:.3f}")

        def stop(index: int, losses: list[float]) -> bool:
            if (index + 1) % self.cfg.check_every:
                return False
            check = {
                "step": index + 1,
                "loss": _tail(losses),
                "colour": per_call_accuracy(self.model, self.tokenizer, self.eval_tasks),
                "symbol": per_call_accuracy(self.model, self.tokenizer, self.eval_symbol_tasks),
            }
            self.model.train()
            checks.append(check)
            self.bar.console.print(f"{name} {json.dumps(check)}")
            return done(check)

        cfg = self.cfg
        parameters = list(self.model.parameters())
        pad = self.tokenizer.pad_token_id
        losses = train_loop(self.model, parameters, stream, steps, lr, cfg.warmup, pad, step, bf16=bf16, stop=stop)
        self.record[name] = {
            "seconds": round(time.perf_counter() - began, 1),
            "steps": len(losses),
            "final_loss": _tail(losses),
            "checks": checks,
        }


def _train_phases(phases: _Phases) -> None:
    """Recall, keys, lookup, decode: each until its own criterion holds or its step budget ends."""
    cfg, tokenizer = phases.cfg, phases.tokenizer

    def recalled(check: dict) -> bool:
        return check["loss"] < cfg.recall_done_loss

    phases.train("recall", cfg.recall_steps, recall_stream(tokenizer, cfg), cfg.recall_lr, False, recalled)
    phases.train("keys", cfg.keys_steps, key_stream(tokenizer, cfg), cfg.recall_lr, False, recalled)
    phases.train(
        "lookup",
        cfg.lookup_steps,
        task_stream(tokenizer, cfg, "lookup", decode=False),
        cfg.lr,
        True,
        lambda check: check["symbol"]["reflect"] >= cfg.done_accuracy,
    )
    phases.train(
        "decode",
        cfg.decode_steps,
        task_stream(tokenizer, cfg, "decode", decode=True),
        cfg.lr,
        True,
        lambda check: min(check["colour"]["act:finish"], check["colour"]["reflect"]) >= cfg.done_accuracy,
    )


def run(out: Path, cfg: TrainConfig) -> dict:
    """All phases into `out`; returns the training record (also written to OUT/training.json)."""
    with torch_settings(cfg.threads, deterministic=True):
        return _run(out, cfg)


def _run(out: Path, cfg: TrainConfig) -> dict:
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"config": asdict(cfg), "phases": {}}
    eval_tasks = make_tasks("heldout", cfg.eval_tasks, start=10_000)
    eval_symbol_tasks = make_tasks("heldout", cfg.eval_tasks, start=20_000, asks="symbol")
    started = time.perf_counter()
    with progress() as bar:
        began = time.perf_counter()
        tokenizer = build_tokenizer(make_tasks("train", cfg.tokenizer_tasks), cfg.vocab_size)
        tokenizer.save_pretrained(out / "model")
        record["phases"]["tokenizer"] = {"seconds": round(time.perf_counter() - began, 1), "vocab_size": len(tokenizer)}
        torch.manual_seed(cfg.seed)
        config = model_config(cfg, tokenizer)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config)
        _train_phases(_Phases(model, tokenizer, cfg, bar, record["phases"], eval_tasks, eval_symbol_tasks))
        model.save_pretrained(out / "model")
        record["parameters"] = sum(p.numel() for p in model.parameters())
        write_workflow_toml(out / "workflow_prompt.toml", workflow_spec())
        write_tasks(out / "tasks" / "heldout.jsonl", make_tasks("heldout", cfg.heldout_tasks))
        write_tasks(out / "tasks" / "long.jsonl", make_tasks("long", cfg.long_tasks))
        write_tasks(out / "tasks" / "standing.jsonl", make_tasks("standing", cfg.heldout_tasks))
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
