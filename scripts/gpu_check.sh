#!/usr/bin/env bash
# GPU check of kvprof's Triton kernels, for one machine with a CUDA GPU (targets are set for an H200): what first
# contact with hardware shows and neither the interpreter nor the ahead-of-time compile can.
#
#   scripts/gpu_check.sh OUT_DIR
#
# 1. environment: versions, device, SDPA backends enabled, compute-sanitizer found or not;
# 2. the GPU tests (`pytest -m gpu`, in GPU_TEST_WORKERS processes, default 8, so Triton compiles on several cores):
#    every shipped kernel configuration against the torch reference; registers and spills of the launched kernels
#    (printed; mask-free prefill and decode must not spill); a bfloat16 tiny Llama with peft adapters through the
#    registered attention at head dims 64 and 128; a 2k chunk over 32k keys with transformers' mask against the
#    reference and against the mask-free path; 32k prefill and decode at ragged lengths (32767, 32769) against a
#    per-row float32 reference; masks with split-KV and fully masked rows; offsets past 2³¹ elements; a decode step
#    captured in a CUDA graph; the do_bench timer;
# 3. kernel timings at Llama-3.1-8B attention shapes (H_q 32, H_kv 8, D 128, r 16, bfloat16): prefill 32k, a 2k
#    chunk over 32k (mask-free and masked), decode over 32k with the main kernel and the split-KV combine timed
#    apart; host µs per call (launch planning, enqueue, CUDA-graph replay); the SDPA kernels that actually ran, and
#    SDPA with cuDNN forced as a second baseline;
# 4. `compute-sanitizer --tool memcheck` on two small ragged cases (a masked chunk, a split-KV decode);
# 5. `kvprof bench` at the same shapes, L up to 32k;
# 6. the H200 targets, read from the benchmark's JSON:
#      prefill (causal, Lq = Lk = 32768): Flash-LoRA throughput ≥ 85 % of plain SDPA (t_sdpa / t_flash ≥ 0.85)
#      decode  (Lq = 1, Lk = 32768):      Flash-LoRA ≥ 1.5× faster than naive expansion (t_naive / t_flash ≥ 1.5)
#    and, reported beside them, the decode ratio to SDPA;
# 7. `kvprof replay` of the demo trace with the CUDA defaults (every policy, shared-A adapters so BaseLRShared runs);
# 8. scripts/react_bench.sh at full scale (PReCache's 17.3k-token ReAct shape) on CUDA.
# Every number is printed and written under OUT_DIR. Each step has a time limit and the whole check a budget
# (CHECK_BUDGET_S, default 540 s; on an H200 steps 1-6 took 110 s, the ReAct replay under 45 s and the demo replay
# more than 90 s); the exit status is non-zero when a step failed, timed out or was skipped for lack of time, or a
# target was missed, and the last lines name the failed steps.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
out="$(mkdir -p "$1" && cd "$1" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
status=0
failed=()
check_started=$(date +%s)

# run_step NAME LOG LIMIT_S COMMAND...: run COMMAND with a time limit (LIMIT_S, cut to what is left of the whole
# check's budget, CHECK_BUDGET_S, default 540 s), output to the terminal and OUT_DIR/LOG. A step that fails, times out
# or finds no budget left counts as failed.
budget="${CHECK_BUDGET_S:-540}"
run_step() {
    local name="$1" log="$2" limit="$3"
    shift 3
    local left=$(( budget - ($(date +%s) - check_started) ))
    echo
    if [ "$left" -lt 15 ]; then
        echo "== $name: SKIPPED, ${left} s left of the ${budget} s budget"
        status=1
        failed+=("$name (skipped: no time left)")
        return
    fi
    [ "$left" -lt "$limit" ] && limit="$left"
    echo "== $name (limit ${limit} s)"
    local started rc
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$log"
    rc=${PIPESTATUS[0]}
    echo "-- $name: exit $rc after $(( $(date +%s) - started )) s"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "-- $name: TIMED OUT"
    fi
    if [ "$rc" -ne 0 ]; then
        status=1
        failed+=("$name")
    fi
}

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)"

