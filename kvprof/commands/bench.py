"""`kvprof bench`: Flash-LoRA-Attention vs naive expansion vs plain SDPA. Cases, timers and FLOP/byte models:
`kvprof.kernels.benchmark`; here options, progress, the table, JSON result and HTML plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, progress, write_result
from kvprof.commands.options import DeviceOption, DtypeOption, OutOption, SeedOption
from kvprof.errors import KvprofError

DEFAULT_SEQ_LENS = {"cuda": "1024,4096,16384,32768", "cpu": "128,512"}


HELP = {
    "seq_lens": "Comma-separated context lengths L in tokens (prefill: Lq = Lk = L; decode: Lq = 1, Lk = L). Default: "
    f"{DEFAULT_SEQ_LENS['cuda']} on CUDA, {DEFAULT_SEQ_LENS['cpu']} on CPU.",
    "head_dim": "Head dimension D; the Triton kernel supports 32, 64 and 128.",
    "lr_layout": "V_lr layout: shared (B, L, r), as LoRA on v_proj gives, or per-head (B, H_kv, L, r).",
    "warmup_ms": "Warm-up time per method and case, in milliseconds.",
    "rep_ms": "Timed repeats per method and case, in milliseconds (at least 5 runs on CPU); the median is reported.",
    "threads": "CPU threads torch may use (0 = torch's default); 1 gives steadier CPU timings on a busy machine.",
}


def command(
    seq_lens: Annotated[str | None, typer.Option("--seq-lens", help=HELP["seq_lens"])] = None,
    ranks: Annotated[str, typer.Option("--ranks", help="Comma-separated LoRA ranks r (1-64).")] = "16",
    modes: Annotated[
        str, typer.Option("--modes", help="Comma-separated: prefill (causal), decode.")
    ] = "prefill,decode",
    batch: Annotated[int, typer.Option("--batch", help="Sequences per call (B).")] = 1,
    q_heads: Annotated[int, typer.Option("--q-heads", help="Query heads H_q (Llama-3.1-8B: 32).")] = 32,
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="Key/value heads H_kv (Llama-3.1-8B: 8).")] = 8,
    head_dim: Annotated[int, typer.Option("--head-dim", help=HELP["head_dim"])] = 128,
    lr_layout: Annotated[str, typer.Option("--lr-layout", help=HELP["lr_layout"])] = "shared",
    warmup_ms: Annotated[float, typer.Option("--warmup-ms", help=HELP["warmup_ms"])] = 25.0,
    rep_ms: Annotated[float, typer.Option("--rep-ms", help=HELP["rep_ms"])] = 100.0,
    threads: Annotated[int, typer.Option("--threads", help=HELP["threads"])] = 0,
    out: OutOption = Path("runs/bench"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: SeedOption = 0,
) -> None:
    """Kernel micro-benchmark: Flash-LoRA-Attention vs naive V expansion vs plain SDPA (median time, TFLOP/s, GB/s)."""
    args = dict(locals())
    import torch

    from kvprof.kernels.attention import SUPPORTED_HEAD_DIMS
    from kvprof.kernels.benchmark import (
        DEVICE_PEAKS,
        METHODS,
        bench_device,
        bench_result,
        build_cases,
        implementations,
        run_case,
    )
    from kvprof.model.agents import resolve_device, resolve_dtype
    from kvprof.report import write_html
    from kvprof.report.bench import results_table, sections

    if threads < 0:
        raise KvprofError(f"--threads {threads} must be 0 (torch's default) or a positive count.")
    if threads:
        torch.set_num_threads(threads)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if torch_device.type == "cuda" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise KvprofError(
            f"--head-dim {head_dim} has no Triton kernel; use one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}."
        )
    lengths = _int_list("--seq-lens", seq_lens or DEFAULT_SEQ_LENS["cuda" if torch_device.type == "cuda" else "cpu"])
    cases = build_cases(
        _names(modes), lengths, _int_list("--ranks", ranks), batch, q_heads, kv_heads, head_dim, lr_layout
    )
    device_name = bench_device(torch_device, cases)
    timed = implementations(torch_device)
    for method in METHODS:
        console.print(f"[bold]{method}[/]: {timed[method]}")
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    peak = DEVICE_PEAKS.get(device_name)
    rows: list[dict] = []
    with progress() as bar:
        job = bar.add_task(f"timing on {device_name}", total=len(cases) * len(METHODS))
        for case in cases:
            rows.extend(
                run_case(case, torch_dtype, torch_device, generator, warmup_ms, rep_ms, peak, lambda: bar.advance(job))
            )
    payload = bench_result(device_name, torch_dtype, torch_device, timed, rows)
    console.print(results_table(payload).to_rich())
    json_path = write_result(out, "bench", payload, args)
    shape = f"B={batch}, H_q={q_heads}, H_kv={kv_heads}, D={head_dim}, V_lr {lr_layout}"
    subtitle = f"{device_name} · {payload['dtype']} · {shape}"
    html_path = write_html(out / "bench.html", "kvprof bench", sections(payload), subtitle=subtitle)
    console.print(f"wrote {json_path} and {html_path}")


def _names(text: str) -> list[str]:
    return [piece.strip() for piece in text.split(",") if piece.strip()]


def _int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(piece) for piece in _names(text)]
    except ValueError:
        raise KvprofError(
            f"{option} {text!r} is not a comma-separated list of integers; e.g. {option} 1024,4096."
        ) from None
    if not values:
        raise KvprofError(f"{option} is empty; give at least one value, e.g. {option} 1024.")
    return values
