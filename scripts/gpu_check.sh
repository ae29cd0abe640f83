#!/usr/bin/env bash
# GPU check of kvprof's Triton kernels, for one machine with a CUDA GPU (targets are set for an H200).
#
#   scripts/gpu_check.sh OUT_DIR
#
# 1. the GPU tests (`pytest -m gpu`: every shipped kernel configuration against the torch reference, the registered
#    transformers attention through the kernel, the chunk-after-cache attention path, the do_bench timer);
# 2. `kvprof bench` at Llama-3.1-8B attention shapes (H_q 32, H_kv 8, D 128), r = 16, bfloat16, L up to 32k;
# 3. `kvprof replay` of the demo trace with the CUDA defaults (dtype auto = bfloat16, Flash-LoRA-Attention through
#    the Triton kernel): every policy, on the shared-A adapters so BaseLRShared runs too;
# 4. scripts/react_bench.sh at full scale (PReCache's 17.3k-token ReAct shape) on CUDA: measured TTFT speed-ups
#    against the ones the prefill-phase FLOPs allow;
# 5. the H200 targets, read from the benchmark's JSON:
#      prefill (causal, Lq = Lk = 32768): Flash-LoRA throughput ≥ 85 % of plain SDPA (t_sdpa / t_flash ≥ 0.85)
#      decode  (Lq = 1, Lk = 32768):      Flash-LoRA ≥ 1.5× faster than naive expansion (t_naive / t_flash ≥ 1.5)
# Everything is written under OUT_DIR; the exit status is non-zero when a step failed or a target was missed.
# Expected run time: well under 5 minutes (most of it is Triton compiling the shipped configurations once).
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
out="$(mkdir -p "$1" && cd "$1" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

python - > "$out/environment.txt" 2>&1 <<'EOF'
import platform, torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "capability:", torch.cuda.get_device_capability(0))
EOF
cat "$out/environment.txt"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch; this check needs a GPU" >&2
    exit 2
fi

echo "== GPU tests"
python -m pytest tests -m gpu -q -rs --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kvprof bench"
python -c "from kvprof.cli import main; main()" bench --device cuda --dtype bfloat16 \
    --seq-lens 4096,16384,32768 --ranks 16 --modes prefill,decode --batch 1 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --lr-layout shared --out "$out/bench" 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kvprof replay (demo trace, CUDA defaults)"
world="kvprof/demo/assets"
python -c "from kvprof.cli import main; main()" replay --device cuda --repeats 3 --out "$out/replay" \
    --agent "plan=$world/adapters/shared_a/plan" --agent "act=$world/adapters/shared_a/act" \
    --agent "reflect=$world/adapters/shared_a/reflect" 2>&1 | tee "$out/replay.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== ReAct-shape replay (CUDA defaults)"
scripts/react_bench.sh "$out/react" 1 --device cuda 2>&1 | tee "$out/react.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== H200 targets"
python - "$out" <<'EOF' | tee "$out/targets.log"
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
sys.exit(0 if all(item["met"] for item in report) else 1)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "results in $out (exit status $status)"
exit $status
