"""A hybrid model's recurrent states kept at checkpoint positions of a stored sequence, as a serving engine keeps
them (docs/models.md#hybrid-models).

A recurrent layer's state after n tokens summarises all n: a stored sequence can serve a new call only up to a
position where its states were kept, and the rest is recomputed. Where an engine keeps them is its checkpoint rule
(`kvprof.traces.checkpoints`: vLLM's block-aligned states, SGLang's every N tokens, message boundaries): a turn
keeps states at the rule's positions (`turn_marks`), its forwards split there (`SharingPolicy.prefill`), and the
next call resumes from the last kept position inside the prefix it shares (`StateCheckpoints.resume`). Memory: one
state per kept position per recurrent layer, beside the attention layers' K/V.
"""

from __future__ import annotations

import torch

from kvprof.model.recurrent import StateBuffer
from kvprof.policies.turns import TurnRequest
from kvprof.traces.checkpoints import CheckpointRule, computed_length

States = dict[int, StateBuffer]  # recurrent layer index → its state after a position


class StateCheckpoints:
    """The recurrent states kept along one stored sequence: position (tokens from its start, private prefix
    included) → `States`."""

    def __init__(self) -> None:
        self.states: dict[int, States] = {}

    def __len__(self) -> int:
        return len(self.states)

    def resume(self, rule: CheckpointRule, matched: int, prompt: int) -> int:
        """Where a call of `prompt` input tokens sharing the first `matched` with this sequence resumes: the rule's
        hit over the kept positions (0: from scratch)."""
        return rule.hit(matched, prompt, self.states.keys())

    def at(self, position: int) -> States:
        return self.states[position]

    def keep(self, kept: dict[int, States]) -> None:
        self.states.update(kept)

    def truncate(self, keep: int) -> None:
        """Forget the states after more than `keep` tokens (the sequence changes there)."""
        self.states = {position: states for position, states in self.states.items() if position <= keep}

    def tensors(self) -> list[torch.Tensor]:
        return [t for states in self.states.values() for state in states.values() for t in state.tensors()]


def turn_marks(rule: CheckpointRule, request: TurnRequest, resumed: int, matched: int) -> frozenset[int]:
    """The positions after which `rule` keeps the states of `request`'s call, resumed at `resumed` with the first
    `matched` input ids stored: its whole sequence when teacher-forced; when greedy, its input and `max_new_tokens`
    (the call's end is kept when it stops, `keeps_call_end`)."""
    prompt = len(request.input_ids)
    outputs = request.output_ids
    length = prompt + (len(outputs) if outputs is not None else request.max_new_tokens)
    return frozenset(rule.kept(prompt, length, resumed, request.boundaries, matched=matched))


def keeps_call_end(rule: CheckpointRule, request: TurnRequest, resumed: int, length: int) -> bool:
    """Whether `rule` keeps the states where a call `length` ids long ends (as an engine computes it: all but the
    last generated id, `computed_length`)."""
    prompt = len(request.input_ids)
    return computed_length(prompt, length) in rule.kept(prompt, length, resumed, request.boundaries)
