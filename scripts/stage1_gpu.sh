#!/usr/bin/env bash
# Stage 1 of CoLaR on the H200 (docs/results.md): CoLaR trained from the stage-0 adapters
# (models/smollm2-mult-cot, models/smollm2-gsm8k-cot), then evaluated through our engine.
# Device calls, back to back (a machine goes cold 30 s after a call; the GGUF travels in eight
# parts, scripts/gpu_xfer.sh; make them here with `bash scripts/stage1_gpu.sh pack`):
#   run "bash scripts/stage1_gpu.sh take"   carry [".xfer/p1"]   (then p2 .. p7 likewise)
#   run "bash scripts/stage1_gpu.sh start"  carry [".xfer/p8"]   (builds data, starts training,
#                                                                 returns after T_WAIT s)
#   run "bash scripts/stage1_gpu.sh finish"                      (waits, evaluates, packs $OUT)
# or run "bash scripts/stage1_gpu.sh more" carry [".xfer/p8"] (continues the CoLaR directory
#   INIT, default models/smollm2-mult-colar, T_MORE s, each batch's speed drawn from
#   TRAIN_FACTORS, default 1..5; OWN_LATENT_PROB, scheduled sampling, default off), then, on
#   the same machine,
#   run "bash scripts/stage1_gpu.sh after" (its speed sweep on both test sets, 64 seqs, and
#   text CoT's 5x5 run beside it);
# or run "bash scripts/stage1_gpu.sh tput" carry [".xfer/p8"] (throughput of models/, 64 seqs).
# Knobs (env): T_MULT (seconds of CoLaR training on multiplication, 780), T_GSM (GSM8K, 300),
# LR (5e-4), T_WAIT (500), N_MULT (generated items per k, 400000; seed 0 = stage 0's set).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_xfer.sh
xfer_env; W=/tmp/stage1; mkdir -p "$W"
D="$X/data/multiplication"; G="$X/data/gsm8k"

