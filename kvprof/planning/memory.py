"""Memory as the plan compares it: the host's and a GPU's free bytes, and sizes as users write them."""

from __future__ import annotations

from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.profiling import proc_kib

MEMINFO = Path("/proc/meminfo")


def free_host_bytes() -> int | None:
    """Memory the host can give a new process without swapping (MemAvailable), None off Linux."""
    return proc_kib(MEMINFO, "MemAvailable")


def free_device_bytes(device: str) -> int | None:
    """Free bytes of the CUDA device `device` (the driver's count: other processes' use taken off), None for a
    CPU or when CUDA is not available."""
    import torch

    if not torch.cuda.is_available() or not (device == "auto" or device.startswith("cuda")):
        return None
    index = torch.device(device if device != "auto" else "cuda").index or 0
    free, _ = torch.cuda.mem_get_info(index)
    return int(free)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str, option: str) -> int:
    """Bytes of a size as a user writes it (`8GiB`, `500MB`, `1.5g`, `4096`), refused in one sentence naming
    `option` if it is not one."""
    number = text.strip().rstrip("BbIiGgMmKkTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        value = -1.0
    if value <= 0:
        raise KvprofError(f"{option} {text!r} is not a size; pass e.g. {option} 8GiB (or 500MB, or bytes).")
    return int(value)
