#!/usr/bin/env bash
# Stage 3 of issue 25 on the H200 (docs/training.md section 5): GRPO of the stage-1 CoLaR model
# models/smollm2-mult-colar (written by scripts/stage1_gpu.sh) on 5x5 multiplication, rollouts
# through our engine, then the full 4x4 and 5x5 test sets at c = 4 before and after.
# Device calls, back to back (transfer as scripts/gpu_xfer.sh says; `bash $0 pack` here first):
#   run "bash scripts/stage3_gpu.sh take"    carry [".xfer/p1"]   (then p2 .. p7 likewise)
#   run "bash scripts/stage3_gpu.sh start"   carry [".xfer/p8"]   (GRPO in the background,
#                                                                  returns after T_WAIT s)
#   run "bash scripts/stage3_gpu.sh finish"                       (waits, evaluates, packs $OUT)
# Knobs (env): MODEL (models/smollm2-mult-colar), T_GRPO (seconds, 600), LR (1e-6, upstream),
# LENGTH_PENALTY (0), T_WAIT (500).
set -uo pipefail
cd "$(dirname "$0")/.."
X=/tmp/x; W=/tmp/stage3; mkdir -p "$X" "$W" "${OUT:=out}"
export PYTHONPATH="$PWD/src:/tmp/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf LATENTSERVE_DATA="$X/data"
ls="python3 -m latentserve.cli"
. scripts/gpu_xfer.sh
MODEL="${MODEL:-models/smollm2-mult-colar}"; D="$X/data/multiplication"

case "${1:-}" in
pack) xfer_pack ;;
take) xfer_take ;;
start)
  xfer_start || exit 1
  $ls data multiplication --k 5 --n 100000 --seed 1 --out "$W/5x5_train.txt"
  setsid nohup $ls train colar-grpo --model "$MODEL" --data "$W/5x5_train.txt" \
    --out "$W/colar_grpo" --device cuda --dtype bfloat16 --steps 100000 \
    --max-seconds "${T_GRPO:-600}" --lr "${LR:-1e-6}" --compression-factor 4 \
    --length-penalty "${LENGTH_PENALTY:-0}" --save-every 20 --answer-tokens 40 \
    > "$W/grpo.log" 2>&1 < /dev/null &
  sleep "${T_WAIT:-500}"; tail -n 5 "$W/grpo.log"
  [ -d "$W/colar_grpo" ] && tar czf "$OUT/colar_grpo.tgz" -C "$W" colar_grpo grpo.log
  ;;
finish)
  while pgrep -f "latentserve.cli train" > /dev/null; do sleep 5; done
  tail -n 5 "$W/grpo.log"
  tar czf "$OUT/colar_grpo.tgz" -C "$W" colar_grpo grpo.log
  for m in "$MODEL" "$W/colar_grpo"; do
    for s in 5x5 4x4; do
      $ls eval --device cuda --dtype bfloat16 --model "$m" --dataset-file "$D/${s}_test.txt" \
        --max-tokens 40 --compression-factor 4 --json-out "$W/eval_$(basename "$m")_${s}.json" \
        2>&1 | grep --line-buffered -v "Loading\|Converting"
      tar czf "$OUT/stage3_eval.tgz" -C "$W" --exclude=colar_grpo --exclude='*.txt' .
    done
  done
  ;;
*) echo "usage: $0 pack|take|start|finish" >&2; exit 2 ;;
esac
