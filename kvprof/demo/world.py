"""The demo world's tasks: random knowledge bases of invented entities, multi-hop questions, a search tool.

Each task has its own people and places (two-token names) and relations; a question follows 2–3 relations from a
start entity; `search[NAME]` returns one fact sentence (the relation the question follows; `Shape.facts`) among
distractor sentences without relation words. The answer occurs only in the observations. Splits never share a
question. Outputs, and why one relation per fact: docs/demo-worlds.md.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvprof.traces.spec import AgentSpec, WorkflowSpec
from kvprof.traces.tasks import Task, task_from_record, task_record

# ----------------------------------------------------------------------------------------------------- vocabulary

INITIALS = (
    "Ka",
    "Tev",
    "Mor",
    "Bri",
    "Os",
    "Zel",
    "Jup",
    "Fen",
    "Dra",
    "Lum",
    "Sar",
    "Vin",
    "Hal",
    "Ner",
    "Pel",
    "Gor",
    "Ith",
    "Ulm",
    "Yar",
    "Cas",
    "Bel",
    "Dun",
    "Fal",
    "Ker",
    "Tam",
    "Ros",
    "Ves",
    "Wyn",
    "Xan",
    "Ael",
)
PERSON_FINALS = ("mir", "ren", "oth", "ias", "wen", "dar", "los", "iel", "ric", "ane")
PLACE_FINALS = ("vash", "dal", "heim", "gard", "mora", "ssa", "thal", "bury", "wick", "ford")

PERSON, PLACE = "person", "place"
RELATIONS = {
    PERSON: {"rival": PERSON, "mentor": PERSON, "spouse": PERSON, "birthplace": PLACE, "residence": PLACE},
    PLACE: {"founder": PERSON, "mayor": PERSON, "region": PLACE, "twin": PLACE},
}
RELATION_WORDS = sorted({word for fields in RELATIONS.values() for word in fields})
KINDS = {
    PERSON: ("painter", "smith", "weaver", "sailor", "scholar", "baker", "herbalist", "mason"),
    PLACE: ("town", "village", "harbour", "city", "fortress"),
}

FILLERS = {
    "goods": ("salt", "wool", "copper", "honey", "amber", "linen", "timber", "spices"),
    "event": ("festival", "flood", "harvest", "fair", "storm", "trial", "race", "eclipse"),
    "topic": ("weather", "taxes", "river", "comet", "war", "library", "roads"),
    "building": ("bridge", "tower", "mill", "chapel", "granary", "lighthouse"),
    "animal": ("goat", "hawk", "hound", "mule", "heron"),
    "number": ("three", "five", "seven", "nine", "twelve"),
}
DISTRACTORS = (
    "{P} once sold {goods} at the market of {L}.",
    "In {L} the {event} lasted for {number} days.",
    "{P} wrote a letter to {P2} about the {topic}.",
    "Travellers from {L} often spoke of {P}.",
    "The old {building} of {L} was rebuilt after the {event}.",
    "{P} and {P2} met at the {event} in {L}.",
    "Nobody in {L} remembers the {topic} of that year.",
    "{P} kept a {animal} that followed {P2} everywhere.",
    "A {building} near {L} is known for its {goods}.",
    "Songs about the {event} are still sung in {L} and {L2}.",
    "{P} argued with {P2} about the price of {goods}.",
    "The road from {L} to {L2} is closed in winter.",
)

# ----------------------------------------------------------------------------------------------------- prompts

SYSTEM_PROMPT = "Solve the question with the search tool.\n"
CUE = "Agent:"
ROLE_PROMPTS = {
    "plan": "You are the planner. Say what the last observation found and what to search next.\n",
    "act": (
        "You are the actor. Reply with exactly one action: search[ NAME] to read about an entity, "
        "or finish[ ANSWER] once the last observation holds the answer. Copy names exactly.\n"
    ),
    "reflect": (
        "You are the reviewer. The team has searched a knowledge base step by step to answer the "
        "question. Read the whole trajectory, check that every step followed the right relation, and "
        "give the final answer in the form answer[ ANSWER], copying the name exactly as the "
        "observation spells it, or answer[ unknown] while no observation holds it yet.\n"
    ),
}
ROLES = tuple(ROLE_PROMPTS)
ROLE_FORMATS = {
    "plan": r" Plan: [^\n]+[.]\n",
    "act": r" (?:search|finish)\[ [^\]\n]+\]\n",
    "reflect": r" answer\[ [^\]\n]+\]\n",
}
"""What a well-formed output of each role looks like (`re.fullmatch` on the decoded output)."""
ANSWER_PATTERN = r"answer\[(.*?)\]"
UNKNOWN = "unknown"
"""The reviewer's answer before the trajectory holds the answer (never an entity name: names are two syllables)."""
MAX_ROUNDS = 5
MAX_NEW_TOKENS = {"plan": 24, "act": 12, "reflect": 12}

# ----------------------------------------------------------------------------------------------------- splits

