"""Training examples for the demo worlds, laid out by the real runner (`run_react` with a gold-output oracle), so an
input is token for token what an agent reads at inference. One example: role R's prompt (prompt mode), the history
up to turn k's cue, R's gold output; turn k drawn among all turns, so the schedule never tells R its role
(docs/demo-worlds.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import torch

from kvprof.capture.workflow import SearchTool, run_react
from kvprof.traces.spec import WorkflowSpec
from kvprof.traces.tasks import Task
from kvprof.traces.trace import Trajectory

IGNORE = -100


@dataclass
class Example:
    """One sequence: `tokens` (length T) and `targets` (length T, True where the token is an output to learn)."""

    tokens: list[int]
    targets: list[bool]
    role: str

    def __len__(self) -> int:
        return len(self.tokens)


class GoldTask(Protocol):
    """A world's task with its solution (`kvprof.demo.world.DemoTask`, `kvprof.demo.codebook.CodebookTask`)."""

    task: Task

    def output(self, role: str, observations: int) -> str:
        """The gold output text of `role` once the trajectory holds `observations` observations."""
        ...

    def schedule(self) -> list[tuple[str, int]]:
        """The canonical `(role, observations)` of each turn."""
        ...


def oracle_trajectory(spec: WorkflowSpec, tokenizer, task: GoldTask) -> Trajectory:
    """Run `task` through the runner with every turn answered by its gold output."""
    schedule = iter(task.schedule())

    def respond(agent: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
        role, observations = next(schedule)
        if role != agent:
            raise RuntimeError(f"runner asked {agent} where the demo schedule has {role}")
        return tokenizer.encode(task.output(role, observations), add_special_tokens=False)

    return run_react(spec, tokenizer, task.task, SearchTool(), respond)


def observations_seen(traj: Trajectory, turn_index: int) -> int:
    """How many observations the input of turn `turn_index` holds."""
    return sum(traj.segments[s].kind == "observation" for s in traj.turns[turn_index].input)


def role_example(traj: Trajectory, task: GoldTask, role: str, cutoff: int, tokenizer) -> Example:
    """The example teaching `role` on the input of turn `cutoff` (see module docstring)."""
    turn = traj.turns[cutoff]
    tokens: list[int] = []
    targets: list[bool] = []
    for seg_id in turn.input:
        if seg_id.startswith("prompt:"):
            seg_id = f"prompt:{role}"
        segment = traj.segments[seg_id]
        tokens += segment.tokens
        targets += [segment.kind == "output" and segment.producer == role] * len(segment)
    output = tokenizer.encode(task.output(role, observations_seen(traj, cutoff)), add_special_tokens=False)
    return Example(tokens=tokens + output, targets=targets + [True] * len(output), role=role)


def sample_examples(
    spec: WorkflowSpec, tokenizer, task: GoldTask, roles: tuple[str, ...], rng: random.Random
) -> list[Example]:
    """One example per role in `roles` for `task`, each on a random turn."""
    traj = oracle_trajectory(spec, tokenizer, task)
    return [role_example(traj, task, role, rng.randrange(len(traj.turns)), tokenizer) for role in roles]


def own_turn_examples(spec: WorkflowSpec, tokenizer, task: GoldTask) -> list[Example]:
    """One example per canonical turn, ending at that turn's own output (what greedy inference must reproduce)."""
    traj = oracle_trajectory(spec, tokenizer, task)
    return [role_example(traj, task, turn.agent, k, tokenizer) for k, turn in enumerate(traj.turns)]


def batches(examples: list[Example], token_budget: int, rng: random.Random) -> list[list[Example]]:
    """Group examples of similar length into batches of at most `token_budget` padded tokens, in random order."""
    ordered = sorted(examples, key=len)
    groups: list[list[Example]] = []
    current: list[Example] = []
    for example in ordered:
        if current and len(example) * (len(current) + 1) > token_budget:
            groups.append(current)
            current = []
        current.append(example)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    return groups


def collate(batch: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a batch: `input_ids`, `labels` (IGNORE except at targets), `real` (False on padding), each (B, T).
    No attention mask needed: under causal attention real tokens never attend to later pads."""
    width = max(len(example) for example in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    real = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, example in enumerate(batch):
        ids = torch.tensor(example.tokens, dtype=torch.long)
        input_ids[row, : len(example)] = ids
        mask = torch.tensor(example.targets, dtype=torch.bool)
        labels[row, : len(example)] = torch.where(mask, ids, torch.full_like(ids, IGNORE))
        real[row, : len(example)] = True
    return input_ids, labels, real