python - "$sanitizer" > "$out/environment.txt" 2>&1 <<'EOF'
import platform, sys
import torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton",
      triton.__version__, "transformers", transformers.__version__)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "capability:", torch.cuda.get_device_capability(0),
          "SMs:", torch.cuda.get_device_properties(0).multi_processor_count, "devices:", torch.cuda.device_count())
    print("SDPA enabled: flash", torch.backends.cuda.flash_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled(),
          "mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled(), "math", torch.backends.cuda.math_sdp_enabled(),
          "| cudnn version", torch.backends.cudnn.version())
print("compute-sanitizer:", sys.argv[1] or "not found")
EOF
cat "$out/environment.txt"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch; this check needs a GPU" >&2
    exit 2
fi

run_step "GPU tests" gpu_tests.log 300 \
    python -m pytest tests -m gpu -q -rsP -n "${GPU_TEST_WORKERS:-8}" --junitxml "$out/gpu_tests.xml"

cat > "$out/kernel_timings.py" <<'EOF'
"""Kernel timings at Llama-3.1-8B attention shapes; medians of triton.testing.do_bench (L2 flushed per run)."""
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kvprof.kernels.attention import bottom_right_causal_mask, naive_lora_attention, plain_attention
from kvprof.kernels.attention_triton import attention_launches, flash_lora_attention_triton, on_device

out = Path(sys.argv[1])
device = torch.device("cuda")
generator = torch.Generator(device="cuda").manual_seed(0)
H_Q, H_KV, D, R, L = 32, 8, 128, 16, 32768
results = {}


def normal(*shape, std=1.0):
    return (torch.randn(*shape, generator=generator, device=device) * std).to(torch.bfloat16)


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def cuda_kernels(fn):
    """Names of the CUDA kernels one call launches: which SDPA backend actually ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sorted({event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA})


def cudnn_sdpa(q, k, v, **kwargs):
    """SDPA with cuDNN forced (GQA natively when cuDNN takes it, else with the KV heads repeated: noted)."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            return ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)), "gqa"
        except RuntimeError:
            k, v = k.repeat_interleave(H_Q // H_KV, 1), v.repeat_interleave(H_Q // H_KV, 1)
            return ms(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)), "kv repeated"


def timed(name, row):
    results[name] = row
    print(name, json.dumps(row, default=str), flush=True)


k, v_base, v_lr, lora_b = normal(1, H_KV, L, D), normal(1, H_KV, L, D), normal(1, L, R), normal(H_KV, R, D, std=R**-0.5)

q = normal(1, H_Q, L, D)
flash = ms(lambda: flash_lora_attention_triton(q, k, v_base, v_lr, lora_b))
sdpa = ms(lambda: F.scaled_dot_product_attention(q, k, v_base, is_causal=True, enable_gqa=True))
try:
    cudnn, cudnn_layout = cudnn_sdpa(q, k, v_base, is_causal=True)
except RuntimeError as err:
    cudnn, cudnn_layout = None, f"unavailable: {err}"[:200]
timed("prefill L=32768", {
    "flash_lora_ms": flash, "sdpa_ms": sdpa, "naive_ms": ms(lambda: naive_lora_attention(q, k, v_base, v_lr, lora_b)),
    "sdpa_cudnn_ms": cudnn, "cudnn_layout": cudnn_layout, "t_sdpa/t_flash": sdpa / flash,
    "t_cudnn/t_flash": cudnn / flash if cudnn else None,
    "sdpa_kernels": cuda_kernels(lambda: F.scaled_dot_product_attention(q, k, v_base, is_causal=True, enable_gqa=True)),
})
del q

