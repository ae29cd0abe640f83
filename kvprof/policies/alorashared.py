"""ALoRAShared (kvprof): exact sharing between Activated LoRA agents — one cache of the base model's K/V.

No paper proposes it: it is the exact baseline an aLoRA deployment gets (an engine that keys only post-invocation
blocks by adapter shares the same), beside the approximate sharing of plain LoRA agents. Why it is exact:
docs/alora.md. FullShared's timeline is cut after each call at its invocation: each turn reuses the base prefix and
prefills the rest, the last calls' adapter-made tokens (cue, output) recomputed with the base weights. Equal to
NonShared to float rounding, with fewer tokens prefilled. A turn's record splits its input into `reused` base tokens,
`adapter_made` tokens (of `prefilled`) and the new rest.

- A plain LoRA agent reuses and stores nothing (exact, NonShared's work).
- Agents with system prompts of their own diverge there (lora mode has no private prefixes: only the common start is
  reused).
- Moved spans are computed (base K/V depend on their context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvprof.policies.fullshared import FullShared, FullSharedContext
from kvprof.policies.turns import Chunk

if TYPE_CHECKING:
    from kvprof.model.runtime import Runtime


def invocation_notes(runtime: Runtime) -> list[str]:
    """What a reader must know of an aLoRA replay: that no agent has an Activated LoRA adapter, if so."""
    if not runtime.invocations:
        return ["no agent has an Activated LoRA adapter: every call computes its whole input, as NonShared"]
    return []


class ALoRAShared(FullShared):
    name = "alorashared"
    family = "kvprof"
    paper = "kvprof: exact sharing of the base K/V Activated LoRA agents compute before their invocation"
    approximate = False
    modes = ("lora",)
    published = ()
    moves_spans = False
    timeline_state: ClassVar[tuple[str, ...]] = (*FullShared.timeline_state, "seen")

    def reset(self) -> None:
        super().reset()
        self.seen = 0  # timeline tokens the calls computed, base or adapter-made (the store holds the base ones)

    def notes(self) -> list[str]:
        return invocation_notes(self.runtime)

    def assemble(self, agent: str, shared: list[int]) -> FullSharedContext:
        if agent not in self.runtime.invocations:  # a plain LoRA agent: no K/V of the store is its own
            return self.context_type(kv=self.runtime.empty_kv(), reused=0)
        context = super().assemble(agent, shared)
        context.adapter_made = max(min(self.seen, len(shared) - 1) - context.reused, 0)
        return context

    def make_room(self, agent: str, shared: list[int]) -> None:
        if agent in self.runtime.invocations:  # a plain LoRA agent's call extends no store
            super().make_room(agent, shared)

    def commit(self, chunk: Chunk[FullSharedContext]) -> float:
        self.seen = max(self.seen, chunk.start + len(chunk.ids))
        if chunk.agent not in self.runtime.invocations:
            return 0.0
        super().commit(chunk)
        acts_from = self.runtime.adapter_acts_from(chunk.agent)
        if acts_from is not None:  # the call's K/V from its invocation on are its adapter's
            cut = max(acts_from - len(self.runtime.prefix(chunk.agent)), 0)  # in shared-input coordinates
            super().truncate(min(len(self.producers), cut))
        return 0.0

    def truncate(self, keep: int) -> None:
        super().truncate(keep)
        self.seen = min(self.seen, keep)
