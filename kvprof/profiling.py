"""GPU memory readings next to kvprof's analytic accounting: the allocator's peak and the device's own count."""

from __future__ import annotations

import torch


def gpu_memory(device: torch.device) -> dict | None:
    """On CUDA: torch's allocator peak (bytes) and NVML's used/total bytes of the device; None elsewhere.

    NVML sees every process on the GPU, the allocator only this one; both are reported as measured.
    """
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
