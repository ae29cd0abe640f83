"""Ahead-of-time compiles of every shipped kernel configuration for sm_90a (H100/H200), without a GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` runs the whole NVIDIA pipeline down to a cubin
(ptxas included), which catches what the interpreter cannot: invalid `tl.dot` shapes (a 16-bit dot needs K ≥ 16),
layout or type errors, tiles whose shared memory exceeds what one block may use on sm_90, and register spills.

Each configuration is compiled exactly as it is launched: the launchers' own `KernelLaunch`es (built by
`attention_launches` / `correction_launch` from CPU tensors of representative shapes) go through Triton's own
argument binder for the CUDA backend, so the signature, pointer dtypes, compile-time constants and the 16-byte
divisibility and value-1 specializations are the ones a real launch gets. ptxas' `-v` report (which Triton
prints with `knobs.nvidia.dump_ptxas_log`) gives the registers and spill bytes per thread; a shipped mask-free
16-bit configuration (prefill or decode) that spills fails the test; `python tests/test_kernels_aot.py` prints the
table. Compiles run in two spawned processes (TRITON_INTERPRET forced off there) because each takes a second or more;
their results are kept in pytest's cache, keyed by everything they depend on (`compile_key`).
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

SM90_MAX_SHARED_BYTES = 227 * 1024
# The rank launched for each padded rank: 16 and 64 fill it (EVEN_R: no column mask); 24 is zero-padded to 32, by
# column masks in decode tiles and on the host (then EVEN_R) for prefill tiles.
RANK_FOR_PAD = {16: 16, 32: 24, 64: 64}
CORRECTION_RANK = 40  # two full chunks of 16 and a masked one of 8
DECODE_SPLITS = 8  # the combine compiles the same for every split count the heuristic picks


def shipped_configurations() -> list[dict]:
    """Every configuration the launchers can pick: attention (dtype, head_dim, padded rank, mask, row bucket),
    the split-KV combine (dtype, head_dim, padded split count) and the correction (dtype, head_dim)."""
    from kvprof.kernels.attention_triton import ATTENTION_CONFIGS
    from kvprof.kernels.correction_triton import CORRECTION_CONFIGS

    configurations = [
        dict(
            kernel="flash_lora_attention_fwd",
            dtype=dtype,
            head_dim=head_dim,
            rank=RANK_FOR_PAD[padded_rank],
            masked=masked,
            regime=bucket,
        )
        for dtype, head_dim, padded_rank, masked, bucket in ATTENTION_CONFIGS
    ]
    configurations += [
        dict(kernel="combine_splits", dtype=dtype, head_dim=head_dim, splits=DECODE_SPLITS)
        for dtype in ("float16", "bfloat16", "float32")
        for head_dim in sorted({key[1] for key in ATTENTION_CONFIGS})
    ]
    configurations += [
        dict(kernel="low_rank_correction_fwd", dtype=dtype, head_dim=head_dim, rank=CORRECTION_RANK)
        for dtype, head_dim in CORRECTION_CONFIGS
    ]
    return configurations


def _attention_launches(configuration: dict, splits: int | None):
    """The launches of one attention call on CPU tensors shaped like a real one: q a (B, Lq, H_q, D) memory view
    as transformers hands it over, a shared (B, Lk, r) LR cache, a (B, 1, Lq, Lk) boolean mask when masked."""
    import torch

    from kvprof.kernels.attention_triton import attention_launches

    dtype = getattr(torch, configuration["dtype"])
    head_dim, rank, kv_heads, group = configuration["head_dim"], configuration.get("rank", 16), 2, 4
    decode = configuration.get("regime") == "decode" or configuration["kernel"] == "combine_splits"
    q_len, kv_len = (1, 4096) if decode else (1000, 1000)
    q = torch.empty(1, q_len, kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)
    k = torch.empty(1, kv_heads, kv_len, head_dim, dtype=dtype)
    v_base = torch.empty_like(k)
    v_lr = torch.empty(1, kv_len, rank, dtype=dtype)
    lora_b = torch.empty(kv_heads, rank, head_dim, dtype=dtype)
    mask = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool) if configuration.get("masked") else None
    return attention_launches(q, k, v_base, v_lr, lora_b, attn_mask=mask, num_splits=splits)[1]


def _launch_of(configuration: dict):
    import torch

    if configuration["kernel"] == "flash_lora_attention_fwd":
        regime = configuration["regime"]
        return _attention_launches(configuration, DECODE_SPLITS if regime == "decode" else 1)[0]
    if configuration["kernel"] == "combine_splits":
        return _attention_launches(configuration, configuration["splits"])[1]
    from kvprof.kernels.correction_triton import correction_launch

    dtype = getattr(torch, configuration["dtype"])
    heads, length, anchors, head_dim, rank = 8, 1000, 4, configuration["head_dim"], configuration["rank"]
    c_src = torch.empty(heads, length, head_dim, dtype=dtype)
    u = torch.empty(anchors, heads, length, rank, dtype=dtype)
    v = torch.empty(anchors, heads, rank, head_dim, dtype=dtype)
    return correction_launch(c_src, u, v, torch.ones(anchors))[1]


def compile_launch(launch) -> dict:
    """Compile one `KernelLaunch` for sm_90a as `JITFunction.run` would (Triton's binder and argument packing),
    and read registers and spill bytes per thread from ptxas' `-v` report."""
    import contextlib
    import io

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {"debug": False, **launch.kwargs}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    report = log.getvalue()
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas -v report in the compile output: {report[-2000:]}")
    return {
        "signature": signature,
        "divisible_args": sorted(kernel.arg_names[path[0]] for path in attrs),
        "registers": int(registers.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
        "shared": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "options": {key: launch.kwargs[key] for key in ("num_warps", "num_stages") if key in launch.kwargs},
        "constexprs": {
            key: value for key, value in launch.kwargs.items() if key.isupper() and key not in ("INTERPRETING",)
        },
    }


def _compile(configuration: dict) -> dict:
    try:
        return {"error": None, **compile_launch(_launch_of(configuration))}
    except Exception as err:  # any compiler failure is this test's finding, reported per configuration
        return {"error": f"{type(err).__name__}: {err}"[-3000:]}


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "0"


CONFIGURATIONS = shipped_configurations()


def _config_id(configuration: dict) -> str:
    return "-".join(f"{key}={value}" for key, value in configuration.items())


def compile_all() -> dict:
    with ProcessPoolExecutor(
        max_workers=2, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
    ) as pool:
        return dict(zip(map(_config_id, CONFIGURATIONS), pool.map(_compile, CONFIGURATIONS)))


def register_table(results: dict) -> str:
    """Markdown table: one row per configuration, registers and spill bytes per thread, shared memory."""
    lines = [
        "| kernel | dtype | D | r | mask | rows | tile (M×N, warps, stages) | registers | spill st/ld B | smem KiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for configuration in CONFIGURATIONS:
        result = results[_config_id(configuration)]
        if result["error"]:
            lines.append(f"| {configuration['kernel']} | {configuration['dtype']} | compile error | | | | | | | |")
            continue
        constexprs, options = result["constexprs"], result["options"]
        if configuration["kernel"] == "flash_lora_attention_fwd":
            rank = f"{configuration['rank']}→{constexprs['RANK_PAD']}"
            if constexprs["RANK"] != configuration["rank"]:
                rank += " (host)"
            tile = f"{constexprs['BLOCK_M']}×{constexprs['BLOCK_N']}"
            mask, rows = "yes" if configuration["masked"] else "no", configuration["regime"]
        elif configuration["kernel"] == "combine_splits":
            rank, tile = "", f"{constexprs['BLOCK_M']} rows, {constexprs['SPLITS_PAD']} splits"
            mask, rows = "", "split-KV"
        else:
            rank, tile = str(configuration["rank"]), f"{constexprs['BLOCK_L']} rows"
            mask, rows = "", ""
        launch = ", ".join(str(options[key]) for key in ("num_warps", "num_stages") if key in options)
        lines.append(
            f"| {configuration['kernel']} | {configuration['dtype']} | {configuration['head_dim']} | {rank} | {mask} "
            f"| {rows} | {tile} ({launch}) | {result['registers']} | "
            f"{result['spill_stores']}/{result['spill_loads']} | {result['shared'] / 1024:.0f} |"
        )
    return "\n".join(lines)


def compile_key() -> str:
    """What the compiles depend on: Triton's version, the kernels' and the launchers' source, this file's shapes."""
    import hashlib
    from pathlib import Path

    import triton

    import kvprof.kernels

    digest = hashlib.sha256(triton.__version__.encode())
    for path in sorted(Path(kvprof.kernels.__file__).parent.glob("*.py")) + [Path(__file__)]:
        digest.update(path.read_bytes())
    return f"kvprof/sm90-compiles/{digest.hexdigest()[:24]}"


@pytest.fixture(scope="module")
def compiled_configurations(request) -> dict:
    """The compile of every configuration: from pytest's cache (.pytest_cache) when nothing it depends on has
    changed since a run that compiled them, else compiled now and cached."""
    key = compile_key()
    results = request.config.cache.get(key, None)
    if results is None or set(results) != set(map(_config_id, CONFIGURATIONS)):
        results = compile_all()
        request.config.cache.set(key, results)
    print("\n" + register_table(results))
    return results


def test_every_launcher_configuration_is_listed():
    kernels = {configuration["kernel"] for configuration in CONFIGURATIONS}
    assert kernels == {"flash_lora_attention_fwd", "combine_splits", "low_rank_correction_fwd"}
    attention = [c for c in CONFIGURATIONS if c["kernel"] == "flash_lora_attention_fwd"]
    assert len(attention) == (2 * 2 + 1) * 3 * 3 * 2  # (16-bit × 2 row buckets + float32) × D × r_pad × mask


@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=_config_id)
def test_compiles_for_sm90(compiled_configurations, configuration):
    result = compiled_configurations[_config_id(configuration)]
    assert result["error"] is None, result["error"]
    assert result["cubin_bytes"] > 0
    assert result["num_warps"] == result["options"]["num_warps"]
    assert result["shared"] <= SM90_MAX_SHARED_BYTES, f"{result['shared']} bytes of shared memory per block"


def test_compiled_as_launched(compiled_configurations):
    """The signature is the launcher's: float32 partials, uint8 mask, data pointers in the data dtype, the rank
    and the mask/causal flags as constants, and 16-byte divisibility where the real pointers and strides have it."""
    configuration = next(
        c
        for c in CONFIGURATIONS
        if c["kernel"] == "flash_lora_attention_fwd" and c["dtype"] == "bfloat16" and c["regime"] == "decode"
    )
    result = compiled_configurations[_config_id(configuration)]
    signature = result["signature"]
    assert signature["part_out_ptr"] == signature["part_max_ptr"] == "*fp32"
    assert signature["mask_ptr"] == "*u8" and signature["q_ptr"] == signature["v_lr_ptr"] == "*bf16"
    assert signature["RANK"] == signature["CAUSAL"] == signature["HAS_MASK"] == "constexpr"
    assert {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "stride_kh", "stride_kn"} <= set(result["divisible_args"])


@pytest.mark.parametrize(
    "configuration",
    [
        c
        for c in CONFIGURATIONS
        if c["kernel"] == "flash_lora_attention_fwd" and not c["masked"] and c["dtype"] != "float32"
    ],
    ids=_config_id,
)
def test_mask_free_attention_does_not_spill(compiled_configurations, configuration):
    """Mask-free 16-bit attention (prefill and decode tiles) keeps its state in registers. Float32 inputs (3xTF32
    dots, three times the operand registers) are the correctness path: their spills are in the table only."""
    result = compiled_configurations[_config_id(configuration)]
    assert result["error"] is None, result["error"]
    assert result["spill_stores"] == result["spill_loads"] == 0, register_table({_config_id(configuration): result})


if __name__ == "__main__":
    print(register_table(compile_all()))
