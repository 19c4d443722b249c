#!/usr/bin/env bash
# Stage 2 of issue 25 on the H200 (docs/training.md section 6): the compression head on the
# stage-0 reasoning backbone models/smollm2-mult-cot (a LoRA adapter over SmolLM2-135M),
# CoLaR prompt format: SFT, then DAgger rounds on the engine's own latents, then GRPO; each
# head evaluated on the full 4x4 and 5x5 test sets, beside the backbone's text CoT.
# Device calls, back to back (a machine goes cold 30 s after a call; the GGUF travels in eight
# parts, scripts/gpu_xfer.sh; make them here with `bash $0 pack`):
#   run "bash scripts/stage2_gpu.sh take"    carry [".xfer/p1"]  (then p2 .. p7 likewise)
#   run "bash scripts/stage2_gpu.sh start"   carry [".xfer/p8"]  (GGUF, then the pipeline in
#                                                                 the background; returns
#                                                                 after T_WAIT s)
#   run "bash scripts/stage2_gpu.sh finish"                      (waits for it, packs $OUT)
# `bash $0 pipeline` is the whole pipeline in the foreground (what `start` runs); on CPU with
# tiny knobs it checks the commands: DEVICE=cpu N_TRAIN=24 SFT_STEPS=20 DAGGER_ROUNDS=1
# DAGGER_STEPS=10 GRPO_STEPS=1 GRPO_Q=2 GRPO_G=2 EVAL_LIMIT=4 MULT_DATA=../shared/data/multiplication
# W=/tmp/stage2_cpu OUT=/tmp/stage2_cpu/out bash scripts/stage2_gpu.sh pipeline
# $OUT gets (at most 8 files): stage2.tgz (bundles head_{sft,dagger,grpo}.safetensors, their
# .log.json, eval_*.json summaries, records_*.json per-item answers, pipeline.log and .out),
# summary.json (accuracy, thinking, stop_fired per
# head and test set; training losses and DAgger's closed-loop stop metrics), stage2.log.
# Knobs (env): N_TRAIN (generated items per k, 8000), SFT_STEPS (2000), DAGGER_ROUNDS (3),
# DAGGER_STEPS (1000 per round), DAGGER_ROLLOUTS (8192 traces per round), GRPO_STEPS (30),
# GRPO_Q (16), GRPO_G (8), MAX_LATENT (64: eval and GRPO cap), EVAL_LIMIT (all 1000),
# T_SFT (240 s), T_DAGGER (330), T_GRPO (150), T_EVAL (75 per eval call), T_WAIT (540),
# KV_SLOTS (the engines' KV pools in tokens; unset: from memory).
set -uo pipefail
cd "$(dirname "$0")/.."
X="${X:-/tmp/x}"; W="${W:-/tmp/stage2}"; mkdir -p "$X" "$W" "${OUT:=out}"
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
[ -f /tmp/smollm2.gguf ] && export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf
D="${MULT_DATA:-$X/data/multiplication}"
export LATENTSERVE_DATA="$(dirname "$D")"
ls="python3 -m latentserve.cli"
. scripts/gpu_xfer.sh
MODEL=models/smollm2-mult-cot
DEVICE="${DEVICE:-cuda}"
log="$W/pipeline.log"
stamp() { echo "[$(date +%T)] $*" | tee -a "$log"; }

pack_out() {  # everything into $OUT/stage2.tgz, the summary beside it
  tar czf "$OUT/stage2.tgz" -C "$W" --exclude='*.txt' --exclude='*-step*' --exclude='*-round*' \
    --exclude=pipeline.pid --exclude=pipeline.done . 2>/dev/null
  [ -f "$W/summary.json" ] && cp "$W/summary.json" "$OUT/summary.json"
  ls -la "$OUT"
}

