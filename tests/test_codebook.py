"""The codebook world (`kvprof.demo.codebook`): tasks, gold outputs and the training drills."""

from __future__ import annotations

import json
import random
import re

import pytest

from kvprof.capture.workflow import exact_match, parse_answer
from kvprof.demo import codebook
from kvprof.demo.codebook import ROLES, make_task, make_tasks, read_tasks, workflow_spec
from kvprof.demo.data import oracle_trajectory
from kvprof.demo.train_codebook import TrainConfig, build_tokenizer, check_drill, decode_drill, run
from kvprof.demo.world import write_tasks


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(make_tasks("train", 300), vocab_size=600)


def test_tasks_are_deterministic_and_splits_differ():
    assert make_task("train", 3).to_json() == make_task("train", 3).to_json()
    assert make_task("train", 3).to_json() != make_task("heldout", 3).to_json()
    assert make_task("heldout", 3).task.question == make_tasks("heldout", 5)[3].task.question


def test_the_answer_is_the_reviewers_colour_for_the_asked_symbol():
    for task in make_tasks("heldout", 50):
        assert (task.dock, task.symbol) in task.cargo
        assert f"dock {task.dock.upper()} of ship {task.ship}?" in task.task.question
        for role in ROLES:
            key = task.task.private[role]
            assert key.count(" " + task.symbol) == 1
            assert codebook.entry(task.symbol, task.colours[role]) in key.split()
        assert task.task.answer == task.colours["reflect"]
        assert task.task.answer not in task.task.question and task.task.answer not in task.manifest_text
    # independent keys: the clerk's reading differs from the reviewer's on most tasks
    tasks = make_tasks("heldout", 200)
    assert 0.6 < sum(t.colours["act"] != t.colours["reflect"] for t in tasks) / len(tasks) < 0.9


def test_gold_outputs_and_answer_pattern():
    task = make_task("train", 0)
    assert task.output("act", 0) == f" search[ {task.ship}]\n"
    assert task.output("act", 1) == f" finish[ {task.dock} {task.colours['act']}]\n"
    assert task.output("reflect", 0) == f" answer[ {task.dock} unknown]\n"
    assert parse_answer(workflow_spec(), task.output("reflect", 1)) == task.colours["reflect"]
    drill = make_task("train", 0, asks="symbol")
    assert drill.output("reflect", 1) == f" answer[ {drill.dock} {drill.symbol}]\n"


def test_every_looked_up_word_is_one_token(tokenizer):
    for word in codebook.vocabulary_words():
        assert len(tokenizer.encode(" " + word)) == 1, word


def test_oracle_trajectory_solves_the_task(tokenizer):
    task = make_task("heldout", 7)
    traj = oracle_trajectory(workflow_spec(), tokenizer, task)
    assert [turn.agent for turn in traj.turns] == ["act", "act", "reflect"]
    assert exact_match(traj.prediction, task.task.answer)
    prefixes = traj.private_prefixes()
    assert len({len(tokens) for tokens in prefixes.values()}) == len(ROLES)  # shared segments at different positions
    assert task.manifest_text in traj.segments["obs:0"].text


def test_drills_answer_from_the_roles_key(tokenizer):
    task = make_task("train", 11)
    rng = random.Random(0)
    example = check_drill(tokenizer, task, "colour", rng)
    text = tokenizer.decode([t for t, target in zip(example.tokens, example.targets) if target])
    role = next(r for r in ROLES if tokenizer.decode(example.tokens).startswith(codebook.ROLE_PROMPTS[r]))
    key = {entry[:2]: entry[2:] for entry in task.task.private[role].split()[1:-1]}
    pairs = re.findall(r" (\w+) (\w+)", text.removeprefix("Check:"))
    assert sorted(pairs) == sorted((dock, key[symbol]) for dock, symbol in task.cargo)
    example = decode_drill(tokenizer, task, rng)
    text = tokenizer.decode([t for t, target in zip(example.tokens, example.targets) if target])
    role = next(r for r in ROLES if tokenizer.decode(example.tokens).startswith(codebook.ROLE_PROMPTS[r]))
    key = {entry[:2]: entry[2:] for entry in task.task.private[role].split()[1:-1]}
    assert all(key[symbol] == colour for symbol, colour in re.findall(r" (\w+) (\w+)", text.removeprefix("Decode:")))


def test_files_round_trip(tmp_path):
    tasks = make_tasks("long", 3)
    assert [t.to_json() for t in read_tasks(write_tasks(tmp_path / "t.jsonl", tasks))] == [t.to_json() for t in tasks]


def test_training_phases_end_at_their_checks(tmp_path):
    """A phase stops at the first check that meets its target (recall: any loss below 100) and otherwise runs its
    step budget; every check is recorded."""
    config = TrainConfig(
        hidden=32, intermediate=64, heads=4, kv_heads=2, tokenizer_tasks=300, recall_steps=6, recall_done_loss=100.0,
        lookup_steps=4, decode_steps=4, check_every=2, eval_tasks=4, heldout_tasks=2, long_tasks=1,
    )  # fmt: skip
    record = run(tmp_path, config)
    assert record["phases"]["recall"]["steps"] == 2
    assert [check["step"] for check in record["phases"]["lookup"]["checks"]] == [2, 4]
    assert record["phases"]["decode"]["steps"] == 4
    assert json.loads((tmp_path / "training.json").read_text())["phases"] == record["phases"]
    assert (tmp_path / "model" / "model.safetensors").exists() and len(
        read_tasks(tmp_path / "tasks" / "heldout.jsonl")
    ) == 2


def test_standing_keys_are_one_text_per_agent():
    """The `standing` split: every task gives an agent the same key (one fixed prefix), and the answer still
    follows it; held-out keys change with every task."""
    standing = make_tasks("standing", 20)
    for role in ROLES:
        assert len({task.task.private[role] for task in standing}) == 1
        assert len({task.task.private[role] for task in make_tasks("heldout", 20)}) == 20
    for task in standing:
        assert codebook.entry(task.symbol, task.task.answer) in task.task.private["reflect"].split()
    assert len({task.task.question for task in standing}) > 10
