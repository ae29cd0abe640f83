"""The `SharingPolicy` interface: what every KV-sharing method implements, and the turn loop they share.

Coordinates. Agent a's input at a turn is `prefix_a + S[0:n]`: its private prefix (its role prompt in prompt mode,
empty in lora mode) followed by the first n tokens of the trajectory's shared timeline S (question, cues, outputs,
observations — everything every agent reads, in order). Policies store caches of S and hand the acting agent a
`Context`: the cache of its prefix and of the first `reused` tokens of S. The agent then computes the rest of its
input (the chunk) with its own adapter over that context, and its output tokens after it. `commit` lets the policy
keep what it wants of the turn.

A subclass implements `assemble` (build the context), `commit` (update stored state), `live_tensors` and
`analytic_bytes` (memory), and declares `name`, `family`, `paper`, `approximate` and the modes it supports.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvprof.errors import KvprofError
from kvprof.kernels.transformers_attention import LoraAttentionContext, LoraValues, use_lora_attention
from kvprof.runtime import KV, Runtime


@dataclass
class TurnRequest:
    """One agent call: its input ids; `output_ids` teacher-forces the output, None generates it greedily."""

    agent: str
    input_ids: list[int]
    output_ids: list[int] | None = None
    max_new_tokens: int = 32


@dataclass
class Context:
    """The cache a policy hands the acting agent before its chunk.

    kv: per layer (K, V), each (B, H_kv, len(prefix) + reused, D); B is 1, or 2 for a double-batched policy.
    reused: shared tokens served from stored caches; from_others: of those, tokens this agent did not compute
    itself with its own adapter. extra_prefill: tokens pushed through the full backbone besides the chunk;
    extra_flops: analytic FLOPs of the policy's own work (LR prefill, down-projections, expansions, rotations).
    lora_values: per layer the rank-r value side (v_lr (1, reused, r), B (H_kv, r, D)) when the values in `kv`
    are V_base only and attention must add (P·V_lr)·B (Flash-LoRA-Attention); None when `kv` is complete.
    """

    kv: list[KV]
    reused: int
    from_others: int
    extra_prefill: int = 0
    extra_flops: float = 0.0
    pending: dict = field(default_factory=dict)
    lora_values: list[LoraValues | None] | None = None


@dataclass
class Chunk:
    """What the acting agent computed this turn, handed to `commit`.

    start: the shared-timeline index of the chunk's first token; ids: chunk input tokens then all output tokens;
    hidden: per layer the attention inputs X of those tokens, (B, n, d_model), when the policy asks for them;
    kv: per layer the (K, V) of the agent's whole sequence after the turn, (B, H_kv, len(prefix) + start + n, D);
    context: the `Context` the turn ran on (its `pending` carries work done in `assemble` to `commit`).
    """

    agent: str
    start: int
    ids: list[int]
    hidden: list[torch.Tensor] | None
    kv: list[KV]
    context: Context


@dataclass
class TurnResult:
    """One policy's account of one turn.

    logits: (n_out, vocab) fp32, row j predicting output token j; input_kv: per layer (K, V), (H_kv, T_in, D),
    what the agent attended to over its whole input; reused span = input positions
    [prefix_len, prefix_len + reused).
    """

    agent: str
    output_ids: list[int]
    logits: torch.Tensor
    input_kv: list[KV]
    prefix_len: int
    reused: int
    from_others: int
    prefilled: int
    flops: float
    ttft_s: float
    latency_s: float
    memory: dict[str, int] = field(default_factory=dict)


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SharingPolicy(ABC):
    """Base class of every sharing policy (see module docstring)."""

    name: ClassVar[str]
    family: ClassVar[str]
    paper: ClassVar[str]
    approximate: ClassVar[bool]
    modes: ClassVar[tuple[str, ...]] = ("lora",)
    needs_hidden: ClassVar[bool] = False
    options: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, runtime: Runtime, **options: str):
        self.runtime = runtime
        for option, value in options.items():
            allowed = self.options.get(option)
            if allowed is None or value not in allowed:
                raise KvprofError(f"policy {self.name} has no option {option}={value!r}; "
                                  f"its options are {self.options or 'none'}.")
        self.settings = {option: options.get(option, allowed[0]) for option, allowed in self.options.items()}
        self.check(runtime)
        self.reset()

    @property
    def label(self) -> str:
        return self.name + "".join(f"-{value}" for value in self.settings.values())

    def check(self, runtime: Runtime) -> None:
        """Refuse a setting this policy cannot replay (mode, adapters)."""
        mode = runtime.agents.spec.mode
        if mode not in self.modes:
            raise KvprofError(f"policy {self.name} replays {' or '.join(self.modes)}-mode traces (agents that differ "
                              f"by {'adapter' if 'lora' in self.modes else 'prompt'}), not {mode} mode; pick another "
                              "policy or trace.")

    @abstractmethod
    def reset(self) -> None:
        """Forget all state: a new trajectory starts."""

    @abstractmethod
    def assemble(self, agent: str, shared: list[int]) -> Context:
        """Build the context for `agent` whose input is prefix + `shared`; must not change stored state."""

    @abstractmethod
    def commit(self, chunk: Chunk) -> float:
        """Keep what the policy stores of the turn; returns the analytic FLOPs that took (0 if none)."""

    @abstractmethod
    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the policy keeps between turns, by structure name."""

    @abstractmethod
    def analytic_bytes(self) -> dict[str, int]:
        """Bytes of each structure computed from token counts and shapes (must equal `live_tensors`' bytes)."""

    def prefix_context(self, agent: str) -> tuple[list[KV], float]:
        """The agent's private prefix computed alone at positions 0.. (exact: nothing precedes it), and its FLOPs."""
        prefix = self.runtime.prefix(agent)
        if not prefix:
            return self.runtime.empty_kv(), 0.0
        cache = self.runtime.cache_from(self.runtime.empty_kv())
        out = self.runtime.forward(agent, prefix, cache, 0, last_logits_only=True)
        return self.runtime.kv_of(out.cache), self.runtime.flops(len(prefix), 0)

    def adapter_rows(self, agent: str) -> list[str] | None:
        """Per-row adapters for a batched forward (None: one row with `agent`'s adapter)."""
        return None

    # ---------------------------------------------------------------------------------------------- the turn

    def _forward(self, agent: str, ids: list[int], cache, start: int, context: Context, prefill: bool = False):
        rows = self.adapter_rows(agent)
        tokens = torch.tensor([ids] * (len(rows) if rows else 1), device=self.runtime.device)
        attention = contextlib.nullcontext()
        if context.lora_values is not None:
            attention = use_lora_attention(lora_context(context.lora_values, tokens.shape[0],
                                                        cache.get_seq_length() + len(ids)))
        with attention:
            return self.runtime.forward(agent, tokens, cache, start, capture=self.needs_hidden, adapter_names=rows,
                                        last_logits_only=prefill)

    def run_turn(self, request: TurnRequest, repeats: int = 1) -> TurnResult:
        """Serve one agent call: assemble, prefill the chunk (timed: TTFT), decode, commit.

        With `repeats` > 1 the context assembly and prefill run once as warm-up and then `repeats` times; TTFT is
        the median. Decoding is teacher-forced on `request.output_ids`, or greedy when they are None.
        """
        runtime, agent = self.runtime, request.agent
        prefix = runtime.prefix(agent)
        if request.input_ids[:len(prefix)] != prefix:
            raise KvprofError(f"agent {agent!r}'s input does not start with its role prompt; the trace was not "
                              "captured with this workflow — pass the matching --workflow.")
        shared = request.input_ids[len(prefix):]
        if not shared:
            raise KvprofError(f"agent {agent!r} has an empty input after its role prompt; the trace is malformed.")
        timings = []
        for _ in range(repeats + 1 if repeats > 1 else 1):
            started = clock(runtime.device)
            context = self.assemble(agent, shared)
            assert context.reused < len(shared), f"{self.name} left no token of the input to compute"
            start = len(prefix) + context.reused
            first = self._forward(agent, shared[context.reused:], runtime.cache_from(context.kv), start, context,
                                  prefill=True)
            timings.append(clock(runtime.device) - started)
        ttft = statistics.median(timings[1:] if repeats > 1 else timings)
        input_kv = [(keys[0], values[0]) for keys, values in runtime.kv_of(first.cache)]
        decode_started = clock(runtime.device)
        hidden_parts = [first.hidden] if first.hidden is not None else []
        if request.output_ids is not None:
            outputs = list(request.output_ids)
            rest = self._forward(agent, outputs, first.cache, len(request.input_ids), context)
            logits = torch.cat([first.logits[0, -1:], rest.logits[0, :-1]])
            final = rest
            if rest.hidden is not None:
                hidden_parts.append(rest.hidden)
        else:
            outputs, rows, final = [], [first.logits[0, -1]], first
            while True:
                outputs.append(int(rows[-1].argmax()))
                step = self._forward(agent, outputs[-1:], final.cache, len(request.input_ids) + len(outputs) - 1,
                                     context)
                final = step
                if step.hidden is not None:
                    hidden_parts.append(step.hidden)
                if runtime.stops(request.input_ids + outputs, outputs, request.max_new_tokens):
                    break
                rows.append(step.logits[0, -1])
            logits = torch.stack(rows)
        decode_s = clock(runtime.device) - decode_started
        hidden = None
        if hidden_parts:
            hidden = [torch.cat([part[layer] for part in hidden_parts], dim=1) for layer in range(runtime.num_layers)]
        commit_started = clock(runtime.device)
        commit_flops = self.commit(Chunk(agent=agent, start=context.reused, ids=shared[context.reused:] + outputs,
                                         hidden=hidden, kv=runtime.kv_of(final.cache), context=context))
        commit_s = clock(runtime.device) - commit_started
        chunk_len = len(shared) - context.reused
        flops = runtime.flops(chunk_len, start) + runtime.flops(len(outputs), len(request.input_ids))
        return TurnResult(agent=agent, output_ids=outputs, logits=logits, input_kv=input_kv, prefix_len=len(prefix),
                          reused=context.reused, from_others=context.from_others,
                          prefilled=chunk_len + context.extra_prefill,
                          flops=flops + context.extra_flops + commit_flops,
                          ttft_s=ttft, latency_s=ttft + decode_s + commit_s, memory=self.analytic_bytes())


def lora_context(values: list[LoraValues | None], rows: int, keys: int) -> LoraAttentionContext:
    """Flash-LoRA-Attention inputs for a forward attending `keys` keys: each layer's v_lr covers the reused
    context and is zero for the tokens after it (their values are complete); batch rows after the first (an
    adapter-free row) get zeros too."""
    context = LoraAttentionContext()
    for layer, entry in enumerate(values):
        if entry is None:
            continue
        v_lr = torch.zeros(rows, keys, entry.v_lr.shape[-1], dtype=entry.v_lr.dtype, device=entry.v_lr.device)
        v_lr[:1, :entry.v_lr.shape[1]] = entry.v_lr
        context.set(layer, v_lr, entry.lora_b)
    return context


def tensor_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Actual bytes of each structure's tensors."""
    return {name: sum(t.numel() * t.element_size() for t in group) for name, group in tensors.items()}
