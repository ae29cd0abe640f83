"""NonShared: each agent keeps its own cache and prefills every token it has not processed itself.

The dense baseline (of LRAgent and PReCache) every policy is measured against: exact; memory N× with N agents.

- An aLoRA agent keeps of a call's cache only the tokens before its invocation: its next call reads the later ones
  with the base weights, as peft's `generate` computes them.
- On a hybrid model (`kvprof.model.recurrent`) a turn whose reused prefix is shorter than the agent's recurrent
  state (a branch back to an earlier point) starts over from its role prompt.

Phases: TTFT — the role prompt on the agent's first turn, then the chunk it has not processed; decode — one token
over its own cache; after the turn — keeping the cache (appended in place, `kvprof.model.buffers`: nothing copied).
"""

from __future__ import annotations

import torch

from kvprof.model.buffers import KVBuffer
from kvprof.model.recurrent import RECURRENT_STATES
from kvprof.policies.base import SharingPolicy
from kvprof.policies.turns import Chunk, Context


class NonShared(SharingPolicy[Context]):
    name = "nonshared"
    family = "baseline"
    paper = "the dense baseline of LRAgent and PReCache"
    approximate = False
    modes = ("lora", "prompt")
    serves_others = False
    timeline_state = ("own", "seen")

    def reset(self) -> None:
        # agent -> per layer (K, V) buffers, (1, H_kv, ≥ L_agent, D), or a hybrid's recurrent state after L_agent
        self.own: dict[str, list[KVBuffer]] = {}
        self.seen: dict[str, int] = {}  # agent -> shared-timeline tokens in its cache

    def assemble(self, agent: str, shared: list[int]) -> Context:
        reused = min(self.seen.get(agent, 0), len(shared) - 1)
        end = len(self.runtime.prefix(agent)) + reused
        buffers = self.own.get(agent)
        if buffers is None or not self.runtime.states_cover(buffers, end):  # a hybrid's state is of another length
            buffers, flops = self.prefix_buffers(agent)
            prefix = len(self.runtime.prefix(agent))
            kv = [buffer.view(prefix) for buffer in buffers]
            return Context(kv=kv, reused=0, extra_prefill=prefix, extra_flops=flops, buffers=buffers)
        return Context(kv=[buffer.view(end) for buffer in buffers], reused=reused, buffers=buffers)

    def commit(self, chunk: Chunk[Context]) -> float:
        self.own[chunk.agent] = chunk.buffers
        self.seen[chunk.agent] = chunk.start + len(chunk.ids)
        acts_from = self.runtime.adapter_acts_from(chunk.agent)
        if acts_from is not None:  # an aLoRA call: its adapter-made K/V are not the next call's
            self.seen[chunk.agent] = min(
                self.seen[chunk.agent], max(acts_from - len(self.runtime.prefix(chunk.agent)), 0)
            )
        return 0.0

    def truncate(self, keep: int) -> None:
        self.seen = {agent: min(seen, keep) for agent, seen in self.seen.items()}

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        runtime = self.runtime
        tensors = {
            f"cache:{agent}": runtime.held(buffers, len(runtime.prefix(agent)) + self.seen[agent])
            for agent, buffers in self.own.items()
        }
        if runtime.recurrent:
            for agent, buffers in self.own.items():
                tensors[f"{RECURRENT_STATES}:{agent}"] = [
                    t for b in runtime.state_buffers(buffers) for t in b.tensors()
                ]
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        sizes = {
            f"cache:{agent}": runtime.kv_bytes(len(runtime.prefix(agent)) + self.seen[agent]) for agent in self.own
        }
        if runtime.recurrent:
            sizes.update({f"{RECURRENT_STATES}:{agent}": runtime.state_bytes for agent in self.own})
        return sizes
