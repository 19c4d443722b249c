#!/usr/bin/env bash
# One session's device work in a few calls (a machine goes cold 30 s after a call): the GGUF
# parts as scripts/gpu_xfer.sh says, then
#   take           (carry .xfer/pK, K = 1..7, one call each; with nothing to wait for between them)
#   prep           joins the GGUF and installs the wheels in .whl when carried (train does too)
#   train FILE...  joins the GGUF (installs the wheels in .whl when carried), starts a stage-1
#                  CoLaR continuation of models/smollm2-mult-colar
#                  in the background (T_MORE s wall, TRAIN_FACTORS, LR, OWN_LATENT_PROB,
#                  LORA_R: 0 merges the adapter and trains every weight; COMPRESSION, LOG_EVERY;
#                  N_TRAIN items of each size), then
#                  runs the GPU tests FILE... in the foreground (log and junit xml in $OUT;
#                  none without FILE)
#   tests FILE...  more GPU tests while the training goes on
#   bench FAM...   `bench --suite families` per family (one JSON each in $OUT), the training
#                  paused (SIGSTOP) meanwhile so it does not disturb the timings
#   paused CMD...  any command (a profile, another bench) with the training paused
#   finish         waits for the training, packs it (not a whole model), evaluates it at
#                  speeds 2-4 on both test sets, and runs the teacher-forced probe
#   once FILE...   train FILE..., then finish, in one call (T_MORE about 330 s, N_TRAIN 60000
#                  and T_TESTS about 150 fit the 600-s call: with XFER_PARTS=3, two takes
#                  and this call carrying the last part and .whl)
# Session 20 ran: 8 takes; train (8 test files); tests (8 more); bench plain head; bench
# feedback loop recurrent; finish (docs/results.md "Run 4", docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_xfer.sh
xfer_env; W=/tmp/stage1; mkdir -p "$W"
D="$X/data/multiplication"
gtests() {  # gtests TAG FILE...: pytest with a full log and junit xml in $OUT
  local tag="$1"; shift
  # SIGINT at the limit: pytest then prints the failures so far (a kill prints none)
  timeout -s INT -k 20 "${T_TESTS:-540}" python3 -m pytest -n 0 -m gpu -v -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests_$tag.xml" "$@" > "$OUT/gpu_tests_$tag.log" 2>&1
  echo "rc $?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/gpu_tests_$tag.log" | grep -c PASSED
  grep -E "FAILED|ERROR" "$OUT/gpu_tests_$tag.log" | head -20; tail -3 "$OUT/gpu_tests_$tag.log"
}
prep() {
  xfer_start || return 1
  if [ -d .whl ]; then  # wheels the image lacks (xgrammar and its needs), carried as .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
  fi
}
pause() { pg=$(cat $W/train.pid 2>/dev/null); [ -n "$pg" ] && kill -STOP -- -"$pg"; }
resume() { [ -n "${pg:-}" ] && kill -CONT -- -"$pg"; tail -2 "$W/train.log"; }
case "${1:-}" in
take) xfer_take ;;
bench)
  shift; pause
  for f in "$@"; do
    timeout "${T_BENCH:-560}" $ls bench --suite families --families "$f" \
      --json-out "$OUT/families_$f.json" 2>&1 | grep -v "Loading\|Writing" | tail -8
  done; resume ;;
paused) shift; pause; timeout "${T_BENCH:-560}" "$@"; echo "rc $?"; resume ;;
prep|train)  # prep: the GGUF joined and the carried wheels installed, no training
  [ "$1" = prep ] && { prep; exit $?; }
  shift; prep || exit 1
  for k in 4 5; do $ls data multiplication --k $k --n "${N_TRAIN:-150000}" --seed 2 \
    --out "$W/${k}x${k}_train.txt"; done
  setsid nohup $ls train colar --device cuda --lr "${LR:-5e-4}" --log-every "${LOG_EVERY:-200}" \
    --max-compression-factor 5 --max-latent 160 --init-adapter models/smollm2-mult-colar \
    --train-factors "${TRAIN_FACTORS:-3,4,4}" --data "$W/4x4_train.txt" \
    --data "$W/5x5_train.txt" --compression-factor 2 --out "$W/colar_mult" --steps 100000 \
    --max-seconds "${T_MORE:-1000}" --batch-size 128 --save-every 1000 \
    ${OWN_LATENT_PROB:+--own-latent-prob "$OWN_LATENT_PROB"} ${LORA_R:+--lora-r "$LORA_R"} \
    ${COMPRESSION:+--compression "$COMPRESSION"} > "$W/train.log" 2>&1 < /dev/null &
  echo $! > "$W/train.pid"; sleep 20; tail -3 "$W/train.log"
  [ $# -gt 0 ] && gtests a "$@"; tail -2 "$W/train.log" ;;
tests) shift; gtests b "$@"; tail -2 "$W/train.log" ;;
finish)
  while kill -0 "$(cat $W/train.pid)" 2>/dev/null; do sleep 5; done
  tail -4 "$W/train.log"; cp "$W/train.log" "$OUT/"
  # a whole model (LORA_R=0) is too large to come back: only its logs and figures do
  [ -f "$W/colar_mult/model.safetensors" ] || \
    tar czf "$OUT/colar_mult.tgz" -C "$W" --exclude=train_log.json colar_mult
  cp "$W/colar_mult/train_log.json" "$W/colar_mult/train_config.json" "$OUT/" 2>/dev/null
  for s in 4x4 5x5; do
    $ls eval --device cuda --dtype bfloat16 --model "$W/colar_mult" --max-num-seqs 64 \
      --dataset-file "$D/${s}_test.txt" --max-tokens 40 --sweep compression_factor=2,3,4 \
      --json-out "$OUT/colar_${s}.json" 2>&1 | grep --line-buffered -v "Loading\|Converting"
  done
  # the teacher-forced probe (docs/results.md): gold compressed steps in, on the CPU
  PYTHONPATH="$PYTHONPATH:$PWD" timeout "${T_PROBE:-240}" python3 \
    scripts/colar_teacher_forced.py "$W/colar_mult" "$D/4x4_test.txt" 100 2 3 4 \
    > "$OUT/teacher_forced_4x4_100.jsonl" && cat "$OUT/teacher_forced_4x4_100.jsonl" ;;
once) shift; bash "$0" train "$@" && bash "$0" finish ;;
*) echo "usage: $0 take|prep|train|tests|bench|paused|finish|once" >&2; exit 2 ;;
esac
