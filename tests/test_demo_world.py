"""The demo world's task generator, tokenizer and training layout (no trained weights needed)."""

from __future__ import annotations

import random
import re

import pytest

from kvprof.capture.workflow import SearchTool
from kvprof.demo.data import oracle_trajectory, own_turn_examples, role_example, sample_examples
from kvprof.demo.tokenizer import build_tokenizer
from kvprof.demo.world import (
    INITIALS,
    PERSON_FINALS,
    PLACE_FINALS,
    RELATION_WORDS,
    ROLE_FORMATS,
    ROLE_PROMPTS,
    ROLES,
    SHAPES,
    SYSTEM_PROMPT,
    UNKNOWN,
    DemoTask,
    make_task,
    make_tasks,
    read_tasks,
    split_of,
    workflow_spec,
    write_tasks,
    write_workflow_toml,
)
from kvprof.traces.spec import build_spec
from kvprof.traces.tasks import load_tasks


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(make_tasks("train", 1000))


def test_tasks_are_deterministic():
    assert make_task("train", 7).to_json() == make_task("train", 7).to_json()
    assert make_tasks("heldout", 3, start=5)[0].to_json() == make_task("heldout", 5).to_json()
    assert make_task("train", 7).to_json() != make_task("train", 8).to_json()


def test_splits_are_disjoint():
    train = {t.task.question for t in make_tasks("train", 600)}
    heldout = {t.task.question for t in make_tasks("heldout", 200)}
    assert not train & heldout
    assert all(split_of(q) == "train" for q in train) and all(split_of(q) == "heldout" for q in heldout)


def test_hops_and_shapes():
    tasks = make_tasks("heldout", 100)
    assert {t.hops for t in tasks} == {2, 3}
    for t in tasks:
        assert len(set(t.entities)) == len(t.entities) and len(set(t.relations)) == len(t.relations)
        assert set(t.task.documents) == set(t.entities[:-1])
    assert all(t.hops == 3 for t in make_tasks("long", 2))


def test_answers_occur_only_in_observations():
    fixed_texts = [SYSTEM_PROMPT, *ROLE_PROMPTS.values()]
    for t in make_tasks("heldout", 100):
        assert t.task.answer == t.entities[-1]
        assert t.task.answer not in t.task.question
        assert not any(t.task.answer in text for text in fixed_texts)
        assert f"{t.relations[-1]} {t.task.answer}" in t.task.documents[t.entities[-2]]


def test_each_hop_is_associative_recall():
    """The relation word precedes the next entity in the paragraph; no distractor sentence uses a relation word."""
    for t in make_tasks("heldout", 100):
        for entity, relation, target in zip(t.entities, t.relations, t.entities[1:]):
            paragraph = t.task.documents[entity]
            assert re.search(rf"\b{relation} {target}\b", paragraph)
            with_relations = [
                s for s in paragraph.split(". ") if any(re.search(rf"\b{word}\b", s) for word in RELATION_WORDS)
            ]
            assert len(with_relations) == 1 and with_relations[0].startswith(f"{entity} is a")
            listed = re.findall(rf"\b({'|'.join(RELATION_WORDS)}) ", with_relations[0])
            assert relation in listed and len(listed) == SHAPES["heldout"].facts


def test_gold_outputs_have_their_role_format():
    for t in make_tasks("heldout", 50):
        for role, observations in t.schedule():
            assert re.fullmatch(ROLE_FORMATS[role], t.output(role, observations))
        other = {r: [x for x in ROLES if x != r] for r in ROLES}
        for role, observations in t.schedule():
            for wrong in other[role]:
                text = t.output(wrong, observations)
                assert not re.fullmatch(ROLE_FORMATS[role], text)
        assert [t.output("reflect", j) for j in range(t.hops)] == [f" answer[ {UNKNOWN}]\n"] * t.hops
        assert UNKNOWN not in t.entities


def test_every_name_is_its_two_syllables(tokenizer):
    """A name is two tokens, its initial (after a space) and its final syllable, whatever the BPE merged."""
    for initial in INITIALS:
        for final in PERSON_FINALS + PLACE_FINALS:
            assert tokenizer.tokenize(f" {initial}{final}") == [f"Ġ{initial}", final]
    t = make_task("heldout", 0)
    name = t.entities[1]
    assert tokenizer.encode(f" search[ {name}]")[2:-1] == tokenizer.encode(f" {name}")


def test_oracle_trajectory_solves_the_task(tokenizer):
    for mode in ("prompt", "lora"):
        spec = workflow_spec(mode, {role: f"adapters/{role}" for role in ROLES})
        for t in make_tasks("heldout", 5):
            traj = oracle_trajectory(spec, tokenizer, t)
            assert traj.prediction == t.task.answer
            assert [turn.agent for turn in traj.turns] == [role for role, _ in t.schedule()]
            assert sum(s.kind == "observation" for s in traj.segments.values()) == t.hops


def test_training_examples_are_runner_inputs(tokenizer):
    """An example on a role's own turn is that turn's input followed by its output, token for token."""
    for mode in ("prompt", "lora"):
        spec = workflow_spec(mode)
        t = make_task("heldout", 3)
        traj = oracle_trajectory(spec, tokenizer, t)
        examples = own_turn_examples(spec, tokenizer, t)
        for turn, example in zip(traj.turns, examples):
            assert example.tokens == traj.input_tokens(turn) + traj.output_tokens(turn)
            assert example.targets[-len(traj.output_tokens(turn)) :] == [True] * len(traj.output_tokens(turn))
        # off-schedule: plan asked at act's first turn answers plan's gold output of that state
        off = role_example(traj, t, "plan", 1, tokenizer)
        assert tokenizer.decode(off.tokens[-len(tokenizer.encode(t.output("plan", 0))) :]) == t.output("plan", 0)
        sampled = sample_examples(spec, tokenizer, t, ROLES, random.Random(0))
        assert [e.role for e in sampled] == list(ROLES)


def test_files_round_trip(tmp_path):
    tasks = make_tasks("heldout", 3)
    path = write_tasks(tmp_path / "tasks.jsonl", tasks)
    assert [t.to_json() for t in read_tasks(path)] == [t.to_json() for t in tasks]
    loaded = load_tasks(path)
    assert (
        SearchTool().observe(loaded[0], "search", f" {tasks[0].entities[0]}")
        == tasks[0].task.documents[tasks[0].entities[0]]
    )
    for role in ROLES:
        (tmp_path / "adapters" / role).mkdir(parents=True)
    adapters = {role: str((tmp_path / "adapters" / role).resolve()) for role in ROLES}
    toml = write_workflow_toml(tmp_path / "workflow.toml", workflow_spec("lora", adapters))
    assert 'adapter = "adapters/plan"' in toml.read_text()
    spec = build_spec(toml)
    assert spec == workflow_spec("lora", adapters)
    prompt = build_spec(write_workflow_toml(tmp_path / "prompt.toml", workflow_spec("prompt")))
    assert prompt == workflow_spec("prompt")


def test_demo_task_json_round_trip():
    t = make_task("train", 1)
    assert DemoTask.from_json(t.to_json()).to_json() == t.to_json()