SPLITS = {"train": 1, "heldout": 2, "long": 3}
"""Seed of each split; `train` and `heldout` also partition question texts by hash (see `split_of`)."""
HELDOUT_SHARE = 8  # 1 in 8 question texts may appear in held-out splits, the rest only in train


@dataclass(frozen=True)
class Shape:
    """A split's tasks: hop counts with weights, distractors per paragraph, relations per fact sentence."""

    hops: tuple[tuple[int, float], ...] = ((2, 0.7), (3, 0.3))
    distractors: tuple[int, int] = (1, 10)
    facts: int = 1


SHAPES = {
    "train": Shape(hops=((2, 0.5), (3, 0.5))),
    "heldout": Shape(),
    "long": Shape(hops=((3, 1.0),), distractors=(125, 140)),
}


@dataclass
class DemoTask:
    """A task plus its solution path: `entities[0]` is the start, `entities[-1]` the answer, `relations[i]` the
    hop from `entities[i]` to `entities[i + 1]`."""

    task: Task
    entities: list[str]
    relations: list[str]
    split: str

    @property
    def hops(self) -> int:
        return len(self.relations)

    def to_json(self) -> dict:
        return task_record(self.task) | {"entities": self.entities, "relations": self.relations, "split": self.split}

    @classmethod
    def from_json(cls, record: dict) -> DemoTask:
        task = task_from_record(record, f"demo task {record.get('id')}", "")
        return cls(
            task=task, entities=list(record["entities"]), relations=list(record["relations"]), split=record["split"]
        )

    # ------------------------------------------------------------------ gold outputs

    def output(self, role: str, observations: int) -> str:
        """The gold output text of `role` once the trajectory holds `observations` observations."""
        j, h, e, r = observations, self.hops, self.entities, self.relations
        if role == "plan":
            if j == 0:
                return f" Plan: find {r[0]} of {e[0]}.\n"
            found = f" Plan: {r[j - 1]} {e[j]}"
            return f"{found}, finish.\n" if j == h else f"{found}, find {r[j]} of {e[j]}.\n"
        if role == "act":
            return f" finish[ {e[h]}]\n" if j == h else f" search[ {e[j]}]\n"
        if role == "reflect":
            return f" answer[ {e[h] if j == h else UNKNOWN}]\n"
        raise ValueError(f"unknown role {role!r}")

    def schedule(self) -> list[tuple[str, int]]:
        """The canonical `(role, observations)` of each turn: plan and act per round, then reflect."""
        turns = [(role, j) for j in range(self.hops + 1) for role in ("plan", "act")]
        return turns + [("reflect", self.hops)]


class JsonTask(Protocol):
    """A world's task that writes itself as one `load_tasks` record (`DemoTask`, `codebook.CodebookTask`)."""

    def to_json(self) -> dict: ...


@dataclass
class _Entity:
    name: str
    type: str
    kind: str
    fields: dict[str, str] = field(default_factory=dict)


def split_of(question: str) -> str:
    """`heldout` for 1 in HELDOUT_SHARE question texts (by hash), else `train`: the two never share a question."""
    digest = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16)
    return "heldout" if digest % HELDOUT_SHARE == 0 else "train"


def _knowledge_base(rng: random.Random) -> dict[str, _Entity]:
    """8–12 people and 6–10 places; names are an initial syllable (distinct within the task) and a final one."""
    n_people, n_places = rng.randint(8, 12), rng.randint(6, 10)
    initials = rng.sample(INITIALS, n_people + n_places)
    people = [
        _Entity(initial + rng.choice(PERSON_FINALS), PERSON, rng.choice(KINDS[PERSON]))
        for initial in initials[:n_people]
    ]
    places = [
        _Entity(initial + rng.choice(PLACE_FINALS), PLACE, rng.choice(KINDS[PLACE])) for initial in initials[n_people:]
    ]
    pools = {PERSON: people, PLACE: places}
    for entity in people + places:
        for relation, target_type in RELATIONS[entity.type].items():
            entity.fields[relation] = rng.choice([o for o in pools[target_type] if o is not entity]).name
    return {entity.name: entity for entity in people + places}


def _paragraph(
    rng: random.Random, entity: _Entity, kb: dict[str, _Entity], asked: str, facts: int, distractors: tuple[int, int]
) -> str:
    """One fact sentence (`asked` and `facts - 1` other relations, shuffled) among distractor sentences."""
    others = [item for item in entity.fields.items() if item[0] != asked]
    fields = [(asked, entity.fields[asked])] + rng.sample(others, facts - 1)
    rng.shuffle(fields)
    listed = [f"{relation} {value}" for relation, value in fields]
    fact = (
        f"{entity.name} is a {entity.kind} with {', '.join(listed[:-1])} and {listed[-1]}."
        if len(listed) > 1
        else f"{entity.name} is a {entity.kind} with {listed[0]}."
    )
    people = [e.name for e in kb.values() if e.type == PERSON]
    places = [e.name for e in kb.values() if e.type == PLACE]
    sentences = []
    for _ in range(rng.randint(*distractors)):
        p, p2 = rng.sample(people, 2)
        place, place2 = rng.sample(places, 2)
        fillers = {key: rng.choice(values) for key, values in FILLERS.items()}
        sentences.append(rng.choice(DISTRACTORS).format(P=p, P2=p2, L=place, L2=place2, **fillers))
    sentences.insert(rng.randint(0, len(sentences)), fact)
    return " ".join(sentences)