case "${1:-}" in
pack) xfer_pack ;;
take) xfer_take ;;
start)
  xfer_start || exit 1
  for k in 4 5; do $ls data multiplication --k $k --n "${N_MULT:-400000}" --out "$W/${k}x${k}_train.txt"; done
  common=(--device cuda --lr "${LR:-5e-4}" --log-every 100 --max-compression-factor 5
          --max-latent 160)
  setsid nohup $ls train colar "${common[@]}" --init-adapter models/smollm2-mult-cot \
    --data "$W/4x4_train.txt" --data "$W/5x5_train.txt" --compression-factor 4 \
    --out "$W/colar_mult" --steps 100000 --max-seconds "${T_MULT:-780}" --batch-size 128 \
    --save-every 1000 > "$W/colar_mult.log" 2>&1 < /dev/null &
  setsid nohup $ls train colar "${common[@]}" --init-adapter models/smollm2-gsm8k-cot \
    --data "$G/train.jsonl" --compression-factor 2 --out "$W/colar_gsm8k" --steps 100000 \
    --max-seconds "${T_GSM:-300}" --batch-size 64 > "$W/colar_gsm8k.log" 2>&1 < /dev/null &
  # Wait T_WAIT s, or less when both trainings have ended (a crash shows at once).
  for _ in $(seq $(( ${T_WAIT:-500} / 5 ))); do
    pgrep -f "latentserve.cli train" > /dev/null || break; sleep 5
  done
  tail -n 3 "$W"/*.log
  for m in colar_mult colar_gsm8k; do
    [ -d "$W/$m" ] && tar czf "$OUT/$m.tgz" -C "$W" --exclude='train_log.json' "$m"
  done
  ;;
more)  # continue stage 1 on multiplication from the CoLaR directory carried as colar_mult
  xfer_start || exit 1
  for k in 4 5; do $ls data multiplication --k $k --n "${N_MULT:-150000}" --seed 1 \
    --out "$W/${k}x${k}_train.txt"; done
  $ls train colar --device cuda --lr "${LR:-5e-4}" --log-every 200 --max-compression-factor 5 \
    --max-latent 160 --init-adapter "${INIT:-models/smollm2-mult-colar}" \
    ${TRAIN_FACTORS:+--train-factors "$TRAIN_FACTORS"} \
    ${OWN_LATENT_PROB:+--own-latent-prob "$OWN_LATENT_PROB"} --data "$W/4x4_train.txt" \
    --data "$W/5x5_train.txt" --compression-factor 2 --out "$W/colar_mult" --steps 100000 \
    --max-seconds "${T_MORE:-420}" --batch-size 128 2>&1 | grep --line-buffered -v Loading
  tar czf "$OUT/colar_mult.tgz" -C "$W" colar_mult
  ;;
after)  # the model `more` left in $W/colar_mult: speeds 2..4 on both test sets (bf16, 64 seqs)
  for s in 4x4 5x5; do
    $ls eval --device cuda --dtype bfloat16 --model "$W/colar_mult" --max-num-seqs 64 \
      --dataset-file "$D/${s}_test.txt" --max-tokens 40 --sweep compression_factor=2,3,4 \
      --json-out "$OUT/more_colar_${s}.json" 2>&1 | grep --line-buffered -v "Loading\|Converting"
  done
  $ls eval --device cuda --dtype bfloat16 --model models/smollm2-mult-cot --max-num-seqs 64 \
    --dataset-file "$D/5x5_test.txt" --max-tokens 200 --json-out "$OUT/tput_cot_5x5.json" \
    2>&1 | grep --line-buffered -v "Loading\|Converting"
  ;;
finish)  # every result is packed into $OUT as soon as it exists (a call cut at its limit keeps it)
  while pgrep -f "latentserve.cli train" > /dev/null; do sleep 5; done
  tail -n 3 "$W"/*.log
  pack() {
    for m in colar_mult colar_gsm8k; do
      [ -d "$W/$m" ] && [ ! -f "$OUT/$m.tgz" ] && tar czf "$OUT/$m.tgz" -C "$W" "$m"
    done
    tar czf "$OUT/stage1_logs.tgz" -C "$W" --exclude=./colar_mult --exclude=./colar_gsm8k \
      --exclude='*.txt' .
  }
  pack
  ev() { $ls eval --device cuda --dtype bfloat16 "$@" 2>&1 | grep --line-buffered -v "Loading\|Converting"; pack; }
  for s in 5x5 4x4; do
    ev --model "$W/colar_mult" --dataset-file "$D/${s}_test.txt" --max-tokens 40 \
      --sweep compression_factor=1,2,3,4,5 --json-out "$W/eval_colar_${s}.json"
  done
  # Answer throughput at 64 concurrent requests, the same 1000 questions (5x5); the text-CoT
  # runs give its accuracy and thinking through the engine too.
  ev --model "$W/colar_mult" --dataset-file "$D/5x5_test.txt" --max-tokens 40 \
    --max-num-seqs 64 --json-out "$W/tput_colar_5x5.json"
  ev --model models/smollm2-mult-cot --dataset-file "$D/5x5_test.txt" --max-tokens 200 \
    --max-num-seqs 64 --json-out "$W/tput_cot_5x5.json"
  ev --model "$W/colar_gsm8k" --dataset-file "$G/test_icot.txt" --max-tokens 40 \
    --json-out "$W/eval_colar_gsm8k.json"
  ev --model models/smollm2-mult-cot --dataset-file "$D/4x4_test.txt" --max-tokens 200 \
    --json-out "$W/eval_cot_4x4.json"
  ls -la "$OUT"
  ;;
tput)  # carry .xfer/p8 after p1..p7: answer throughput of the shipped models at 64 concurrent
  # requests (the same 1000 5x5 questions, bf16), CoLaR at its default speed against text CoT.
  xfer_start || exit 1
  for m in smollm2-mult-colar:40 smollm2-mult-cot:200; do
    $ls eval --device cuda --dtype bfloat16 --model "models/${m%%:*}" --max-num-seqs 64 \
      --dataset-file "$D/5x5_test.txt" --max-tokens "${m##*:}" \
      --json-out "$OUT/tput_${m%%:*}_5x5.json" 2>&1 | grep --line-buffered -v "Loading\|Converting"
  done
  ;;
*) echo "usage: $0 pack|take|start|more|after|finish|tput" >&2; exit 2 ;;
esac