q = normal(1, H_Q, 2048, D)
mask = bottom_right_causal_mask(2048, L, device)[None, None]
mask_free = ms(lambda: flash_lora_attention_triton(q, k, v_base, v_lr, lora_b))
masked = ms(lambda: flash_lora_attention_triton(q, k, v_base, v_lr, lora_b, attn_mask=mask))
sdpa = ms(lambda: plain_attention(q, k, v_base))
timed("chunk 2048 over 32768", {
    "flash_lora_mask_free_ms": mask_free, "flash_lora_masked_ms": masked, "sdpa_masked_ms": sdpa,
    "t_masked/t_mask_free": masked / mask_free, "t_sdpa/t_flash_mask_free": sdpa / mask_free,
    "sdpa_kernels": cuda_kernels(lambda: plain_attention(q, k, v_base)),
})
del q, mask

q = normal(1, H_Q, 1, D)
_, launches = attention_launches(q, k, v_base, v_lr, lora_b)
with on_device(device):
    main = ms(launches[0].run)
    combine = ms(launches[1].run) if len(launches) > 1 else None
flash = ms(lambda: flash_lora_attention_triton(q, k, v_base, v_lr, lora_b))
naive = ms(lambda: naive_lora_attention(q, k, v_base, v_lr, lora_b))
sdpa = ms(lambda: plain_attention(q, k, v_base))
try:
    cudnn, cudnn_layout = cudnn_sdpa(q, k, v_base)
except RuntimeError as err:
    cudnn, cudnn_layout = None, f"unavailable: {err}"[:200]
calls = 200
torch.cuda.synchronize()
started = time.perf_counter()
for _ in range(calls):
    attention_launches(q, k, v_base, v_lr, lora_b)
plan_us = (time.perf_counter() - started) / calls * 1e6
torch.cuda.synchronize()
started = time.perf_counter()
for _ in range(calls):
    flash_lora_attention_triton(q, k, v_base, v_lr, lora_b)
enqueue_us = (time.perf_counter() - started) / calls * 1e6
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    flash_lora_attention_triton(q, k, v_base, v_lr, lora_b)
graph.replay()
torch.cuda.synchronize()
started = time.perf_counter()
for _ in range(calls):
    graph.replay()
torch.cuda.synchronize()
graph_us = (time.perf_counter() - started) / calls * 1e6
timed("decode Lk=32768", {
    "splits": launches[0].grid[2], "main_kernel_ms": main, "combine_ms": combine, "flash_lora_ms": flash,
    "naive_ms": naive, "sdpa_ms": sdpa, "sdpa_cudnn_ms": cudnn, "cudnn_layout": cudnn_layout,
    "t_naive/t_flash": naive / flash, "t_sdpa/t_flash": sdpa / flash,
    "host_plan_us_per_call": plan_us, "host_enqueue_us_per_call": enqueue_us, "graph_replay_us_per_call": graph_us,
    "sdpa_kernels": cuda_kernels(lambda: plain_attention(q, k, v_base)),
})
(out / "kernel_timings.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
EOF
run_step "kernel timings" kernel_timings.log 120 python "$out/kernel_timings.py" "$out"

cat > "$out/memcheck_cases.py" <<'EOF'
"""Two small ragged cases for compute-sanitizer memcheck: a masked chunk (77 over 1001 keys, rank 24 padded to 32,
one fully masked row) and a split-KV decode (1 over 1001 keys, 5 splits), each checked against the reference."""
import torch

from kvprof.kernels.attention import flash_lora_attention_ref
from kvprof.kernels.attention_triton import flash_lora_attention_triton

generator = torch.Generator(device="cuda").manual_seed(0)


def normal(*shape):
    return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16)


for q_len, splits, masked in ((77, None, True), (1, 5, False)):
    q, k, v = normal(2, 8, q_len, 128), normal(2, 2, 1001, 128), normal(2, 2, 1001, 128)
    v_lr, lora_b = normal(2, 1001, 24), normal(2, 24, 128) / 5
    mask = None
    if masked:
        mask = torch.rand(2, 1, q_len, 1001, generator=generator, device="cuda") > 0.5
        mask[1, 0, 3] = False
    out = flash_lora_attention_triton(q, k, v, v_lr, lora_b, attn_mask=mask, num_splits=splits)
    torch.cuda.synchronize()
    error = (out.float() - flash_lora_attention_ref(q, k, v, v_lr, lora_b, attn_mask=mask).float()).abs().max().item()
    print(f"Lq={q_len} Lk=1001 splits={splits} mask={masked}: max |out - ref| = {error:.4f}")
    assert error < 0.1, error
