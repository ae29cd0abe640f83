"""The codebook world: prompt-role agents whose private keys give the same shared tokens different meanings.

Each agent's prefix holds its own key (one token per entry: `kared` = symbol `ka` is red to it); a ship's manifest
(the shared observation) lists the symbol at each dock; the reviewer answers the asked dock's colour in its own key.
With two layers the model can only resolve the key at the shared tokens, so FullShared answers in the other agent's
key. Why, and the measured accuracies: docs/demo-worlds.md, docs/design.md ("The codebook world").
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvprof.traces.spec import AgentSpec, WorkflowSpec
from kvprof.traces.tasks import Task, task_from_record, task_record

SYMBOLS = ("ka", "mo", "ri", "tu", "ze", "po", "li", "su", "ne", "fa", "gi", "do")
COLOURS = ("red", "blue", "green", "gold")
DOCKS = ("north", "south", "east", "west", "upper", "lower", "inner", "outer")
SHIPS = ("Vora", "Selm", "Tarn", "Oske", "Brim", "Caul", "Dern", "Fisk", "Gorm", "Hult")

ROLES = ("act", "reflect")
ROLE_PROMPTS = {
    "act": "You are the clerk. Search the ship the question names, then finish with the colour your key gives the "
    "symbol at the asked dock.\n",
    "reflect": "You are the auditor. Your key is your own and differs from the clerk's. Read the manifest, find the "
    "symbol at the asked dock and answer with the colour your key gives it, as answer[ COLOUR], or answer[ unknown] "
    "while no manifest has been read.\n",
}
CUE = "Agent:"
ANSWER_PATTERN = r"answer\[ \w+ (\w+)\]"
UNKNOWN = "unknown"
MAX_ROUNDS = 3
MAX_NEW_TOKENS = {"act": 8, "reflect": 8}

SPLITS = {"train": 1, "heldout": 2, "long": 3, "standing": 4}


@dataclass(frozen=True)
class Shape:
    """How a split's tasks look: ships per task and docks per manifest (inclusive ranges)."""

    ships: tuple[int, int] = (2, 4)
    docks: tuple[int, int] = (3, 6)


SHAPES = {"train": Shape(), "heldout": Shape(), "long": Shape(ships=(4, 4), docks=(6, 6)), "standing": Shape()}
STANDING_KEYS_SEED = "kvprof-codebook/standing-keys"
"""The `standing` split's keys: drawn once from this seed, the same in every task (see `make_task`)."""


def entry(symbol: str, colour: str) -> str:
    """A key entry: one token naming a symbol and its colour."""
    return symbol + colour


@dataclass
class CodebookTask:
    """A task plus its solution: the asked ship and dock, the symbol there, and each role's colour for it."""

    task: Task
    ship: str
    dock: str
    symbol: str
    colours: dict[str, str]  # role → the colour its key gives `symbol`
    split: str
    asks: str = "colour"  # or "symbol": the training drill that asks for the symbol itself (see `make_task`)

    def to_json(self) -> dict:
        return task_record(self.task) | {
            "ship": self.ship,
            "dock": self.dock,
            "symbol": self.symbol,
            "colours": self.colours,
            "split": self.split,
            "asks": self.asks,
        }

    @classmethod
    def from_json(cls, record: dict) -> CodebookTask:
        return cls(
            task=task_from_record(record, f"codebook task {record.get('id')}", ""),
            ship=record["ship"],
            dock=record["dock"],
            symbol=record["symbol"],
            colours=dict(record["colours"]),
            split=record["split"],
            asks=record.get("asks", "colour"),
        )

    def output(self, role: str, observations: int) -> str:
        """The gold output text of `role` once the trajectory holds `observations` observations."""
        if role == "act":
            return f" finish[ {self.dock} {self.reading('act')}]\n" if observations else f" search[ {self.ship}]\n"
        if role == "reflect":
            return f" answer[ {self.dock} {self.reading('reflect') if observations else UNKNOWN}]\n"
        raise ValueError(f"unknown role {role!r}")

    @property
    def manifest_text(self) -> str:
        """The asked ship's manifest (what `search[ SHIP]` returns)."""
        return self.task.documents[self.ship]

    @property
    def cargo(self) -> list[tuple[str, str]]:
        """The asked ship's `(dock, symbol)` pairs, in manifest order."""
        slots = self.manifest_text.split(" : ", 1)[1].rstrip(" .").split(" , ")
        return [(slot.split()[0], slot.split()[1]) for slot in slots]

    def reading(self, role: str) -> str:
        """What `role` reports once it has read the manifest: its colour for the symbol, or the symbol."""
        return self.colours[role] if self.asks == "colour" else self.symbol

    def schedule(self) -> list[tuple[str, int]]:
        """The canonical `(role, observations)` of each turn: search, finish, then the reviewer."""
        return [("act", 0), ("act", 1), ("reflect", 1)]


