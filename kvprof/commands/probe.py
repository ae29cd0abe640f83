"""One probe of a run's plan (`kvprof.planning.plan`): the same kvprof command on the model's first `layers`
decoder layers, in a process of its own, reporting what it held and how long it took.

    python -m kvprof.commands.probe LAYERS REPORT kvprof-arguments...

REPORT (JSON, written when the command ends, whether it succeeded or not): `layers`, `exit_code`, `seconds` (the
whole command, loading included), `peak_host_bytes` (VmHWM), `peak_device_bytes` (the CUDA allocator's peak, None
on CPU), `process_bytes` (resident as the model starts loading: interpreter and libraries), `weights_bytes` (the
cut base model's, None if it never loaded) and, where Linux lets VmHWM start again, `call_peak_host_bytes` and
`call_peak_device_bytes`: the peaks from each call's start to the next (`kvprof.profiling.CallPeaks`; the first
from the process's start, the last to its end), of which the peaks above are the largest.
"""

from __future__ import annotations

import sys
import time

from kvprof.fileio import write_json
from kvprof.model.first_layers import probe_layers
from kvprof.profiling import CALL_PEAKS, peak_device_bytes, peak_host_bytes


def run_probe(layers: int, report: str, arguments: list[str]) -> int:
    """Run `kvprof ARGUMENTS` on the first `layers` layers; write the report; the command's exit code."""
    from kvprof.cli import main

    started = time.perf_counter()
    code = 0
    peak_before = peak_host_bytes()  # VmHWM starts again when recording starts
    CALL_PEAKS.record()
    with probe_layers(layers) as probe:
        sys.argv = ["kvprof", *arguments]
        try:
            main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    peaks: dict[str, object] = {"peak_host_bytes": peak_host_bytes(), "peak_device_bytes": peak_device_bytes()}
    host, device = CALL_PEAKS.finish()
    if host is not None:
        host[0] = max(host[0], peak_before)
        peaks |= {"peak_host_bytes": max(host), "call_peak_host_bytes": host}
    known = [peak for peak in device if peak is not None]
    if known:  # the allocator's statistics restart at each turn (`CudaPeak`): the largest call's is the peak
        peaks |= {"peak_device_bytes": max(known), "call_peak_device_bytes": device}
    write_json(
        report,
        {
            "layers": layers,
            "exit_code": code,
            "seconds": time.perf_counter() - started,
            **peaks,
            "process_bytes": probe.process_bytes or 0,
            "weights_bytes": probe.weights_bytes,
        },
    )
    return code


if __name__ == "__main__":
    sys.exit(run_probe(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
