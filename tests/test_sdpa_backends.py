"""On CUDA every replay forward runs SDPA without cuDNN's backend, which builds a plan for each new sequence length
(a decode step's worth of time that would land in whichever run met a length first); elsewhere the backends stay as
they are."""

from __future__ import annotations

import torch

from kvprof.model import runtime as runtime_module
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime, per_shape_free_sdpa


def sdpa_backends() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def test_cuda_leaves_out_cudnn_and_restores_the_backends():
    before = sdpa_backends()
    assert before["cudnn"], "torch's default enables cuDNN attention; this test needs it on to see it turned off"
    with per_shape_free_sdpa(torch.device("cuda")):
        assert sdpa_backends() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert sdpa_backends() == before


def test_cpu_leaves_the_backends_alone():
    before = sdpa_backends()
    with per_shape_free_sdpa(torch.device("cpu")):
        assert sdpa_backends() == before


def test_every_runtime_forward_runs_inside_it(lora_trace, monkeypatch):
    entered: list[torch.device] = []
    real = runtime_module.per_shape_free_sdpa

    def recording(device):
        entered.append(device)
        return real(device)

    monkeypatch.setattr(runtime_module, "per_shape_free_sdpa", recording)
    runtime = Runtime(load_agents_for_trace(lora_trace, device="cpu", dtype="float32"))
    runtime.forward(None, [1, 2, 3], runtime.cache_from(runtime.empty_kv(), spare=3), 0)
    assert entered == [runtime.device]