def key_text(key: dict[str, str], rng: random.Random) -> str:
    entries = [entry(symbol, colour) for symbol, colour in key.items()]
    rng.shuffle(entries)
    return "Key: " + " ".join(entries) + " .\n"


def manifest(ship: str, cargo: list[tuple[str, str]]) -> str:
    return f"{ship} : " + " , ".join(f"{dock} {symbol}" for dock, symbol in cargo) + " ."


def make_task(split: str, index: int, asks: str = "colour") -> CodebookTask:
    """Task `index` of `split`, deterministic. `asks="symbol"`: the training drill asking for the symbol at the dock
    (teaches the second layer to find it). `split="standing"`: every task gives each agent the same key (and entry
    order): one fixed prefix, as anchor pools assume."""
    shape = SHAPES[split]
    rng = random.Random(f"kvprof-codebook/{SPLITS[split]}/{index}")
    ships = rng.sample(SHIPS, rng.randint(*shape.ships))
    documents = {}
    cargos = {}
    for ship in ships:
        docks = rng.sample(DOCKS, rng.randint(*shape.docks))
        cargo = list(zip(docks, rng.sample(SYMBOLS, len(docks))))
        cargos[ship] = cargo
        documents[ship] = manifest(ship, cargo)
    ship = rng.choice(ships)
    dock, symbol = rng.choice(cargos[ship])
    key_rng = random.Random(STANDING_KEYS_SEED) if split == "standing" else rng
    keys = {role: {s: key_rng.choice(COLOURS) for s in SYMBOLS} for role in ROLES}
    private = {role: key_text(keys[role], key_rng) for role in ROLES}
    question = f"Which {asks} is at dock {dock.upper()} of ship {ship}?"
    task = Task(
        id=f"codebook-{split}-{index}",
        question=question,
        answer=keys["reflect"][symbol] if asks == "colour" else symbol,
        documents=documents,
        private=private,
    )
    colours = {role: keys[role][symbol] for role in ROLES}
    return CodebookTask(task=task, ship=ship, dock=dock, symbol=symbol, colours=colours, split=split, asks=asks)


def make_tasks(split: str, count: int, start: int = 0, asks: str = "colour") -> list[CodebookTask]:
    return [make_task(split, index, asks) for index in range(start, start + count)]


def read_tasks(path: str | Path) -> list[CodebookTask]:
    with open(path, encoding="utf-8") as handle:
        return [CodebookTask.from_json(json.loads(line)) for line in handle if line.strip()]


def workflow_spec() -> WorkflowSpec:
    """The codebook workflow: prompt mode, role prompts of different lengths, a role-neutral cue."""
    agents = [AgentSpec(role, prompt=ROLE_PROMPTS[role], max_new_tokens=MAX_NEW_TOKENS[role]) for role in ROLES]
    return WorkflowSpec(
        mode="prompt",
        agents=agents,
        system_prompt="",
        cue_template=CUE,
        stop=["\n"],
        max_new_tokens=max(MAX_NEW_TOKENS.values()),
        max_rounds=MAX_ROUNDS,
        answer_pattern=ANSWER_PATTERN,
    )


def corpus(tasks: list[CodebookTask]):
    """Every text the runner tokenizes for these tasks, each on its own as the runner encodes it."""
    spec = workflow_spec()
    for task in tasks:
        yield spec.question_template.format(question=task.task.question)
        yield spec.cue_template
        for role in ROLES:
            yield ROLE_PROMPTS[role] + task.task.private[role]
        for text in task.task.documents.values():
            yield spec.observation_template.format(observation=text)
        for role in ROLES:
            for observations in (0, 1):
                yield task.output(role, observations)


def vocabulary_words() -> list[str]:
    """Words that must each be one token (after a space): what the two-layer solution looks up in one hop."""
    words = [entry(s, c) for s in SYMBOLS for c in COLOURS] + list(SYMBOLS) + list(COLOURS)
    return words + list(DOCKS) + [dock.upper() for dock in DOCKS] + list(SHIPS)