pipeline() {
  echo $$ > "$W/pipeline.pid"; rm -f "$W/pipeline.done"
  LIMIT=(); [ -n "${EVAL_LIMIT:-}" ] && LIMIT=(--limit "$EVAL_LIMIT")
  stamp "data: ${N_TRAIN:=8000} items per k"
  if [ ! -f "$W/mult_train.txt" ]; then
    for k in 4 5; do $ls data multiplication --k $k --n "$N_TRAIN" --out "$W/${k}x${k}_train.txt"; done
    cat "$W/4x4_train.txt" "$W/5x5_train.txt" | shuf --random-source=<(yes) > "$W/mult_train.txt"
  fi
  common=(--device "$DEVICE" --model "$MODEL" --data "$W/mult_train.txt" --prompt-format colar)
  KV=(); [ -n "${KV_SLOTS:-}" ] && KV=(--kv-slots "$KV_SLOTS")
  stamp "sft"
  timeout "${T_SFT:-240}" $ls train-head sft "${common[@]}" --steps "${SFT_STEPS:-2000}" \
    --batch-size 1024 --lr 1e-3 --compression-factor 4 --capture-batch-size 64 \
    --save-every 500 --no-progress --out "$W/head_sft.safetensors" 2>&1 | tail -30 | tee -a "$log"
  if [ ! -f "$W/head_sft.safetensors" ]; then  # cut off by T_SFT: the last checkpoint
    last=$(ls -v "$W"/head_sft-step*.safetensors 2>/dev/null | tail -1)
    [ -n "$last" ] && cp "$last" "$W/head_sft.safetensors" && stamp "sft cut off; using $last"
  fi
  if [ -f "$W/head_sft.safetensors" ]; then
    stamp "dagger"
    timeout "${T_DAGGER:-330}" $ls train-head dagger "${common[@]}" \
      --bundle "$W/head_sft.safetensors" --rounds "${DAGGER_ROUNDS:-3}" \
      --steps "${DAGGER_STEPS:-1000}" --rollout-examples "${DAGGER_ROLLOUTS:-8192}" \
      --overshoot 2 --batch-size 1024 --lr 1e-3 --capture-batch-size 64 --no-progress "${KV[@]}" \
      --out "$W/head_dagger.safetensors" 2>&1 | tail -40 | tee -a "$log"
    if [ ! -f "$W/head_dagger.safetensors" ]; then  # cut off: the last finished round
      last=$(ls -v "$W"/head_dagger-round*.safetensors 2>/dev/null | tail -1)
      [ -n "$last" ] && cp "$last" "$W/head_dagger.safetensors" && stamp "dagger cut off; using $last"
    fi
  fi
  if [ -f "$W/head_dagger.safetensors" ]; then
    stamp "grpo"
    timeout "${T_GRPO:-150}" $ls train-head grpo "${common[@]}" \
      --bundle "$W/head_dagger.safetensors" --steps "${GRPO_STEPS:-30}" --save-every 5 \
      --questions-per-step "${GRPO_Q:-16}" --group-size "${GRPO_G:-8}" --lr 1e-4 \
      --kl-coef 0.05 --sigma 0.3 --max-latent "${MAX_LATENT:-64}" --answer-tokens 32 \
      --no-progress "${KV[@]}" --out "$W/head_grpo.safetensors" 2>&1 | tail -20 | tee -a "$log"
  fi
  ev() { timeout "${T_EVAL:-75}" $ls eval --device "$DEVICE" --model "$MODEL" \
           --prompt-format colar --max-num-seqs 256 "${LIMIT[@]}" "${KV[@]}" "$@" 2>&1 \
           | grep --line-buffered -v "Loading\|Converting" | tail -3 | tee -a "$log"; }
  for s in 4x4 5x5; do
    stamp "eval: text CoT, $s"
    ev --no-latent-head --dataset-file "$D/${s}_test.txt" --max-tokens 200 \
      --json-out "$W/eval_cot_${s}.json"
  done
  for name in sft dagger grpo; do
    [ -f "$W/head_$name.safetensors" ] || continue
    for s in 4x4 5x5; do
      stamp "eval: $name head, $s"
      ev --latent-head "$W/head_$name.safetensors" --dataset-file "$D/${s}_test.txt" \
        --max-latent "${MAX_LATENT:-64}" --max-tokens 32 --json-out "$W/eval_${name}_${s}.json" \
        --out "$W/records_${name}_${s}.json"
    done
  done
  python3 - "$W" <<'PY' | tee -a "$log"
import json, os, sys
w = sys.argv[1]
summary = {"eval": {}, "train": {}}
for name in ("cot", "sft", "dagger", "grpo"):
    for s in ("4x4", "5x5"):
        p = os.path.join(w, f"eval_{name}_{s}.json")
        if os.path.exists(p):
            r = json.load(open(p))
            summary["eval"][f"{name}:{s}"] = {k: r.get(k) for k in (
                "n", "accuracy", "thinking", "stop_fired", "seconds", "max_latent")}
for name in ("sft", "dagger", "grpo"):
    p = os.path.join(w, f"head_{name}.safetensors.log.json")
    if os.path.exists(p):
        lg = json.load(open(p))
        if name == "dagger":
            summary["train"][name] = [{k: h[k] for k in ("round", "rows", "closed_loop",
                                                         "loss_after", "seconds")}
                                      for h in lg["history"]]
        elif name == "sft":
            summary["train"][name] = {k: lg.get(k) for k in ("traces", "rows", "loss_before",
                                                             "loss_after", "seconds")}
        else:
            summary["train"][name] = {"history": lg["history"], "seconds": lg["seconds"]}
json.dump(summary, open(os.path.join(w, "summary.json"), "w"), indent=1)
print(json.dumps(summary["eval"], indent=1))
PY
  stamp "done"; touch "$W/pipeline.done"
}

case "${1:-}" in
pack) xfer_pack ;;
take) xfer_take ;;
start)
  xfer_start || exit 1
  nvidia-smi --query-gpu=name,memory.used --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  setsid nohup bash "$PWD/scripts/stage2_gpu.sh" pipeline > "$W/pipeline.out" 2>&1 < /dev/null &
  sleep "${T_WAIT:-540}"
  tail -n 30 "$log"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  pack_out
  ;;
finish)
  while [ ! -f "$W/pipeline.done" ] && kill -0 "$(cat "$W/pipeline.pid" 2>/dev/null)" 2>/dev/null; do
    sleep 5
  done
  tail -n 60 "$log"
  cp "$log" "$OUT/stage2.log"
  pack_out
  ;;
pipeline)
  pipeline; pack_out
  ;;
*) echo "usage: $0 pack|take|start|finish|pipeline" >&2; exit 2 ;;
esac
