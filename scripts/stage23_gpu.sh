#!/usr/bin/env bash
# Stages 2 and 3 of issue 25 side by side on one H200 (a 135M backbone leaves the GPU mostly
# idle, and device time is what is scarce): scripts/stage2_gpu.sh's pipeline and two GRPO runs
# of scripts/stage3_gpu.sh, each engine with a fixed KV pool so that none takes the memory of
# the others: A at speed 2 on 5x5 (lr LR_A; stage 1 answers 99% there, so the length term is
# what can move), B at speed 3 on 4x4 (lr LR_B; stage 1 answers under 1% there).
#   run "bash scripts/stage23_gpu.sh take"    carry [".xfer/p1"]  (then p2 .. p7 likewise)
#   run "bash scripts/stage23_gpu.sh start"   carry [".xfer/p8"]  (all three in the
#                                                                  background; returns after
#                                                                  T_WAIT s with a snapshot)
#   run "bash scripts/stage23_gpu.sh finish"                      (waits, evaluates stage 3,
#                                                                  packs $OUT: stage2.tgz,
#                                                                  summary.json, stage3.tgz)
# Knobs (env): STAGE2 (1; 0: stage 3 only), LR_A (1e-6, upstream), LR_B (1e-5; B trains
# without autocast), T_WAIT (530), KV_SLOTS (100000), T_EVAL
# (150), and those
# of the two scripts.
set -uo pipefail
cd "$(dirname "$0")/.."
X=/tmp/x; mkdir -p "$X" "${OUT:=out}"
export PYTHONPATH="$PWD/src:/tmp/site" HF_HUB_OFFLINE=1 LATENTSERVE_DEBUG=1
export KV_SLOTS="${KV_SLOTS:-100000}" T_EVAL="${T_EVAL:-150}" OUT
. scripts/gpu_xfer.sh
pack3() { tar czf "$OUT/stage3.tgz" -C /tmp/stage3 --exclude='*.txt' . 2>/dev/null; }

case "${1:-}" in
take) xfer_take ;;
start)
  xfer_start || exit 1
  export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf
  nvidia-smi --query-gpu=name,memory.used --format=csv
  mkdir -p /tmp/stage2 /tmp/stage3
  [ "${STAGE2:-1}" = 1 ] && setsid nohup bash scripts/stage2_gpu.sh pipeline \
    > /tmp/stage2/pipeline.out 2>&1 < /dev/null &
  setsid nohup bash scripts/stage3_gpu.sh grpo grpo_a "${LR_A:-1e-6}" 2 5 > /dev/null 2>&1 < /dev/null &
  setsid nohup bash scripts/stage3_gpu.sh grpo grpo_b "${LR_B:-1e-5}" 3 4 --no-autocast > /dev/null 2>&1 < /dev/null &
  sleep "${T_WAIT:-530}"
  tail -n 12 /tmp/stage2/pipeline.log 2>/dev/null; tail -n 3 /tmp/stage3/grpo_{a,b}.log
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  pack3
  ;;
finish)
  while pgrep -f "train colar-grpo" > /dev/null; do sleep 5; done
  tail -n 3 /tmp/stage3/grpo_{a,b}.log
  bash scripts/stage3_gpu.sh eval 2 grpo_a
  bash scripts/stage3_gpu.sh eval 3 grpo_b
  pack3
  [ "${STAGE2:-1}" = 1 ] || exit 0
  while [ ! -f /tmp/stage2/pipeline.done ] && pgrep -f "stage2_gpu.sh pipeline" > /dev/null; do
    sleep 5
  done
  tail -n 40 /tmp/stage2/pipeline.log  # the pipeline packed $OUT/stage2.tgz when it ended
  ls -la "$OUT"
  ;;
*) echo "usage: $0 take|start|finish" >&2; exit 2 ;;
esac
