"""The hardware a measurement ran on: the CPU (name, matrix extensions) and GPU memory readings beside kvprof's
analytic accounting."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import platform
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

CPU_MATRIX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")


def cpu_description() -> dict:
    """The CPU's model name and its `CPU_MATRIX_FLAGS` from /proc/cpuinfo (bfloat16 is fast on CPU only with AMX or
    AVX512-BF16; on AVX2-only CPUs far slower than float32)."""
    name, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {"name": name, "matrix_flags": [flag for flag in CPU_MATRIX_FLAGS if flag in flags]}


def gpu_memory(device: torch.device) -> dict | None:
    """On CUDA: torch's allocator peak and NVML's used/total device bytes (NVML sees every process, the allocator
    only this one; both reported as measured); None elsewhere."""
    if device.type != "cuda":
        return None
    reading = {"allocator_peak_bytes": torch.cuda.max_memory_allocated(device)}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            reading.update(nvml_used_bytes=int(info.used), nvml_total_bytes=int(info.total))
        finally:
            pynvml.nvmlShutdown()
    except Exception as err:  # NVML missing or refused: report the allocator alone, and why
        reading["nvml_error"] = f"{type(err).__name__}: {err}"
    return reading


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
TRIM_ABOVE_BYTES = 2**31 - 1  # mallopt takes a C int: free memory at the heap's top is handed back past 2 GiB


@functools.cache
def _libc_function(name: str):
    """The C library's function `name` (ctypes), or None where there is no such library or function."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's allocator serve every allocation from its heap and keep freed memory for the next one, as the
    CUDA caching allocator does on a GPU, once per process; whether it took effect (False without glibc). The
    process keeps its peak.

    By default glibc maps a large block (over 128 KiB, up to 32 MiB as it adapts) afresh and unmaps it when freed, so
    a turn's large tensors land on new pages. Where a page fault is slow (on this project's VMs about 20 µs per 4 KiB
    page) that cost is not the policy's: a 17k-token prefill took 2.7 s or 5.7 s from one run to the next, and a
    per-turn view of a long context spent most of its time faulting (docs/benchmarks.md). Not every reuse is
    guaranteed: glibc may extend the heap rather than reuse a freed block (an identical 64 MiB tensor was placed
    just above the one freed before it; a 64-byte-aligned request needs a little more than the freed block, or small
    allocations split it): `TouchedHeap` keeps the heap's top touched for what a timed section may grow into."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE_BYTES))


def heap_kept() -> bool:
    """Whether `keep_freed_memory` has taken effect in this process (asked without applying it)."""
    return keep_freed_memory.cache_info().currsize > 0 and keep_freed_memory()


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: ten size_t fields, `keepcost` (the heap top's free bytes) the last."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_top_bytes() -> int | None:
    """Free bytes at the top of glibc's main heap (`mallinfo2().keepcost`): what it carves before growing the heap
    onto fresh pages; None without glibc 2.33."""
    mallinfo2 = _libc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().keepcost)


