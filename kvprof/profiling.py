"""The hardware a measurement ran on: the CPU (name, matrix extensions) and GPU memory readings beside kvprof's
analytic accounting."""

from __future__ import annotations

import platform
import time
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
