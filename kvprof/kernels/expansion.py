"""The low-rank view expansion on CPU as one fused native kernel (`expansion.c`), compiled on first use.

A low-rank policy's view of the context is K = K_base + RoPE(F·B_k), V = V_base + F·B_v per layer
(`kvprof.policies.lowrank.LowRankStore`), formed every turn over the whole context. In torch that is a GEMM with k = r
per block of tokens and three element-wise passes, memory-bound; fused, each token's base row is read and its view
row written once (docs/benchmarks.md: 17.3k tokens, 4 layers, H_kv 2, D 64, r 8 on 2 cores, 7.7 ms against 20.6).

Built by the system C compiler (`CC`, default `cc`) with -O3 -march=native into `$XDG_CACHE_HOME/kvprof/native`
(default ~/.cache), keyed by the source, the compiler and the CPU's flags. Without a compiler, or with
`KVPROF_NATIVE=0`, `expand_into` returns False and the caller's torch path runs; the two agree to float32 rounding
(the kernel fuses multiply-adds). float32 only; D and the rotary width multiples of 16.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvprof.results.replay import FUSED_EXPANSION

SOURCE = Path(__file__).with_name("expansion.c")
FLAG_CHOICES = (("-march=native",), ("-mcpu=native",), ())  # the first the compiler accepts
LANES = 16  # floats per vector in the kernel
MIN_TOKENS_PER_THREAD = 256  # fewer: one call, no thread hand-off
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_runs = 0  # expansions the kernel ran in this process
_ARGUMENTS: list[type] = [_I, _I, _I, _I, _I, _P, _L, _L, _P, _L, _P, _P, _P, _P, _L, _P, _L, _L]


def cache_dir() -> Path:
    """Where built kernels are kept: $XDG_CACHE_HOME/kvprof/native, default ~/.cache/kvprof/native."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kvprof" / "native"


def _cpu_flags() -> str:
    """The CPU's feature flags (a -march=native build runs only where they match)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _build(compiler: str) -> Path | None:
    """The shared library built from `SOURCE` (cached), or None when no flag set compiles."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    built_for = [SOURCE.read_text(), version, _cpu_flags()]
    for flags in FLAG_CHOICES:
        command = [compiler, "-O3", *flags, "-shared", "-fPIC", "-std=gnu11"]
        key = hashlib.sha256("\0".join([*built_for, *command]).encode()).hexdigest()
        target = cache_dir() / f"expansion-{key[:20]}.so"
        if target.exists():
            return target
        partial = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(handle)
            built = subprocess.run([*command, str(SOURCE), "-o", partial], capture_output=True, timeout=120)
            if built.returncode == 0:
                os.replace(partial, target)
                return target
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if partial is not None and os.path.exists(partial):
                os.unlink(partial)
    return None


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The built kernel library, or None (no compiler, a failed build, or KVPROF_NATIVE=0); built once a process."""
    if os.environ.get("KVPROF_NATIVE", "1") == "0":
        return None
    path = _build(os.environ.get("CC", "cc"))
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    library.kvprof_expand_f32.argtypes = _ARGUMENTS
    library.kvprof_expand_f32.restype = None
    return library


def expansion_path(device: str) -> str:
    """How low-rank views are expanded on `device` in this process: by kvprof's fused CPU kernel, or by torch."""
    return FUSED_EXPANSION if device == "cpu" and native_library() is not None else "torch"


def kernel_runs() -> int:
    """How many expansions the kernel has run in this process (a replay compares the count before and after)."""
    return _runs


@functools.cache
def _pool(process: int, threads: int) -> ThreadPoolExecutor:
    """The threads the kernel's calls are split over: one pool per process (a forked child inherits the pool but not
    its threads) and thread count."""
    return ThreadPoolExecutor(threads, thread_name_prefix="kvprof-expand")


def _eligible(tensors: list[torch.Tensor], head_dim: int, rotary: int) -> bool:
    return (
        head_dim % LANES == 0
        and rotary % LANES == 0
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    )


def expand_into(
    base: torch.Tensor,
    factors: torch.Tensor,
    up: torch.Tensor,
    swapped: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """out = base + F·B, its first R channels RoPE-rotated when `swapped` is given; False (out untouched) when the
    kernel cannot run: no library, or inputs other than float32 CPU tensors with unit channel stride.

    base, out (1, H_kv, n, D); factors F (1, n, r); up B (H_kv, r, D) per head, scaled; swapped (H_kv, r, R): B's
    rotary channels swapped (`Rope.swap`); cos, sin (n, R): the tokens' own rows."""
    library = native_library()
    heads, length, head_dim = base.shape[1], base.shape[2], base.shape[3]
    rank = factors.shape[-1]
    up = up.contiguous()
    tables: list[torch.Tensor] = []
    if swapped is not None:
        if cos is None or sin is None or cos.stride(0) != sin.stride(0):
            return False
        tables = [swapped.contiguous(), cos, sin]
    rotary = tables[0].shape[-1] if tables else 0
    if library is None or not _eligible([base, factors, up, out, *tables], head_dim, rotary):
        return False
    global _runs
    _runs += 1
    size = base.element_size()  # float32 throughout: element offsets in bytes

    def arguments(lo: int, hi: int) -> tuple:
        """The kernel's arguments for tokens lo..hi, as plain numbers (computed here, called from any thread)."""
        table_stride = tables[1].stride(0) if tables else 0
        return (
            heads,
            hi - lo,
            head_dim,
            rank,
            rotary,
            base.data_ptr() + lo * base.stride(2) * size,
            base.stride(1),
            base.stride(2),
            factors.data_ptr() + lo * factors.stride(1) * size,
            factors.stride(1),
            up.data_ptr(),
            tables[0].data_ptr() if tables else None,
            tables[1].data_ptr() + lo * table_stride * size if tables else None,
            tables[2].data_ptr() + lo * table_stride * size if tables else None,
            table_stride,
            out.data_ptr() + lo * out.stride(2) * size,
            out.stride(1),
            out.stride(2),
        )

    threads = min(torch.get_num_threads(), length // MIN_TOKENS_PER_THREAD)
    if threads <= 1:
        library.kvprof_expand_f32(*arguments(0, length))
        return True
    share = -(-length // threads)
    share += -share % 4
    calls = [arguments(lo, min(lo + share, length)) for lo in range(0, length, share)]
    for done in [_pool(os.getpid(), threads).submit(library.kvprof_expand_f32, *call) for call in calls]:
        done.result()
    return True