def minor_faults() -> int:
    """Pages this process has faulted in so far (first touches of memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


RESERVE_LIMIT_BYTES = 2**30  # a reserve freed into the heap's top stays far below TRIM_ABOVE_BYTES (never trimmed)
RESERVE_TRIES = 8  # blocks a reserve may hold in the heap's holes before one comes from its top


class TouchedHeap:
    """Where glibc keeps freed memory (`keep_freed_memory`): before each timed section, the heap's top holds as many
    touched free bytes as the most an earlier section faulted in, so the section's new tensors land on pages already
    touched — as a GPU's caching allocator serves a repeated step from blocks it holds. One per timed owner (a
    policy); its sections are timed prefills.

    Kept memory alone still let a repeat fault: a request no freed block fits grows the heap onto fresh pages (on the
    ReAct-shape replay, up to 98k pages in one policy's timed prefills, at about 20 µs each on this project's VMs).
    The reserve is written and freed untimed: a block of that size, held while it lands in a hole of the heap (then
    another, up to `RESERVE_TRIES`), until one comes from the top; freed, it joins the top. Without `mallinfo2` one
    block is written and freed."""

    def __init__(self) -> None:
        self.bytes = 0

    def _reserve(self) -> None:
        """Make the heap's top hold `bytes` touched free bytes (the class docstring says how)."""
        held = []  # blocks that landed in holes of the heap, kept until this returns so the next one comes elsewhere
        for _ in range(RESERVE_TRIES):
            top = heap_top_bytes()
            if top is not None and top >= self.bytes:
                return
            block = torch.empty(self.bytes, dtype=torch.uint8)
            if top is not None and heap_top_bytes() == top:
                held.append(block)
                continue
            block.fill_(0)
            del block  # freed: it joins the heap's top
            if top is None:
                return

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """Reserve (where glibc keeps freed memory), then run the timed section; its faults raise the next reserve."""
        if not heap_kept():
            yield
            return
        if self.bytes:
            self._reserve()
        before = minor_faults()
        yield
        faulted = (minor_faults() - before) * resource.getpagesize()
        self.bytes = min(RESERVE_LIMIT_BYTES, max(self.bytes, faulted))


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class CudaPeak:
    """The CUDA allocator's peak during a turn above its start, plus the policy's stored bytes before it (analytic,
    equal to its live tensors): the memory its own work needs at worst. None off CUDA."""

    def __init__(self, device: torch.device, stored: int):
        self.device, self.stored = device, stored
        self.start = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)

    def peak(self) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return self.stored + torch.cuda.max_memory_allocated(self.device) - self.start

    def allocated(self) -> int | None:
        """The allocator's peak since the turn started, everything allocated counted (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


@contextlib.contextmanager
def torch_settings(threads: int = 0, deterministic: bool | None = None) -> Iterator[None]:
    """torch's intra-op `threads` (0: as they are) and deterministic-algorithms mode (None: as it is) for the block,
    both restored after it: a library call never changes them for the process that called it (a training run left a
    test process at two threads beside another, and every later test in it spun for the cores)."""
    threads_before = torch.get_num_threads()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    if threads:
        torch.set_num_threads(threads)
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before, warn_only=warn_only_before)


STATUS = Path("/proc/self/status")


def proc_kib(path: Path, field: str) -> int | None:
    """A `field:  N kB` line of a /proc file in bytes, None where the file or field is missing (not Linux)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_host_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM (its own address space; `ru_maxrss` would keep a
    parent's peak across an exec), else `ru_maxrss`."""
    peak = proc_kib(STATUS, "VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes() -> int | None:
    """The CUDA allocator's peak in this process (since its statistics were last reset), None where CUDA was not
    used."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK = "5"  # written to clear_refs: VmHWM starts again from the resident size now


class CallPeaks:
    """The peak memory between the starts of successive calls (a run's turn or timed prefill, `mark`), where a
    plan's probe asks for them (`record`): the host's (VmHWM, started again at each mark) and the CUDA allocator's
    (its peak statistics reset at each mark).

    A process's peak is the most it held at any moment. What each moment holds grows linearly with the model's layers
    (weights, stores, a turn's caches), but by different amounts, so the moment of the peak moves: on a model's first
    layers a turn's activations may top it early, on all of them the stores late. A probe's peak alone, extrapolated,
    underestimates; its peak per call, extrapolated call by call, does not (`kvprof.planning.plan`)."""

    def __init__(self) -> None:
        self.recording = False
        self.host: list[int] | None = None
        self.device: list[int | None] = []

    def record(self) -> None:
        """Start recording: the device's peaks, and the host's where VmHWM can be started again (Linux)."""
        self.recording, self.device = True, []
        try:
            CLEAR_REFS.write_text(RESET_PEAK)
            self.host = []
        except OSError:
            self.host = None

    def mark(self) -> None:
        """A call starts: keep the peaks since the last mark and start them again (nothing unless recording)."""
        if not self.recording:
            return
        self.device.append(peak_device_bytes())
        if self.device[-1] is not None:
            torch.cuda.reset_peak_memory_stats()
        if self.host is not None:
            self.host.append(peak_host_bytes())
            CLEAR_REFS.write_text(RESET_PEAK)

    def finish(self) -> tuple[list[int] | None, list[int | None]]:
        """The peaks from the start of recording to each mark and after the last: the host's (None where VmHWM
        could not start again) and the device's (None before CUDA started)."""
        self.mark()
        host, device = self.host, self.device
        self.recording, self.host, self.device = False, None, []
        return host, device


CALL_PEAKS = CallPeaks()


def resident_host_bytes() -> int | None:
    """This process's resident memory now (VmRSS), None off Linux."""
    return proc_kib(STATUS, "VmRSS")
