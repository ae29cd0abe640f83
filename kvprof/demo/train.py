"""Train the demo world from scratch on CPU: tokenizer, base model, role adapters, shared-A and aLoRA adapters.

    python -m kvprof.demo.train [--out DIR] [--seed N]
    python -m kvprof.demo.train --set alora --set alora_qv [--out DIR]   # only those sets, on the base in DIR

Phases, drills and settings: docs/demo-worlds.md ("Training phases"). Deterministic for a fixed seed and thread
count; bf16 autocast (fp32 master weights); loss on output tokens only; records in OUT/training.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Protocol

import torch
import typer

from kvprof.demo.data import IGNORE, Example, batches, collate, own_turn_examples, sample_examples
from kvprof.demo.tokenizer import build_tokenizer
from kvprof.demo.world import (
    CUE,
    RELATION_WORDS,
    ROLES,
    make_task,
    make_tasks,
    workflow_spec,
    write_tasks,
    write_workflow_toml,
)
from kvprof.errors import KvprofError
from kvprof.fileio import write_json
from kvprof.profiling import torch_settings
from kvprof.ui import progress

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
QV_TARGETS = ("q_proj", "v_proj")  # PReCache's main results and LRAgent's setting: K is the base's, fully shared


@dataclass
class TrainConfig:
    """Everything that decides the weights (with the seed); recorded in training.json."""

    seed: int = 0
    threads: int = 2
    tokenizer_tasks: int = 3000
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    max_positions: int = 32768
    token_budget: int = 2048
    pool_tasks: int = 64
    warmup_steps: int = 300
    warmup_batch: int = 24
    warmup_every: int = 4
    base_steps: int = 3000
    short_steps: int = 1200
    short_distractors: tuple[int, int] = (0, 2)
    base_lr: float = 1e-3
    recall_steps: int = 900
    recall_rounds: int = 2
    recall_every: int = 2
    context_weight: float = 0.5
    warmup: int = 30
    adapter_rank: int = 8
    adapter_steps: int = 200
    adapter_lr: float = 3e-3
    shared_a_lr: float = 5e-3
    eval_tasks: int = 100
    heldout_tasks: int = 250
    long_tasks: int = 2


@dataclass(frozen=True)
class AdapterSet:
    """One adapter set: its folder under OUT/adapters (and workflow_{workflow}.toml), targets, r, α, the projections
    whose frozen seeded A every role shares, its seed offset, and whether it is Activated LoRA invoked by the cue."""

    name: str
    workflow: str
    targets: tuple[str, ...]
    rank: int
    alpha: int
    shared_a: tuple[str, ...]
    seed_offset: int
    activated: bool = False


def adapter_sets(cfg: TrainConfig) -> tuple[AdapterSet, ...]:
    """q/k/v/o at `cfg.adapter_rank` (α = 2r) and its shared-A twin, the papers' q/v (r=8, α=16) and its twin (A
    shared on v_proj), then the aLoRA twins of the q/k/v/o and q/v sets."""
    rank = cfg.adapter_rank
    return (
        AdapterSet("lora", "lora", LORA_TARGETS, rank, 2 * rank, (), 1),
        AdapterSet("shared_a", "lora_shared_a", LORA_TARGETS, rank, 2 * rank, LORA_TARGETS, 2),
        AdapterSet("lora_qv", "lora_qv", QV_TARGETS, 8, 16, (), 3),
        AdapterSet("shared_a_qv", "lora_shared_a_qv", QV_TARGETS, 8, 16, ("v_proj",), 4),
        AdapterSet("alora", "alora", LORA_TARGETS, rank, 2 * rank, (), 5, activated=True),
        AdapterSet("alora_qv", "alora_qv", QV_TARGETS, 8, 16, (), 6, activated=True),
    )


class ModelShape(Protocol):
    """The model-size fields of a world's training config (`TrainConfig`, `train_codebook.TrainConfig`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int


