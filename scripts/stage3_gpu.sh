#!/usr/bin/env bash
# Stage 3 of issue 25 on the H200 (docs/training.md section 5): GRPO of the stage-1 CoLaR model
# models/smollm2-mult-colar on 5x5 multiplication, rollouts through our engine, then the full
# 4x4 and 5x5 test sets before and after, at the speed it was trained at.
# Device calls, back to back (transfer as scripts/gpu_xfer.sh says; `bash $0 pack` here first):
#   run "bash scripts/stage3_gpu.sh take"    carry [".xfer/p1"]   (then p2 .. p7 likewise)
#   run "bash scripts/stage3_gpu.sh start"   carry [".xfer/p8"]   (GRPO in the background,
#                                                                  returns after T_WAIT s)
#   run "bash scripts/stage3_gpu.sh finish"                       (waits, evaluates, packs $OUT)
# `grpo NAME LR [C [K [ARG...]]]` runs one GRPO (speed C, KxK items, more train colar-grpo
# options) in the foreground into $W/NAME;
# `eval C NAME...` evaluates models/smollm2-mult-colar and $W/NAME... (scripts/stage23_gpu.sh
# runs stages 2 and 3 side by side on one GPU with these).
# Knobs (env): MODEL (models/smollm2-mult-colar), C (speed, 2), T_GRPO (seconds, 600), LR
# (1e-6, upstream), LENGTH_PENALTY (0.5), EXP_BATCH (rollouts per update, 8; 64 = one on-policy update a step), MAX_LATENT (rollout cap, 96), KV_SLOTS (the engine's
# KV pool in tokens; unset: from memory), T_WAIT (500).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_xfer.sh
xfer_env; W="${W:-/tmp/stage3}"; mkdir -p "$W"
MODEL="${MODEL:-models/smollm2-mult-colar}"; D="$X/data/multiplication"; C="${C:-2}"
KV=(); [ -n "${KV_SLOTS:-}" ] && KV=(--kv-slots "$KV_SLOTS")

grpo() {  # grpo NAME LR [C [K [ARG...]]]: one GRPO run at speed C on KxK items into $W/NAME
  local name="$1" lr="$2" c="${3:-$C}" k="${4:-5}"; shift $(($# < 4 ? $# : 4))
  [ -f "$W/${k}x${k}_train.txt" ] || $ls data multiplication --k "$k" --n 100000 --seed 1 \
    --out "$W/${k}x${k}_train.txt"
  $ls train colar-grpo --model "$MODEL" --data "$W/${k}x${k}_train.txt" --out "$W/$name" \
    --device cuda --dtype bfloat16 --steps 100000 --max-seconds "${T_GRPO:-600}" --lr "$lr" \
    --compression-factor "$c" --max-latent "${MAX_LATENT:-96}" "${KV[@]}" \
    --length-penalty "${LENGTH_PENALTY:-0.5}" --save-every 20 --answer-tokens 40 \
    --exp-batch-size "${EXP_BATCH:-8}" "$@" \
    > "$W/$name.log" 2>&1
}

evaluate() {  # evaluate C NAME...: the stage-1 model and each $W/NAME on both test sets
  local c="$1" m s; shift
  for m in "$MODEL" "${@/#/$W/}"; do
    for s in 5x5 4x4; do
      $ls eval --device cuda --dtype bfloat16 --model "$m" --dataset-file "$D/${s}_test.txt" \
        --max-tokens 40 --compression-factor "$c" --max-num-seqs 256 "${KV[@]}" \
        --json-out "$W/eval_$(basename "$m")_${s}_c$c.json" 2>&1 | grep -v "Loading\|Converting"
    done
  done
}

case "${1:-}" in
pack) xfer_pack ;;
take) xfer_take ;;
grpo) shift; grpo "$@" ;;
eval) shift; evaluate "$@" ;;
start)
  xfer_start || exit 1
  setsid nohup bash "$0" grpo colar_grpo "${LR:-1e-6}" > /dev/null 2>&1 < /dev/null &
  sleep "${T_WAIT:-500}"; tail -n 5 "$W/colar_grpo.log"
  [ -d "$W/colar_grpo" ] && tar czf "$OUT/colar_grpo.tgz" -C "$W" colar_grpo colar_grpo.log
  ;;
finish)
  while pgrep -f "latentserve.cli train" > /dev/null; do sleep 5; done
  tail -n 5 "$W/colar_grpo.log"
  tar czf "$OUT/colar_grpo.tgz" -C "$W" colar_grpo colar_grpo.log
  evaluate "$C" colar_grpo
  tar czf "$OUT/stage3_eval.tgz" -C "$W" --exclude=colar_grpo --exclude='*.txt' .
  ;;
*) echo "usage: $0 pack|take|grpo NAME LR [C [K [ARG...]]]|eval C NAME...|start|finish" >&2; exit 2 ;;
esac