EOF
if [ -n "$sanitizer" ]; then
    # Compile outside the sanitizer first (Triton's cache), then run every case under memcheck; with PyTorch's caching
    # allocator off, an access past a tensor is past an allocation.
    run_step "memcheck warm-up" memcheck_warmup.log 60 python "$out/memcheck_cases.py"
    run_step "compute-sanitizer memcheck" memcheck.log 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 python "$out/memcheck_cases.py"
else
    echo
    echo "== compute-sanitizer memcheck: NOT RUN (compute-sanitizer not found on PATH or under /usr/local/cuda*)"
fi

run_step "kvprof bench" bench.log 120 \
    python -c "from kvprof.cli import main; main()" bench --device cuda --dtype bfloat16 \
    --seq-lens 4096,16384,32768 --ranks 16 --modes prefill,decode --batch 1 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --lr-layout shared --out "$out/bench"

cat > "$out/targets.py" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
bench = out / "bench" / "bench.json"
if not bench.exists():
    print(f"no {bench}: the benchmark did not finish")
    sys.exit(1)
rows = json.loads(bench.read_text())["results"]


def flash_row(mode):
    return next(row for row in rows if row["mode"] == mode and row["seq_len"] == 32768 and row["rank"] == 16
                and row["method"] == "flash_lora")


targets = [
    ("prefill L=32768 r=16: t_sdpa / t_flash_lora", flash_row("prefill")["throughput_vs_sdpa"], 0.85),
    ("decode L=32768 r=16: t_naive / t_flash_lora", flash_row("decode")["speedup_vs_naive"], 1.5),
]
report = [{"target": name, "measured": round(value, 3), "required": need, "met": value >= need}
          for name, value, need in targets]
(out / "targets.json").write_text(json.dumps(report, indent=2) + "\n")
for item in report:
    verdict = "MET   " if item["met"] else "MISSED"
    print(f"{verdict} {item['target']} = {item['measured']} (need ≥ {item['required']})")
print(f"(reported) decode L=32768 r=16: t_sdpa / t_flash_lora = {flash_row('decode')['throughput_vs_sdpa']:.3f}")
sys.exit(0 if all(item["met"] for item in report) else 1)
EOF
run_step "H200 targets" targets.log 30 python "$out/targets.py" "$out"

world="kvprof/demo/assets"
run_step "kvprof replay (demo trace, CUDA defaults)" replay.log 180 \
    python -c "from kvprof.cli import main; main()" replay --device cuda --repeats 3 --out "$out/replay" \
    --agent "plan=$world/adapters/shared_a/plan" --agent "act=$world/adapters/shared_a/act" \
    --agent "reflect=$world/adapters/shared_a/reflect"

run_step "ReAct-shape replay (CUDA defaults)" react.log 120 scripts/react_bench.sh "$out/react" 1 --device cuda

# An 8B model's shape (random weights, bfloat16) on long shape traces: each replay and fit-anchors after its plan
# (planned against measured peak and time), and the replay again with its stores held within a quarter of the
# planned stored peak (--kv-budget: same numbers, moved to host memory).
run_step "scaling, Llama-3.1-8B shape (bf16): plan against run, --kv-budget" scale.log 420 \
    python scripts/scale_bench.py "$out/scale" --shape llama-3.1-8b --tokens 8192,32768 --device cuda \
    --dtype bfloat16 --kv-budget-share 0.25

echo
echo "results in $out after $(( $(date +%s) - check_started )) s (exit status $status)"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failed[@]}"
fi
exit $status
