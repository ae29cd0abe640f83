"""Micro-benchmark of Flash-LoRA-Attention (LRAgent, arXiv:2602.01053) against naive expansion and plain SDPA.

For each case (mode, sequence length, rank) three methods attend over the same random tensors, back to back:

    flash_lora  Flash-LoRA-Attention: the Triton kernel on CUDA, the torch reference elsewhere
    naive       expand V = V_base + V_lr·B to full width, then SDPA (what Flash-LoRA-Attention replaces)
    sdpa        plain SDPA over V_base, no LoRA at all (the speed of light for the LoRA variants)

prefill: Lq = Lk = L, causal; decode: Lq = 1 over L keys. Medians after warm-up (`do_bench` on CUDA, perf_counter
elsewhere); FLOPs and bytes are analytic minimums (effective rates); peak ratios only for `DEVICE_PEAKS` devices.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvprof.errors import KvprofError
from kvprof.kernels.attention import MAX_RANK, flash_lora_attention_ref, naive_lora_attention, plain_attention

METHODS = ("flash_lora", "naive", "sdpa")
MODES = ("prefill", "decode")
LR_LAYOUTS = ("shared", "per-head")
MIN_CPU_RUNS = 5
CPU_SCORE_BYTES_LIMIT = 2 * 1024**3


@dataclass(frozen=True)
class DevicePeak:
    """Vendor spec-sheet peaks: dense 16-bit tensor-core FLOP/s and memory bandwidth in bytes/s."""

    flops_16bit: float
    bytes_per_s: float


# Exact `torch.cuda.get_device_name()` strings; SXM parts only (the PCIe/NVL variants have lower peaks).
DEVICE_PEAKS = {
    "NVIDIA H200": DevicePeak(flops_16bit=989e12, bytes_per_s=4.8e12),
    "NVIDIA H100 80GB HBM3": DevicePeak(flops_16bit=989e12, bytes_per_s=3.35e12),
}


@dataclass(frozen=True)
class BenchCase:
    """One attention problem: q (B, H_q, Lq, D); k, v_base (B, H_kv, L, D); v_lr (B, L, r) or (B, H_kv, L, r)."""

    mode: str
    seq_len: int
    rank: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    lr_layout: str

    @property
    def q_len(self) -> int:
        return self.seq_len if self.mode == "prefill" else 1

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs one head attends under bottom-right causality."""
        q_len, kv_len = self.q_len, self.seq_len
        return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2

    def flops(self, method: str) -> float:
        """Useful FLOPs of `method`: QKᵀ and P·V, plus P·V_lr and the B epilogue (flash_lora) or the expansion
        V_lr·B (naive)."""
        attention = 4.0 * self.batch * self.q_heads * self.head_dim * self.visible_pairs
        if method == "flash_lora":
            return attention + 2.0 * self.batch * self.q_heads * self.rank * (
                self.visible_pairs + self.q_len * self.head_dim
            )
        if method == "naive":
            return attention + 2.0 * self.batch * self.kv_heads * self.seq_len * self.rank * self.head_dim
        return attention

    def bytes_moved(self, method: str, element_size: int) -> float:
        """Minimum bytes of `method`: every input read once and the output written once (the naive expansion also
        writes and re-reads the full-width V)."""
        query_and_out = 2 * self.batch * self.q_heads * self.q_len * self.head_dim
        cache = self.batch * self.kv_heads * self.seq_len * self.head_dim
        lr_heads = self.kv_heads if self.lr_layout == "per-head" else 1
        lora = self.batch * lr_heads * self.seq_len * self.rank + self.kv_heads * self.rank * self.head_dim
        elements = {
            "sdpa": query_and_out + 2 * cache,
            "flash_lora": query_and_out + 2 * cache + lora,
            "naive": query_and_out + 2 * cache + lora + 2 * cache,
        }[method]
        return float(elements * element_size)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over `runs` timed runs after warm-up."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    runs: int