def make_task(split: str, index: int, distractors: tuple[int, int] | None = None) -> DemoTask:
    """Task `index` of `split`, deterministic; `distractors` overrides the split's range."""
    shape = SHAPES[split]
    distractors = distractors or shape.distractors
    rng = random.Random(f"kvprof-demo/{SPLITS[split]}/{index}")
    hop_counts, weights = zip(*shape.hops)
    while True:
        kb = _knowledge_base(rng)
        hops = rng.choices(hop_counts, weights)[0]
        start = rng.choice(list(kb.values()))
        entities, relations = [start.name], []
        for _ in range(hops):
            options = [r for r, v in kb[entities[-1]].fields.items() if v not in entities and r not in relations]
            if not options:
                break
            relation = rng.choice(options)
            relations.append(relation)
            entities.append(kb[entities[-1]].fields[relation])
        if len(relations) != hops:
            continue
        question = f"What is {entities[0]}'s " + "'s ".join(relations) + "?"
        if split in ("train", "heldout") and split_of(question) != split:
            continue
        documents = {
            name: _paragraph(rng, kb[name], kb, relation, shape.facts, distractors)
            for name, relation in zip(entities, relations)
        }
        task = Task(id=f"{split}-{index}", question=question, answer=entities[-1], documents=documents)
        return DemoTask(task=task, entities=entities, relations=relations, split=split)


def make_tasks(split: str, count: int, start: int = 0, distractors: tuple[int, int] | None = None) -> list[DemoTask]:
    return [make_task(split, index, distractors) for index in range(start, start + count)]


def write_tasks(path: str | Path, tasks: Sequence[JsonTask]) -> Path:
    """JSONL for `load_tasks`; the extra fields (`entities`, `relations`, `split`) restore the task via `read_tasks`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for task in tasks:
            handle.write(json.dumps(task.to_json(), ensure_ascii=False) + "\n")
    return path


def read_tasks(path: str | Path) -> list[DemoTask]:
    with open(path, encoding="utf-8") as handle:
        return [DemoTask.from_json(json.loads(line)) for line in handle if line.strip()]


# ----------------------------------------------------------------------------------------------------- workflows


def workflow_spec(mode: str, adapters: dict[str, str] | None = None) -> WorkflowSpec:
    """The demo workflow, `prompt` mode (role prompts of different lengths) or `lora` (a neutral prompt; `adapters`:
    role → directory). The cue is role-neutral: only the prompt or adapter tells an agent its role."""
    if mode == "prompt":
        agents = [AgentSpec(role, prompt=ROLE_PROMPTS[role], max_new_tokens=MAX_NEW_TOKENS[role]) for role in ROLES]
        system = ""
    else:
        adapters = adapters or {}
        agents = [AgentSpec(role, adapter=adapters.get(role), max_new_tokens=MAX_NEW_TOKENS[role]) for role in ROLES]
        system = SYSTEM_PROMPT
    return WorkflowSpec(
        mode=mode,
        agents=agents,
        system_prompt=system,
        cue_template=CUE,
        stop=["\n"],
        max_new_tokens=max(MAX_NEW_TOKENS.values()),
        max_rounds=MAX_ROUNDS,
        answer_pattern=ANSWER_PATTERN,
    )


def write_workflow_toml(path: str | Path, spec: WorkflowSpec) -> Path:
    """Write `spec` as a TOML workflow file (adapter paths relative to the file's folder when inside it)."""
    path = Path(path)
    quote = json.dumps
    lines = [
        f"mode = {quote(spec.mode)}",
        f"system_prompt = {quote(spec.system_prompt)}",
        f"question_template = {quote(spec.question_template)}",
        f"cue_template = {quote(spec.cue_template)}",
        f"observation_template = {quote(spec.observation_template)}",
        f"stop = [{', '.join(quote(s) for s in spec.stop)}]",
        f"max_new_tokens = {spec.max_new_tokens}",
        f"max_rounds = {spec.max_rounds}",
        f"action_pattern = {quote(spec.action_pattern)}",
        f"answer_pattern = {quote(spec.answer_pattern)}",
    ]
    for agent in spec.agents:
        lines.append(f"\n[agents.{agent.name}]")
        if agent.adapter is not None:
            adapter = Path(agent.adapter)
            if adapter.is_absolute() and adapter.is_relative_to(path.parent.resolve()):
                adapter = adapter.relative_to(path.parent.resolve())
            lines.append(f"adapter = {quote(adapter.as_posix())}")
        if agent.prompt is not None:
            lines.append(f"prompt = {quote(agent.prompt)}")
        if agent.max_new_tokens is not None:
            lines.append(f"max_new_tokens = {agent.max_new_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
