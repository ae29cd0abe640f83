#!/usr/bin/env bash
# Replay the PReCache ReAct trajectory shape on the shipped demo model under every policy (the low-rank ones with
# both `views`), and print how much of the TTFT speed-up each policy's prefill-phase FLOPs allow the replay actually
# measures (the "FLOP ×" and "eff." columns of `kvprof replay`). The shape, in agent turns (new input tokens +
# output tokens):
#   plan 512+32, then 4 × [plan 4096+32, plan 8+8, act 8+8], then reflect 32+32 and reflect 8+8  (17.3k tokens)
#
#   scripts/react_bench.sh OUT_DIR [SCALE] [extra kvprof replay options...]
#
# Extra options with a --policy replace the default selection (every policy, the low-rank ones with both views), e.g.
# every policy at its defaults: --policy nonshared --policy fullshared ... --policy rebaseshared
# --policy-option rebaseshared.schedule=lp --policy-option rebaseshared.schedule=db --policy cacheblend ...
# SCALE (default 1) divides the long prefills (512 and 4096) so a CPU run stays short (SCALE 8: ~2.3k tokens).
# Tokens are synthesised deterministically (kvprof capture --shapes); the demo world's shared-A adapters are used,
# so BaseLRShared runs too: ADAPTERS=shared_a (default: LoRA on q, k, v and o) or ADAPTERS=shared_a_qv (on q and v
# only, PReCache's setting). On CUDA pass e.g. `--device cuda` (bfloat16 and the Triton kernel are its defaults;
# views=kept is then skipped: Flash-LoRA-Attention never materialises the values it would keep). PYTHON picks the
# interpreter (default: python).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: scripts/react_bench.sh OUT_DIR [SCALE] [kvprof replay options...]" >&2
    exit 2
fi
out="$(mkdir -p "$1" && cd "$1" && pwd)"
scale="${2:-1}"
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kvprof() { "${PYTHON:-python}" -c "from kvprof.cli import main; main()" "$@"; }

world="kvprof/demo/assets"
{
    echo "agent,prefill_len,decode_len"
    echo "plan,$(( 512 / scale )),32"
    for _ in 1 2 3 4; do
        echo "plan,$(( 4096 / scale )),32"
        echo "plan,8,8"
        echo "act,8,8"
    done
    echo "reflect,32,32"
    echo "reflect,8,8"
} > "$out/react_shape.csv"

adapters="$world/adapters/${ADAPTERS:-shared_a}"
if [ ! -d "$adapters" ]; then
    echo "ADAPTERS=${ADAPTERS} is not a shared-A adapter set of the demo world; use shared_a or shared_a_qv." >&2
    exit 2
fi
agents=(--agent "plan=$adapters/plan" --agent "act=$adapters/act" --agent "reflect=$adapters/reflect")
kvprof capture --model "$world/model" --shapes "$out/react_shape.csv" "${agents[@]}" --out "$out/capture"
# Unless the options pick policies: every policy, the low-rank ones with both views (re-expanded every turn, the
# default, and kept per agent); on CUDA only the per-turn one, as Flash-LoRA-Attention keeps no expanded values.
views=(per-turn kept)
chosen=false
previous=""
for option in "$@"; do
    if [ "$option" = "--policy" ]; then
        chosen=true
    elif [[ "$option" == --device=cuda* || ( "$previous" == --device && "$option" == cuda* ) ]]; then
        views=(per-turn)
    fi
    previous="$option"
done
selection=()
if ! $chosen; then
    selection=(--policy all)
    for policy in prelrshared baselrshared rebaseshared; do
        for view in "${views[@]}"; do
            selection+=(--policy-option "$policy.views=$view")
        done
    done
fi
kvprof replay "$out/capture/trace.jsonl" "${selection[@]}" --repeats 3 --out "$out/replay" "$@"
