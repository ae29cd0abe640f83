"""NonShared: each agent keeps its own cache and prefills every token it has not processed itself.

The dense baseline (of LRAgent and PReCache) every policy is measured against: exact; memory N× with N agents.

- An aLoRA agent keeps of a call's cache only the tokens before its invocation: its next call reads the later ones
  with the base weights, as peft's `generate` computes them.
- On a hybrid model (`kvprof.model.recurrent`) an agent's call resumes its own sequence only from the last position
  inside the prefix it shares where the checkpoint rule kept the recurrent states
  (`kvprof.policies.state_checkpoints`), as a hybrid prefix cache serves it; the rest is recomputed, from the role
  prompt's end when no kept position lies after it.

Phases: TTFT — the role prompt on the agent's first turn, then the chunk it has not processed; decode — one token
over its own cache; after the turn — keeping the cache (appended in place, `kvprof.model.buffers`: nothing copied).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import torch

from kvprof.model.buffers import KVBuffer
from kvprof.model.recurrent import RECURRENT_STATES, StateBuffer
from kvprof.policies.base import SharingPolicy
from kvprof.policies.state_checkpoints import StateCheckpoints, turn_marks
from kvprof.policies.turns import Chunk, Context


class NonShared(SharingPolicy[Context]):
    name = "nonshared"
    family = "baseline"
    paper = "the dense baseline of LRAgent and PReCache"
    approximate = False
    modes: ClassVar[tuple[str, ...]] = ("lora", "prompt")
    serves_others = False
    runs_on_hybrids = True
    timeline_state: ClassVar[tuple[str, ...]] = ("own", "seen", "prefix_len", "checkpoints")

    def owner(self, agent: str) -> Hashable | None:
        """Whose stored cache `agent` reads and extends: its own (None: it reuses and stores nothing)."""
        return agent

    def owner_name(self, owner: Hashable) -> str:
        """How memory names `owner`'s structures ("cache:NAME", "recurrent states:NAME")."""
        return str(owner)

    def reset(self) -> None:
        # owner -> per layer (K, V) buffers, (1, H_kv, ≥ L, D) (a hybrid's recurrent layers: no state, see checkpoints)
        self.own: dict[Hashable, list[KVBuffer]] = {}
        self.seen: dict[Hashable, int] = {}  # owner -> shared-timeline tokens in its cache
        self.prefix_len: dict[Hashable, int] = {}  # owner -> its cache's private prefix length
        self.checkpoints: dict[Hashable, StateCheckpoints] = {}  # owner -> a hybrid's kept recurrent states

    def assemble(self, agent: str, shared: list[int]) -> Context:
        owner = self.owner(agent)
        prefix = len(self.runtime.prefix(agent))
        buffers = self.own.get(owner) if owner is not None else None
        reused = min(self.seen.get(owner, 0), len(shared) - 1)
        matched = prefix + reused if buffers is not None else 0
        rule = self.runtime.checkpoint_rule
        if rule is not None and buffers is not None:
            resumed = self.resumed_at(owner, prefix, shared)
            if resumed is None:
                buffers = None
            else:
                states = self.checkpoints[owner].at(resumed)
                buffers = [states.get(index, buffer) for index, buffer in enumerate(buffers)]
                reused = resumed - prefix
        if buffers is None:
            return self.from_prefix(agent, matched)
        context = Context(kv=[buffer.view(prefix + reused) for buffer in buffers], reused=reused, buffers=buffers)
        if rule is not None:
            context.state_marks = turn_marks(rule, self.request_now, prefix + reused, matched)
        return context

    def resumed_at(self, owner: Hashable, prefix: int, shared: list[int]) -> int | None:
        """On a hybrid: the input position from which `owner`'s call over `shared` resumes its stored sequence (the
        last kept recurrent states inside what it shares), None where none lies after the role prompt (the call
        starts again from the prefix)."""
        rule = self.runtime.checkpoint_rule
        assert rule is not None
        reused = min(self.seen.get(owner, 0), len(shared) - 1)
        resumed = self.checkpoints[owner].resume(rule, prefix + reused, prefix + len(shared))
        return None if resumed < prefix or resumed == 0 else resumed

    def make_room(self, agent: str, shared: list[int]) -> None:
        owner = self.owner(agent)
        buffers = self.own.get(owner) if owner is not None else None
        prefix = len(self.runtime.prefix(agent))
        if buffers is None:
            return
        if self.runtime.checkpoint_rule is not None and self.resumed_at(owner, prefix, shared) is None:
            return  # the call starts again from its prefix, in new buffers
        for buffer in buffers:
            buffer.make_room(prefix + self.with_output(len(shared)))

    def from_prefix(self, agent: str, matched: int) -> Context:
        """A context of the agent's private prefix alone, computed now (the whole input prefilled; `matched` input
        ids were stored, no state kept inside them)."""
        prefix = len(self.runtime.prefix(agent))
        buffers, flops = self.prefix_buffers(agent, self.with_output(len(self.request_now.input_ids) - prefix))
        kv = [buffer.view(prefix) for buffer in buffers]
        context = Context(kv=kv, reused=0, extra_prefill=prefix, extra_flops=flops, buffers=buffers)
        rule = self.runtime.checkpoint_rule
        if rule is not None:
            context.state_marks = turn_marks(rule, self.request_now, 0, matched)
            if prefix in context.state_marks:
                context.kept_states[prefix] = self.runtime.state_buffers(buffers)
        return context

    def commit(self, chunk: Chunk[Context]) -> float:
        owner = self.owner(chunk.agent)
        if owner is None:
            return 0.0
        prefix = len(self.runtime.prefix(chunk.agent))
        self.own[owner] = [  # a hybrid's states live in its checkpoints, not after the call's end
            StateBuffer(None, 0, buffer.empty) if isinstance(buffer, StateBuffer) else buffer
            for buffer in chunk.buffers
        ]
        seen = chunk.start + len(chunk.ids)
        acts_from = self.runtime.adapter_acts_from(chunk.agent)
        if acts_from is not None:  # an aLoRA call: its adapter-made K/V are not the next call's
            seen = min(seen, max(acts_from - prefix, 0))
        self.seen[owner], self.prefix_len[owner] = seen, prefix
        if self.runtime.recurrent:
            kept = self.checkpoints.setdefault(owner, StateCheckpoints())
            kept.truncate(prefix + chunk.start)  # the later ones belong to the sequence this call replaced
            kept.keep(chunk.context.kept_states)
            kept.truncate(prefix + seen)
        return 0.0

    def truncate(self, keep: int) -> None:
        self.seen = {owner: min(seen, keep) for owner, seen in self.seen.items()}
        for owner, kept in self.checkpoints.items():
            kept.truncate(self.prefix_len[owner] + keep)

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        runtime = self.runtime
        tensors = {
            f"cache:{self.owner_name(owner)}": runtime.held(buffers, self.prefix_len[owner] + self.seen[owner])
            for owner, buffers in self.own.items()
        }
        for owner, kept in self.checkpoints.items():
            tensors[f"{RECURRENT_STATES}:{self.owner_name(owner)}"] = kept.tensors()
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        sizes = {
            f"cache:{self.owner_name(owner)}": runtime.kv_bytes(self.prefix_len[owner] + self.seen[owner])
            for owner in self.own
        }
        for owner, kept in self.checkpoints.items():
            sizes[f"{RECURRENT_STATES}:{self.owner_name(owner)}"] = runtime.state_bytes * len(kept)
        return sizes
