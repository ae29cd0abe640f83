"""FullShared and ALoRAShared on hybrid models (kvprof's: no paper defines them there): one prefix cache over every
agent's sequences, as a serving engine keeps it, resumed where its checkpoint rule kept the recurrent states
(`kvprof.policies.state_checkpoints`).

A recurrent layer's state after a prefix summarises that exact sequence and has no per-token entries: it cannot be
re-aligned to other positions or follow another prefix, so a hybrid's cache serves a call only the prefix it shares
id for id with a stored sequence, up to the last kept state; moved spans are recomputed through every layer.

- Prompt mode: agents whose private prefixes (role prompts) are the same ids share one cache; a call of another
  agent differs from the first id where its role prompt does, so nothing after can be served to it: exact, and equal
  to NonShared where every role prompt differs (FullShared on attention models re-rotates keys instead).
- Lora mode: no private prefixes, so every agent reads the one cache: the producer's K/V and states handed to the
  reader with another adapter (approximate, as FullShared on attention models); a call's recomputed tokens replace
  the stored ones.
- ALoRAShared: Activated LoRA agents share the cache up to each call's invocation, where it holds the base model's
  K/V and states (exact), from the last kept state at or before it; plain LoRA agents reuse and store nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

from kvprof.claims.types import Published
from kvprof.policies.alorashared import ALoRAShared, invocation_notes
from kvprof.policies.fullshared import FullShared
from kvprof.policies.nonshared import NonShared
from kvprof.policies.turns import Chunk, Context

ON_HYBRIDS = "on a hybrid model: one prefix cache over every agent's sequences, resumed at kept recurrent states"


class HybridFullShared(NonShared):
    name = FullShared.name
    family = FullShared.family
    paper = f"{FullShared.paper}; {ON_HYBRIDS} (kvprof's)"
    approximate = True
    modes: ClassVar[tuple[str, ...]] = ("lora", "prompt")
    published: ClassVar[tuple[Published, ...]] = FullShared.published
    serves_others = True

    def owner(self, agent: str) -> Hashable | None:
        return tuple(self.runtime.prefix(agent))

    def owner_name(self, owner: Hashable) -> str:
        if not owner:
            return "shared"
        agents = self.runtime.agents.spec.names
        return "+".join(agent for agent in agents if tuple(self.runtime.prefix(agent)) == owner)


class HybridALoRAShared(HybridFullShared):
    name = ALoRAShared.name
    family = ALoRAShared.family
    paper = f"{ALoRAShared.paper}; {ON_HYBRIDS}"
    approximate = False
    modes: ClassVar[tuple[str, ...]] = ("lora",)
    published: ClassVar[tuple[Published, ...]] = ()
    timeline_state: ClassVar[tuple[str, ...]] = (*NonShared.timeline_state, "computed")

    def notes(self) -> list[str]:
        return invocation_notes(self.runtime)

    def owner(self, agent: str) -> Hashable | None:
        return () if agent in self.runtime.invocations else None

    def reset(self) -> None:
        super().reset()
        self.computed = 0  # timeline tokens the calls computed, base or adapter-made (the cache holds the base ones)

    def assemble(self, agent: str, shared: list[int]) -> Context:
        context = super().assemble(agent, shared)
        if self.owner(agent) is not None:
            context.adapter_made = max(min(self.computed, len(shared) - 1) - context.reused, 0)
        return context

    def commit(self, chunk: Chunk[Context]) -> float:
        self.computed = max(self.computed, chunk.start + len(chunk.ids))
        return super().commit(chunk)

    def truncate(self, keep: int) -> None:
        super().truncate(keep)
        self.computed = min(self.computed, keep)
