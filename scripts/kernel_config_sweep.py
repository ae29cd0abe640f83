"""Time candidate tiles of Flash-LoRA-Attention on a CUDA GPU, to choose `ATTENTION_CONFIGS` from measurements.

    python scripts/kernel_config_sweep.py OUT_DIR [--budget-s 240]

Three launches at Llama-3.1-8B attention shapes (H_q 32, H_kv 8, D 128, r 16, bfloat16): a causal prefill of 32k
tokens (mask-free), a 2k chunk over 32k keys with a bottom-right causal mask (the masked path) and a decode step over
32k keys (split-KV; the split count is swept too). Each candidate is checked against the shipped tile's output before
it is timed (median of `triton.testing.do_bench`), a candidate that fails to compile or differs is reported as such,
and SDPA over V_base is timed beside them as the baseline. Prints one table per launch, fastest first, and writes
OUT_DIR/kernel_config_sweep.json after every launch; stops starting new candidates when the budget is spent.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvprof.kernels.attention import bottom_right_causal_mask
from kvprof.kernels.attention_triton import AttentionConfig, flash_lora_attention_triton, pick_config, rank_pad

H_Q, H_KV, D, R, L = 32, 8, 128, 16, 32768

PREFILL_TILES = [
    AttentionConfig(block_m, block_n, warps, stages)
    for block_m, block_n, warps in ((128, 64, 8), (128, 128, 8), (128, 32, 8), (128, 64, 4), (64, 64, 4), (64, 128, 4))
    for stages in (2, 3, 4)
]
MASKED_TILES = [
    AttentionConfig(block_m, block_n, warps, stages)
    for block_m, block_n, warps in ((64, 64, 8), (64, 64, 4), (128, 64, 8), (64, 32, 4), (128, 32, 8), (32, 64, 4))
    for stages in (2, 3)
]
DECODE_TILES = [
    AttentionConfig(16, block_n, warps, stages, min_rank_pad=32)
    for block_n, warps in ((64, 4), (128, 4), (128, 8), (256, 8), (32, 2))
    for stages in (2, 3)
]
DECODE_SPLITS = (None, 8, 16, 64)


def normal(generator: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator, device="cuda") * std).to(torch.bfloat16)


def sweep(name, inputs, tiles, splits_options, attn_mask, baseline_ms, deadline, rows):
    """Time every (tile, splits) candidate that compiles and matches the shipped tile's output; fastest first."""
    q, k, v_base, v_lr, lora_b = inputs
    reference = flash_lora_attention_triton(q, k, v_base, v_lr, lora_b, attn_mask=attn_mask)
    shipped = pick_config(q.dtype, D, rank_pad(R), attn_mask is not None, rows)
    results = []
    for tile in tiles:
        for splits in splits_options:
            if time.monotonic() > deadline:
                print(f"{name}: budget spent, {len(results)} candidates timed")
                return results
            row = {
                "tile": [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages],
                "splits": splits,
                "shipped": tile == shipped and splits is None,
            }
            try:

                def call(tile=tile, splits=splits):
                    return flash_lora_attention_triton(
                        q, k, v_base, v_lr, lora_b, attn_mask=attn_mask, config=tile, num_splits=splits
                    )

                error = (call().float() - reference.float()).abs().max().item()
                row["max_abs_diff_vs_shipped"] = error
                if error > 0.05:
                    row["status"] = "differs"
                else:
                    row["ms"] = do_bench(call, warmup=10, rep=40, return_mode="median")
                    row["t_sdpa/t"] = baseline_ms / row["ms"]
                    row["status"] = "ok"
            except Exception as err:  # noqa: BLE001 - a candidate that does not compile is a result, not a failure
                row["status"] = f"failed: {type(err).__name__}: {str(err)[:160]}"
            results.append(row)
            print(name, json.dumps(row), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    generator = torch.Generator(device="cuda").manual_seed(0)
    k, v_base = normal(generator, 1, H_KV, L, D), normal(generator, 1, H_KV, L, D)
    v_lr, lora_b = normal(generator, 1, L, R), normal(generator, H_KV, R, D, std=R**-0.5)
    report: dict[str, dict] = {"shape": {"H_q": H_Q, "H_kv": H_KV, "D": D, "r": R, "L": L, "dtype": "bfloat16"}}
    launches = [
        ("prefill 32768 causal", L, None, PREFILL_TILES, (None,)),
        (
            "chunk 2048 over 32768 masked",
            2048,
            bottom_right_causal_mask(2048, L, torch.device("cuda"))[None, None],
            MASKED_TILES,
            (None,),
        ),
        ("decode over 32768", 1, None, DECODE_TILES, DECODE_SPLITS),
    ]
    for name, q_len, mask, tiles, splits in launches:
        q = normal(generator, 1, H_Q, q_len, D)
        causal = mask is None and q_len > 1

        def sdpa(q=q, mask=mask, causal=causal):
            return F.scaled_dot_product_attention(q, k, v_base, attn_mask=mask, is_causal=causal, enable_gqa=True)

        baseline = do_bench(sdpa, warmup=10, rep=40, return_mode="median")
        rows = q_len * H_Q // H_KV
        results = sweep(name, (q, k, v_base, v_lr, lora_b), tiles, splits, mask, baseline, deadline, rows)
        timed = sorted((row for row in results if "ms" in row), key=lambda row: row["ms"])
        report[name] = {"sdpa_ms": baseline, "candidates": timed + [row for row in results if "ms" not in row]}
        print(f"\n{name}: SDPA {baseline:.3f} ms")
        for row in timed[:8]:
            marker = " (shipped)" if row["shipped"] else ""
            speed = f"{row['ms']:.3f} ms, t_sdpa/t {row['t_sdpa/t']:.2f}"
            print(f"  tile {row['tile']} splits {row['splits']}: {speed}{marker}")
        temporary = args.out / "kernel_config_sweep.json.tmp"
        temporary.write_text(json.dumps(report, indent=2) + "\n")
        temporary.replace(args.out / "kernel_config_sweep.json")
        del q


if __name__ == "__main__":
    main()
