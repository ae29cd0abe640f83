"""How a replay runs and ran: the settings carried from a command to the engine, its shards and the threshold sweeps
(`ReplaySettings`), the options that choose them (`check_setting`, `lora_attention_mode`), and how the replay ran as
its result records it: model, mode, timing, page size, span matching, checkpoint rule, attention path, device
(`run_setting`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvprof.errors import KvprofError
from kvprof.kernels.attention import EXPAND, KERNEL, SHORT, LoraAttention
from kvprof.kernels.expansion import kernel_runs
from kvprof.kernels.transformers_attention import stored_value_calls
from kvprof.model.agents import AgentSet
from kvprof.model.architecture import weights_bytes
from kvprof.model.runtime import Runtime
from kvprof.profiling import cpu_description, gpu_memory, keep_freed_memory
from kvprof.replay.memory import PAGE_SIZE
from kvprof.replay.timing import TIMINGS
from kvprof.results.replay import FUSED_EXPANSION, STORED_IN_SHORT_FORWARDS
from kvprof.threads import MachineLoad
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching


@dataclass(frozen=True)
class ReplaySettings:
    """How a replay runs: `repeats` (timed prefills per turn, or timed runs per trajectory), the `online` re-runs,
    how the low-rank policies attend their rank-r values (`lora_attention`: `Runtime`), the `timing` mode
    (`TIMINGS`), the KV block `page_size` of the papers' memory (`paper_memory`), `span_matching`
    (`SpanMatching`) and `kv_budget`: bytes the runs' stored caches are held within (`kvprof.replay.parking`;
    None: no limit; a replay in this process only)."""

    repeats: int = 1
    online: bool = False
    lora_attention: LoraAttention = EXPAND
    timing: str = "turn"
    page_size: int = PAGE_SIZE
    span_matching: SpanMatching = DEFAULT_MATCHING
    kv_budget: int | None = None


DEFAULT_SETTINGS = ReplaySettings()


def checkpoint_setting(agents: AgentSet, span_matching: SpanMatching) -> dict | None:
    """The checkpoint rule a hybrid's replay ran under, as resolved on the model (vLLM's B derived from its sizes):
    `CheckpointRule`'s fields and its `label`; None without recurrent layers."""
    rule = Runtime(agents, span_matching=span_matching).checkpoint_rule if agents.recurrent else None
    return None if rule is None else asdict(rule) | {"label": rule.label}


def check_setting(timing: str, lora_attention: str) -> None:
    """Refuse a --timing outside `TIMINGS`, a --lora-attention other than auto, kernel, expand."""
    if timing not in TIMINGS:
        raise KvprofError(f"--timing {timing!r} is not {' or '.join(TIMINGS)}; pass one of them.")
    if lora_attention not in ("auto", "kernel", "expand"):
        raise KvprofError(f"--lora-attention {lora_attention!r} is not auto, kernel or expand; pass one of them.")


def lora_attention_mode(option: str, device: str) -> LoraAttention:
    """`--lora-attention` on `device`: kernel and expand as named; auto the kernel on a GPU and, on CPU, the values
    as stored in the forwards where that pays, expanded in the others (`Runtime.values_as_stored`)."""
    if option == "auto":
        return KERNEL if device != "cpu" else SHORT
    return KERNEL if option == "kernel" else EXPAND


def timing_setting(timing: str, repeats: int, heap_kept: bool = False, load: MachineLoad | None = None) -> dict:
    """How TTFT, TPOT and latency were timed: mode, whose practice (`Option.origins` labels), timed and warm-up
    runs, whether a turn's prefills were timed round-robin across the runs (`interleaved_prefills`), whether the CPU
    allocator kept freed memory (`keep_freed_memory`), and the machine's `load` while they were (other processes'
    cores, whether they contended: `kvprof.threads.MachineLoad`; absent where not metered)."""
    trajectory = timing == "trajectory"
    return {
        "mode": timing,
        "origin": "code" if trajectory else "kvprof",
        "runs": repeats,
        "warm_up_runs": 1 if trajectory or repeats > 1 else 0,
        "interleaved": not trajectory and repeats > 1,
        "heap_kept": heap_kept,
    } | ({} if load is None else {"load": load.to_json()})


@dataclass(frozen=True)
class KernelCounts:
    """How often this process ran the fused CPU expansion (`kvprof.kernels.expansion.kernel_runs`) and attended
    rank-r values as stored (`stored_value_calls`): taken when a replay starts, compared when it ends."""

    expansions: int
    stored_values: int

    @classmethod
    def now(cls) -> KernelCounts:
        return cls(kernel_runs(), stored_value_calls())


def attention_path(lora_attention: LoraAttention, fused_expansion: bool, stored_values: bool = False) -> str:
    """How the low-rank policies attended: Flash-LoRA-Attention, or expanded views (by kvprof's fused CPU kernel
    when `fused_expansion`: it ran in the replay, `kvprof.kernels.expansion`) and SDPA, and with "short" where
    `stored_values` (some forwards attended the rank-r values as stored), a clause saying so."""
    if lora_attention == KERNEL:
        return "flash-lora-attention"
    expanded = f"expanded values ({FUSED_EXPANSION}) + sdpa" if fused_expansion else "expanded values + sdpa"
    return f"{expanded}; {STORED_IN_SHORT_FORWARDS}" if lora_attention == SHORT and stored_values else expanded


def run_setting(
    agents: AgentSet,
    settings: ReplaySettings,
    started: KernelCounts | None = None,
    load: MachineLoad | None = None,
) -> dict:
    """How a replay under `settings` ran: model, mode, repeats, timing (`load`: the machine's while it timed), page
    size, span matching (on a hybrid, the checkpoint rule it resolves to: `checkpoint_setting`), weights' bytes,
    layer kinds, attention path (`attention_path`: what ran since the `started` counts), device, CPU, dtype, GPU
    memory (the allocator's peak so far)."""
    repeats, timing = settings.repeats, settings.timing
    return dict(
        checkpoint_rule=checkpoint_setting(agents, settings.span_matching),
        model=agents.model_name,
        mode=agents.spec.mode,
        repeats=repeats,
        timing=timing_setting(timing, repeats, agents.device.type == "cpu" and keep_freed_memory(), load),
        page_size=settings.page_size,
        span_matching=settings.span_matching.to_json(),
        weights_bytes=weights_bytes(agents.model),
        layers=[kind.to_json() for kind in agents.layer_kinds],
        lora_attention=attention_path(
            settings.lora_attention,
            started is not None and kernel_runs() > started.expansions,
            started is not None and stored_value_calls() > started.stored_values,
        ),
        device=str(agents.device),
        cpu=cpu_description(),
        dtype=str(agents.base_model.dtype).removeprefix("torch."),
        gpu_memory=gpu_memory(agents.device),
    )
