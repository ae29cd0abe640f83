"""Ahead-of-time compiles of every shipped kernel configuration for sm_90 (H100/H200), without a GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` runs the whole NVIDIA pipeline down to a cubin
(ptxas included), which catches what the interpreter cannot: invalid `tl.dot` shapes (a 16-bit dot needs K ≥ 16),
layout or type errors, and tiles whose shared memory exceeds what one block may use on sm_90. The configurations
come from the launchers' own tables, so a new shipped configuration is compiled here automatically. Compiles run
in two spawned processes (TRITON_INTERPRET forced off there) because each takes seconds.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

SM90_MAX_SHARED_BYTES = 227 * 1024
TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def shipped_configurations() -> list[dict]:
    """Every (kernel, dtype, head_dim, padded rank, tiles, launch options) the launchers can pick."""
    from kvprof.kernels.attention_triton import ATTENTION_CONFIGS, COMBINE_BLOCK_M, COMBINE_NUM_WARPS, RANK_PADS
    from kvprof.kernels.correction_triton import CORRECTION_CONFIGS, RANK_CHUNK

    configurations = []
    for (dtype, head_dim, regime), config in ATTENTION_CONFIGS.items():
        for rank_pad in RANK_PADS:
            configurations.append(
                dict(
                    kernel="flash_lora_attention_fwd",
                    dtype=dtype,
                    regime=regime,
                    constexprs=dict(
                        HEAD_DIM=head_dim, RANK_PAD=rank_pad, BLOCK_M=config.block_m, BLOCK_N=config.block_n
                    ),
                    options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
                )
            )
    for dtype in TRITON_TYPES:
        for head_dim in sorted({key[1] for key in ATTENTION_CONFIGS}):
            configurations.append(
                dict(
                    kernel="combine_splits",
                    dtype=dtype,
                    regime="split-KV",
                    constexprs=dict(HEAD_DIM=head_dim, BLOCK_M=COMBINE_BLOCK_M),
                    options=dict(num_warps=COMBINE_NUM_WARPS),
                )
            )
    for (dtype, head_dim), config in CORRECTION_CONFIGS.items():
        configurations.append(
            dict(
                kernel="low_rank_correction_fwd",
                dtype=dtype,
                regime="correction",
                constexprs=dict(HEAD_DIM=head_dim, BLOCK_L=config.block_l, RANK_CHUNK=RANK_CHUNK),
                options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
            )
        )
    return configurations


def _signature(fn, dtype: str, constexprs: dict) -> dict:
    """Argument types as the launchers pass them: data in `dtype`, float32 partials and weights, uint8 masks."""
    data = f"*{TRITON_TYPES[dtype]}"
    float32_pointers = {"part_acc_ptr", "part_lr_ptr", "part_max_ptr", "part_sum_ptr", "w_ptr"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "mask_ptr":
            signature[name] = "*u8"
        elif name in float32_pointers:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = data
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def _compile(configuration: dict) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    from kvprof.kernels import attention_triton, correction_triton

    module = correction_triton if configuration["kernel"] == "low_rank_correction_fwd" else attention_triton
    fn = getattr(module, configuration["kernel"])
    constexprs = {**configuration["constexprs"], "INTERPRETING": False}
    if "PRECISION" in fn.arg_names:
        constexprs["PRECISION"] = attention_triton.dot_precision(getattr(torch, configuration["dtype"]))
    try:
        compiled = triton.compile(
            triton.compiler.ASTSource(
                fn=fn, signature=_signature(fn, configuration["dtype"], constexprs), constexprs=constexprs
            ),
            target=GPUTarget("cuda", 90, 32),
            options={**configuration["options"], "enable_fp_fusion": True},
        )
    except Exception as err:  # any compiler failure is this test's finding, reported per configuration
        return {"error": f"{type(err).__name__}: {err}"[-3000:]}
    return {
        "error": None,
        "shared": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "0"


CONFIGURATIONS = shipped_configurations()


def _config_id(configuration: dict) -> str:
    shape = ",".join(f"{key}={value}" for key, value in configuration["constexprs"].items())
    return f"{configuration['kernel']}-{configuration['dtype']}-{configuration['regime']}-{shape}"


@pytest.fixture(scope="module")
def compiled_configurations() -> dict:
    with ProcessPoolExecutor(
        max_workers=2, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
    ) as pool:
        return dict(zip(map(_config_id, CONFIGURATIONS), pool.map(_compile, CONFIGURATIONS)))


def test_every_launcher_configuration_is_listed():
    kernels = {configuration["kernel"] for configuration in CONFIGURATIONS}
    assert kernels == {"flash_lora_attention_fwd", "combine_splits", "low_rank_correction_fwd"}
    assert len(CONFIGURATIONS) == (2 * 3 * 2 + 3) * 3 + 3 * 3 + 3 * 3


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=_config_id)
def test_compiles_for_sm90(compiled_configurations, configuration):
    result = compiled_configurations[_config_id(configuration)]
    assert result["error"] is None, result["error"]
    assert result["cubin_bytes"] > 0
    assert result["num_warps"] == configuration["options"]["num_warps"]
    assert result["shared"] <= SM90_MAX_SHARED_BYTES, f"{result['shared']} bytes of shared memory per block"