def _quantile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _timing(samples_ms: list[float]) -> Timing:
    ordered = sorted(samples_ms)
    return Timing(statistics.median(ordered), _quantile(ordered, 0.2), _quantile(ordered, 0.8), len(ordered))


def time_cuda(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> Timing:
    """`triton.testing.do_bench`: CUDA events, L2 flushed before each run, warm-up and repeats sized in ms."""
    import triton.testing

    return _timing(list(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")))


def time_cpu(fn: Callable[[], object], warmup_ms: float, rep_ms: float, min_runs: int = MIN_CPU_RUNS) -> Timing:
    """perf_counter: warm up `warmup_ms`, then time calls for `rep_ms` and at least `min_runs`."""
    started = time.perf_counter()
    fn()
    while (time.perf_counter() - started) * 1e3 < warmup_ms:
        fn()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < min_runs or (time.perf_counter() - started) * 1e3 < rep_ms:
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
    return _timing(samples)


def implementations(device: torch.device) -> dict[str, str]:
    """What each method runs on `device`, in words, for the report."""
    if device.type == "cuda":
        flash = "Triton kernel flash_lora_attention_fwd (kvprof.kernels.attention_triton)"
    else:
        flash = "torch reference flash_lora_attention_ref (P·V_base + (P·V_lr)·B); the Triton kernel needs CUDA"
    return {
        "flash_lora": flash,
        "naive": "torch: V = V_base + V_lr·B, then torch.nn.functional.scaled_dot_product_attention",
        "sdpa": "torch.nn.functional.scaled_dot_product_attention over V_base (no LoRA)",
    }


def _inputs(case: BenchCase, dtype: torch.dtype, device: torch.device, generator: torch.Generator):
    def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * std).to(dtype)

    q = normal(case.batch, case.q_heads, case.q_len, case.head_dim)
    k = normal(case.batch, case.kv_heads, case.seq_len, case.head_dim)
    v_base = normal(case.batch, case.kv_heads, case.seq_len, case.head_dim)
    lr_shape = (
        (case.batch, case.seq_len, case.rank)
        if case.lr_layout == "shared"
        else (case.batch, case.kv_heads, case.seq_len, case.rank)
    )
    v_lr = normal(*lr_shape)
    lora_b = normal(case.kv_heads, case.rank, case.head_dim, std=case.rank**-0.5)
    return q, k, v_base, v_lr, lora_b


def method_functions(
    case: BenchCase, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three methods as no-argument callables over one set of random inputs."""
    q, k, v_base, v_lr, lora_b = _inputs(case, dtype, device, generator)
    # Both implementations take (q, k, v_base, v_lr, lora_b, ..., causal=...); the Triton one has extra tuning options.
    flash: Callable[..., torch.Tensor]
    if device.type == "cuda":
        from kvprof.kernels.attention_triton import flash_lora_attention_triton as flash
    else:
        flash = flash_lora_attention_ref
    return {
        "flash_lora": lambda: flash(q, k, v_base, v_lr, lora_b, causal=True),
        "naive": lambda: naive_lora_attention(q, k, v_base, v_lr, lora_b, causal=True),
        "sdpa": lambda: plain_attention(q, k, v_base, causal=True),
    }


def check_cpu_case_fits(case: BenchCase) -> None:
    """The CPU reference materialises the (B, H_q, Lq, Lk) scores; refuse cases whose scores exceed 2 GiB."""
    score_bytes = case.batch * case.q_heads * case.q_len * case.seq_len * 8
    if score_bytes > CPU_SCORE_BYTES_LIMIT:
        raise KvprofError(
            f"{case.mode} at L={case.seq_len} needs {score_bytes / 1024**3:.1f} GiB of attention scores "
            "in the CPU reference; pass smaller --seq-lens (or run on CUDA)."
        )


def run_case(
    case: BenchCase,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    warmup_ms: float,
    rep_ms: float,
    peak: DevicePeak | None,
    on_method_done: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Time the three methods on one case, side by side; one result row per method."""
    functions = method_functions(case, dtype, device, generator)
    with torch.no_grad():
        flash_out = functions["flash_lora"]().float()
        naive_out = functions["naive"]().float()
        max_abs_diff = (flash_out - naive_out).abs().max().item()
        del flash_out, naive_out
        timings = {}
        for method in METHODS:
            if device.type == "cuda":
                timings[method] = time_cuda(functions[method], warmup_ms, rep_ms)
            else:
                timings[method] = time_cpu(functions[method], warmup_ms, rep_ms)
            on_method_done()
    element_size = torch.empty((), dtype=dtype).element_size()
    peak_flops = peak.flops_16bit if peak is not None and element_size == 2 else None
    rows = []
    for method, timing in timings.items():
        seconds = timing.median_ms / 1e3
        flops_per_s = case.flops(method) / seconds
        bytes_per_s = case.bytes_moved(method, element_size) / seconds
        rows.append(
            {
                **asdict(case),
                "q_len": case.q_len,
                "method": method,
                **asdict(timing),
                "tflops": flops_per_s / 1e12,
                "gbps": bytes_per_s / 1e9,
                "fraction_of_peak_flops": flops_per_s / peak_flops if peak_flops else None,
                "fraction_of_peak_bandwidth": bytes_per_s / peak.bytes_per_s if peak is not None else None,
                "speedup_vs_naive": timings["naive"].median_ms / timing.median_ms,
                "throughput_vs_sdpa": timings["sdpa"].median_ms / timing.median_ms,
                "max_abs_diff_flash_vs_naive": max_abs_diff,
            }
        )
    return rows


def build_cases(
    modes: list[str],
    seq_lens: list[int],
    ranks: list[int],
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    lr_layout: str,
) -> list[BenchCase]:
    """The cross product of modes × sequence lengths × ranks, with the user's mistakes named."""
    for mode in modes:
        if mode not in MODES:
            raise KvprofError(f"--modes has {mode!r}; use prefill, decode or both (comma-separated).")
    if lr_layout not in LR_LAYOUTS:
        raise KvprofError(f"--lr-layout {lr_layout!r} is unknown; use shared or per-head.")
    if q_heads % kv_heads:
        raise KvprofError(f"--q-heads {q_heads} is not a multiple of --kv-heads {kv_heads}; pick a GQA ratio.")
    if any(length < 1 for length in seq_lens) or batch < 1:
        raise KvprofError("--seq-lens and --batch must be positive.")
    for rank in ranks:
        if not 1 <= rank <= MAX_RANK:
            raise KvprofError(f"--ranks has {rank}; Flash-LoRA-Attention supports ranks 1 to {MAX_RANK}.")
    return [
        BenchCase(mode, length, rank, batch, q_heads, kv_heads, head_dim, lr_layout)
        for mode in modes
        for length in seq_lens
        for rank in ranks
    ]


def bench_device(device: torch.device, cases: list[BenchCase]) -> str:
    """The name of the device the cases are timed on (its CUDA name, or cpu, where every case must fit in memory:
    `check_cpu_case_fits`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for case in cases:
        check_cpu_case_fits(case)
    return "cpu"


def bench_result(
    device_name: str, dtype: torch.dtype, device: torch.device, timed: dict[str, str], rows: list[dict]
) -> dict:
    """`kvprof bench`'s result: the device, dtype, timer, threads, the implementation of each method, the device's
    peaks when known (`DEVICE_PEAKS`) and the rows of `run_case`."""
    peak = DEVICE_PEAKS.get(device_name)
    return {
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "timer": "triton.testing.do_bench" if device.type == "cuda" else "time.perf_counter",
        "cpu_threads": torch.get_num_threads(),
        "implementations": timed,
        "peak": None if peak is None else {"flops_16bit": peak.flops_16bit, "bytes_per_s": peak.bytes_per_s},
        "results": rows,
    }