def model_config(cfg: ModelShape, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads,
        max_position_embeddings=cfg.max_positions,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


# ---------------------------------------------------------------------------------------------------- the loop


def example_stream(
    mode: str,
    tokenizer,
    roles: tuple[str, ...],
    cfg: TrainConfig,
    salt: str,
    distractors: tuple[int, int] | None = None,
) -> Iterator[list[Example]]:
    """Endless batches: pool p draws training tasks p·P … (p+1)·P − 1 (`distractors` per paragraph; None: the split's),
    one example per role each, grouped into `token_budget`-token batches."""
    spec = workflow_spec(mode)
    pool = 0
    while True:
        rng = random.Random(f"{cfg.seed}/{salt}/{pool}")
        tasks = make_tasks(
            "train", cfg.pool_tasks, start=cfg.tokenizer_tasks + pool * cfg.pool_tasks, distractors=distractors
        )
        examples = [ex for task in tasks for ex in sample_examples(spec, tokenizer, task, roles, rng)]
        yield from batches(examples, cfg.token_budget, rng)
        pool += 1


RELATION_VALUE = re.compile(rf"\b({'|'.join(RELATION_WORDS)}) (\w+)")


def recall_example(tokenizer, paragraph: str, rng: random.Random) -> Example:
    """Associative recall on one paragraph: the paragraph, then " Plan:" and its relations in random order each
    followed by its value (loss on the values): the plan's lookup alone."""
    pairs = RELATION_VALUE.findall(paragraph)
    rng.shuffle(pairs)
    tokens = tokenizer.encode(f"Observation: {paragraph}\n", add_special_tokens=False)
    targets = [False] * len(tokens)
    for number, (relation, value) in enumerate(pairs):
        key = tokenizer.encode(f" Plan: {relation}" if number == 0 else f", {relation}", add_special_tokens=False)
        answer = tokenizer.encode(f" {value}", add_special_tokens=False)
        tokens += key + answer
        targets += [False] * len(key) + [True] * len(answer)
    return Example(tokens=tokens, targets=targets, role="recall")


def warmup_stream(tokenizer, cfg: TrainConfig) -> Iterator[list[Example]]:
    """Endless batches of copy (a 16–48-token window, 0–120 tokens of other text, the window again; loss on the
    repeat: grows induction heads) and recall (`recall_example`, 0–3 distractors) examples, half each."""
    rng = random.Random(f"{cfg.seed}/warmup")
    while True:
        batch = []
        for index in range(cfg.warmup_batch):
            task = make_task("train", rng.randrange(10**6) + cfg.tokenizer_tasks, distractors=(0, 3))
            text = rng.choice(list(task.task.documents.values()))
            if index % 2 == 0:
                ids = tokenizer.encode(text, add_special_tokens=False)
                width = rng.randint(16, 48)
                start = rng.randint(0, max(0, len(ids) - width))
                window = ids[start : start + width]
                gap = tokenizer.encode(rng.choice(list(task.task.documents.values())), add_special_tokens=False)[
                    : rng.randint(0, 120)
                ]
                batch.append(
                    Example(
                        tokens=window + gap + window,
                        targets=[False] * (len(window) + len(gap)) + [True] * len(window),
                        role="copy",
                    )
                )
                continue
            batch.append(recall_example(tokenizer, text, rng))
        yield batch


def recall_stream(tokenizer, cfg: TrainConfig, salt: str = "") -> Iterator[list[Example]]:
    """Endless batches of `cfg.warmup_batch` recall examples on paragraphs with 0–6 distractor sentences."""
    rng = random.Random(f"{cfg.seed}/recall{salt}")
    while True:
        batch = []
        for _ in range(cfg.warmup_batch):
            task = make_task("train", rng.randrange(10**6) + cfg.tokenizer_tasks, distractors=(0, 6))
            batch.append(recall_example(tokenizer, rng.choice(list(task.task.documents.values())), rng))
        yield batch


def interleave(main: Iterator[list[Example]], extra: Iterator[list[Example]], every: int) -> Iterator[list[Example]]:
    """`main`, with a batch of `extra` in place of every `every`-th one (keeps the warm-up skills general)."""
    for step in itertools.count():
        yield next(extra) if every and step % every == every - 1 else next(main)


def output_loss(
    model, input_ids: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, context_weight: float
) -> torch.Tensor:
    """Mean cross-entropy over output tokens + `context_weight` × the mean over other real tokens. `input_ids`,
    `labels`, `real`: (B, T). The LM head runs only where a loss is taken, except on an aLoRA model (peft finds each
    row's invocation in the whole forward)."""
    if activated_lora(model):
        logits = model(input_ids=input_ids).logits[:, :-1]  # [B, T-1, V]
        scores: Callable[[torch.Tensor], torch.Tensor] = lambda where: logits[where]  # noqa: E731
    else:
        hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state[:, :-1]  # [B, T-1, D]
        head = model.get_output_embeddings()
        scores = lambda where: head(hidden[where])  # noqa: E731
    targets = labels[:, 1:]
    is_output = targets != IGNORE
    loss = torch.nn.functional.cross_entropy(scores(is_output).float(), targets[is_output])
    if context_weight:
        context = real[:, 1:] & ~is_output
        lm = torch.nn.functional.cross_entropy(scores(context).float(), input_ids[:, 1:][context])
        loss = loss + context_weight * lm
    return loss


def activated_lora(model) -> bool:
    """Whether `model` is a peft model whose active adapter is an Activated LoRA."""
    config = getattr(model, "active_peft_config", None)
    return bool(getattr(config, "alora_invocation_tokens", None))


def train_loop(
    model,
    params: list[torch.nn.Parameter],
    stream: Iterator[list[Example]],
    steps: int,
    lr: float,
    warmup: int,
    pad_id: int,
    on_step: Callable[[int, float], None],
    context_weight: float = 0.0,
    bf16: bool = True,
    stop: Callable[[int, list[float]], bool] | None = None,
) -> list[float]:
    """AdamW, linear warm-up, cosine decay to lr/10 over `steps`; returns each step's loss. `bf16`: autocast;
    `stop(step, losses)` ends the loop early."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    model.train()
    losses = []
    for step in range(steps):
        input_ids, labels, real = collate(next(stream), pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = output_loss(model, input_ids, labels, real, context_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        on_step(step, losses[-1])
        if stop is not None and stop(step, losses):
            break
    model.eval()
    return losses


@torch.inference_mode()
def per_call_accuracy(
    model, tokenizer, mode: str, tasks, activate: Callable[[str], contextlib.AbstractContextManager[object]]
) -> dict[str, float]:
    """Held-out per-call exact match: the share of canonical turns whose gold output is the greedy argmax at every
    position, teacher-forced."""
    spec = workflow_spec(mode)
    by_role: dict[str, list[Example]] = {role: [] for role in ROLES}
    for task in tasks:
        for example in own_turn_examples(spec, tokenizer, task):
            by_role[example.role].append(example)
    result = {}
    for role, examples in by_role.items():
        correct = 0
        with activate(role):
            for group in batches(examples, 16384, random.Random(0)):
                input_ids, labels, _ = collate(group, tokenizer.pad_token_id)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=input_ids).logits[:, :-1]
                hit = (logits.argmax(-1) == labels[:, 1:]) | (labels[:, 1:] == IGNORE)
                correct += int(hit.all(dim=1).sum())
        result[role] = correct / len(examples)
    return result


# ---------------------------------------------------------------------------------------------------- phases


class Trainer:
    """Runs the phases in order, recording timings and metrics in `self.record`."""

    def __init__(self, out: Path, cfg: TrainConfig, bar):
        self.out, self.cfg, self.bar = out, cfg, bar
        self.record: dict = {"config": asdict(cfg), "phases": {}}
        self.eval_tasks = make_tasks("heldout", cfg.eval_tasks, start=10_000)

    def phase(self, name: str, total: int):
        job = self.bar.add_task(name, total=total)
        started = time.perf_counter()

        def done(**metrics):
            self.record["phases"][name] = {"seconds": round(time.perf_counter() - started, 1), **metrics}
            self.bar.update(job, completed=total)

        def step(index: int, loss: float) -> None:
            self.bar.update(job, completed=index + 1, description=f"{name} loss {loss:.3f}")

        return step, done

    def tokenizer(self):
        step, done = self.phase("tokenizer", 1)
        tokenizer = build_tokenizer(make_tasks("train", self.cfg.tokenizer_tasks))
        tokenizer.save_pretrained(self.out / "model")
        done(vocab_size=len(tokenizer))
        return tokenizer

    def base(self, tokenizer):
        from transformers import LlamaForCausalLM

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        config = model_config(cfg, tokenizer)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config)
        params = list(model.parameters())
        step, done = self.phase("warm-up", cfg.warmup_steps)
        losses = train_loop(
            model,
            params,
            warmup_stream(tokenizer, cfg),
            cfg.warmup_steps,
            cfg.base_lr,
            cfg.warmup,
            tokenizer.pad_token_id,
            step,
        )
        done(final_loss=_tail(losses))
        step, done = self.phase("base", cfg.base_steps)
        short = example_stream("prompt", tokenizer, ROLES, cfg, "base-short", cfg.short_distractors)
        stream = interleave(
            itertools.chain(
                itertools.islice(short, cfg.short_steps), example_stream("prompt", tokenizer, ROLES, cfg, "base")
            ),
            warmup_stream(tokenizer, cfg),
            cfg.warmup_every,
        )
        losses = train_loop(
            model,
            params,
            stream,
            cfg.base_steps,
            cfg.base_lr,
            cfg.warmup,
            tokenizer.pad_token_id,
            step,
            cfg.context_weight,
        )
        done(
            final_loss=_tail(losses),
            per_call_heldout=per_call_accuracy(
                model, tokenizer, "prompt", self.eval_tasks, lambda role: contextlib.nullcontext()
            ),
        )
        return model

    def recall(self, model, tokenizer, round_: int):
        """Recall round `round_`: the task, every `recall_every`-th batch a drill, fresh optimizer; saves the base."""
        cfg = self.cfg
        salt = "" if round_ == 0 else f"/{round_}"
        step, done = self.phase(f"recall {round_ + 1}", cfg.recall_steps)
        stream = interleave(
            example_stream("prompt", tokenizer, ROLES, cfg, "cont" + salt),
            recall_stream(tokenizer, cfg, salt),
            cfg.recall_every,
        )
        losses = train_loop(
            model,
            list(model.parameters()),
            stream,
            cfg.recall_steps,
            cfg.base_lr,
            cfg.warmup,
            tokenizer.pad_token_id,
            step,
            cfg.context_weight,
        )
        model.save_pretrained(self.out / "model")
        done(
            parameters=sum(p.numel() for p in model.parameters()),
            final_loss=_tail(losses),
            per_call_heldout=per_call_accuracy(
                model, tokenizer, "prompt", self.eval_tasks, lambda role: contextlib.nullcontext()
            ),
        )
        return model

    def adapters(self, model, tokenizer, adapters: AdapterSet):
        """Train `adapters` on the frozen `model`, save them under OUT/adapters; returns the model without them."""
        cfg, name = self.cfg, adapters.name
        peft_model = role_adapters(model, adapters, cfg.seed, tokenizer)
        metrics = {}
        for role in ROLES:
            peft_model.set_adapter(role)
            params = []
            for param_name, param in peft_model.named_parameters():
                trainable = trained(param_name, role, adapters)
                param.requires_grad_(trainable)
                if trainable:
                    params.append(param)
            step, done = self.phase(f"{name}:{role}", cfg.adapter_steps)
            stream = example_stream("lora", tokenizer, (role,), cfg, f"{name}/{role}")
            losses = train_loop(
                peft_model,
                params,
                stream,
                cfg.adapter_steps,
                cfg.shared_a_lr if adapters.shared_a else cfg.adapter_lr,
                cfg.warmup // 3,
                tokenizer.pad_token_id,
                step,
            )
            done(trainable=sum(p.numel() for p in params), final_loss=_tail(losses))
            metrics[role] = losses
        peft_model.save_pretrained(self.out / "adapters" / name)
        _portable(self.out / "adapters" / name)
        accuracy = per_call_accuracy(
            peft_model, tokenizer, "lora", self.eval_tasks, lambda role: _adapter(peft_model, role)
        )
        with peft_model.disable_adapter():
            disabled = per_call_accuracy(
                peft_model, tokenizer, "lora", self.eval_tasks, lambda role: contextlib.nullcontext()
            )
        self.record["phases"][f"{name}:eval"] = {"per_call_heldout": accuracy, "per_call_heldout_disabled": disabled}
        return peft_model.unload()

    def world(self, sets: tuple[AdapterSet, ...], tasks: bool = True):
        """Workflow specs (prompt mode, lora mode per set) and, with `tasks`, the held-out and long tasks."""
        step, done = self.phase("world", 1)
        out = self.out
        if tasks:
            write_workflow_toml(out / "workflow_prompt.toml", workflow_spec("prompt"))
        for adapter_set in sets:
            adapters = {role: str((out / "adapters" / adapter_set.name / role).resolve()) for role in ROLES}
            write_workflow_toml(out / f"workflow_{adapter_set.workflow}.toml", workflow_spec("lora", adapters))
        if tasks:
            write_tasks(out / "tasks" / "heldout.jsonl", make_tasks("heldout", self.cfg.heldout_tasks))
            write_tasks(out / "tasks" / "long.jsonl", make_tasks("long", self.cfg.long_tasks))
        done()


def role_adapters(model, adapters: AdapterSet, seed: int, tokenizer):
    """`model` with one untrained LoRA adapter per role (`adapters`' targets, r, α; no dropout), seeded; on the
    `shared_a` projections every role's A copies the first role's. An activated set is invoked by the cue's ids
    (causal-LM task type, without which peft never applies them)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=adapters.rank, lora_alpha=adapters.alpha, target_modules=list(adapters.targets), lora_dropout=0.0
    )
    if adapters.activated:
        config.alora_invocation_tokens = tokenizer.encode(CUE, add_special_tokens=False)
        config.task_type = "CAUSAL_LM"
    torch.manual_seed(seed + adapters.seed_offset)
    peft_model = get_peft_model(model, config, adapter_name=ROLES[0])
    for role in ROLES[1:]:
        peft_model.add_adapter(role, config)
    for module_name, module in peft_model.named_modules():
        if module_name.rsplit(".", 1)[-1] in adapters.shared_a and ROLES[0] in getattr(module, "lora_A", {}):
            for role in ROLES[1:]:
                module.lora_A[role].weight.data.copy_(module.lora_A[ROLES[0]].weight.data)
    return peft_model


def trained(param_name: str, role: str, adapters: AdapterSet) -> bool:
    """Whether `param_name` trains with `role`'s adapter: its B, and its A except where the roles share A."""
    if f".{role}." not in param_name:
        return False
    projection = param_name.split(".lora_", 1)[0].rsplit(".", 1)[-1]
    return "lora_B" in param_name or projection not in adapters.shared_a


def _portable(folder: Path) -> None:
    """Make saved adapters independent of this machine: base model path relative to each adapter, no model card."""
    (folder / "README.md").unlink(missing_ok=True)
    for config_path in folder.glob("*/adapter_config.json"):
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["base_model_name_or_path"] = "../../../model"
        write_json(config_path, config)


def _tail(losses: list[float], n: int = 20) -> float:
    return round(sum(losses[-n:]) / len(losses[-n:]), 4)


def _adapter(peft_model, role: str) -> contextlib.nullcontext[None]:
    peft_model.set_adapter(role)
    return contextlib.nullcontext()


def run(out: Path, cfg: TrainConfig, only: tuple[str, ...] = ()) -> dict:
    """All phases into `out`; returns the record (also OUT/training.json). `only`: just those adapter sets on the
    base in OUT/model."""
    with torch_settings(cfg.threads, deterministic=True):
        return _run(out, cfg, only)


def _run(out: Path, cfg: TrainConfig, only: tuple[str, ...]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sets = adapter_sets(cfg)
    unknown = sorted(set(only) - {adapter_set.name for adapter_set in sets})
    if unknown:
        raise KvprofError(
            f"--set {', '.join(unknown)}: no such adapter set; pick from {', '.join(s.name for s in sets)}."
        )
    if only:
        sets = tuple(adapter_set for adapter_set in sets if adapter_set.name in only)
    with progress() as bar:
        trainer = Trainer(out, cfg, bar)
        if only:
            tokenizer, model = existing_base(out)
            trainer.record = json.loads((out / "training.json").read_text(encoding="utf-8"))
        else:
            tokenizer = trainer.tokenizer()
            model = trainer.base(tokenizer)
            for round_ in range(cfg.recall_rounds):
                model = trainer.recall(model, tokenizer, round_)
        for adapter_set in sets:
            model = trainer.adapters(model, tokenizer, adapter_set)
        trainer.world(sets, tasks=not only)
    trainer.record["adapter_sets"] = {s.name: asdict(s) for s in adapter_sets(cfg)}
    key = "seconds" if not only else f"seconds_{'+'.join(only)}"
    trainer.record[key] = round(time.perf_counter() - started, 1)
    write_json(out / "training.json", trainer.record)
    return trainer.record


def existing_base(out: Path):
    """The tokenizer and base model a full run saved in OUT/model (fp32, sdpa attention: as training holds them)."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    if not (out / "model" / "config.json").exists():
        raise KvprofError(f"{out / 'model'} holds no base model; train the whole world first (without --set).")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "model")
    model = LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32, attn_implementation="sdpa")
    return tokenizer, model


def main(
    out: Annotated[Path, typer.Option("--out", help="Output directory (default: the packaged assets).")] = Path(
        __file__
    ).parent
    / "assets",
    seed: Annotated[int, typer.Option("--seed", help="Seed of every random choice.")] = 0,
    base_steps: Annotated[int, typer.Option("--base-steps", help="Optimizer steps of the base model.")] = (
        TrainConfig.base_steps
    ),
    adapter_steps: Annotated[int, typer.Option("--adapter-steps", help="Optimizer steps per adapter.")] = (
        TrainConfig.adapter_steps
    ),
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Train only this adapter set (repeatable: lora, shared_a, lora_qv, shared_a_qv, alora, alora_qv) on "
            "the base model already in OUT.",
        ),
    ] = None,
) -> None:
    """Train the demo world (see module docstring) and print its per-call held-out accuracy."""
    record = run(out, TrainConfig(seed=seed, base_steps=base_steps, adapter_steps=adapter_steps), tuple(only or ()))
    print(json.dumps(record["phases"], indent=1))


if __name__ == "__main__":
    typer.run(main)
