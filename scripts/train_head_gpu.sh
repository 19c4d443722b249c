#!/usr/bin/env bash
# Train a compression head on SmolLM2-135M-Instruct and evaluate it, in one call on the H200
# (<= ~8 minutes): SFT on GSM8K train, a few GRPO steps through our engine, then GSM8K test
# with text CoT (bare backbone) vs the SFT and GRPO heads swept over max_latent.
# Writes to $OUT (or ./out): head_sft.safetensors (+ .log.json), head_grpo.safetensors
# (+ .log.json), eval_cot.json, eval_sft.json / eval_sft.png, eval_grpo.json / eval_grpo.png,
# train_head_gpu.log, summary.json.
# Needs the SmolLM2 GGUF: LATENTSERVE_EMBEDDED_GGUF=/path/to/smollm2.gguf (else the wheel's).
# Knobs (env): DEVICE (cuda), SFT_EXAMPLES (all), SFT_STEPS (1500), GRPO_STEPS (15),
# GRPO_Q (16 questions/step), GRPO_G (8 rollouts/question), EVAL_LIMIT (all 1319),
# SWEEP (0,4,8,16,32), COT_TOKENS (256), EAGER (0; 1 = no CUDA graphs), and per-stage time
# limits T_SFT (150 s), T_GRPO (120 s), T_EVAL (240 s for all three evals).
# Usage: bash scripts/train_head_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TQDM_MININTERVAL=15
DEVICE="${DEVICE:-cuda}"
EAGER_FLAG=(); [ "${EAGER:-0}" = 1 ] && EAGER_FLAG=(--enforce-eager)
LIMIT_FLAG=(); [ -n "${EVAL_LIMIT:-}" ] && LIMIT_FLAG=(--limit "$EVAL_LIMIT")
SFT_EX_FLAG=(); [ -n "${SFT_EXAMPLES:-}" ] && SFT_EX_FLAG=(--max-examples "$SFT_EXAMPLES")
DATA="${LATENTSERVE_DATA:-$PWD/../shared/data}"
[ -d "$DATA/gsm8k" ] || DATA=/work/shared/data
[ -d "$DATA/gsm8k" ] || DATA="$PWD/shared/data"
export LATENTSERVE_DATA="$DATA"
ls="python3 -m latentserve.cli"
log="$out/train_head_gpu.log"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' | tee -a "$log"

stamp "sft"
timeout "${T_SFT:-150}" $ls train-head sft --device "$DEVICE" --data "$DATA/gsm8k/train.jsonl" \
  "${SFT_EX_FLAG[@]}" --steps "${SFT_STEPS:-1500}" --batch-size 1024 --lr 1e-3 \
  --capture-batch-size 64 --save-every 500 --out "$out/head_sft.safetensors" 2>&1 | tail -20 | tee -a "$log"

grpo_bundle=""
if [ -f "$out/head_sft.safetensors" ]; then
  stamp "grpo"
  timeout "${T_GRPO:-120}" $ls train-head grpo --device "$DEVICE" "${EAGER_FLAG[@]}" \
    --data "$DATA/gsm8k/train.jsonl" --bundle "$out/head_sft.safetensors" \
    --steps "${GRPO_STEPS:-15}" --questions-per-step "${GRPO_Q:-16}" --group-size "${GRPO_G:-8}" \
    --lr 1e-4 --kl-coef 0.05 --sigma 0.3 --max-latent 32 \
    --out "$out/head_grpo.safetensors" 2>&1 | tail -20 | tee -a "$log"
  [ -f "$out/head_grpo.safetensors" ] && grpo_bundle="$out/head_grpo.safetensors"
fi

eval_end=$(( $(date +%s) + ${T_EVAL:-240} ))
left() { echo $(( eval_end - $(date +%s) )); }
stamp "eval: text CoT, bare backbone"
timeout "$(left)" $ls eval --device "$DEVICE" "${EAGER_FLAG[@]}" --no-latent-head \
  --dataset gsm8k "${LIMIT_FLAG[@]}" --max-tokens "${COT_TOKENS:-256}" --max-num-seqs 256 \
  --out "$out/eval_cot.json" 2>&1 | tail -3 | tee -a "$log"
for name in sft grpo; do
  bundle="$out/head_$name.safetensors"
  [ -f "$bundle" ] || continue
  stamp "eval: latent, $name head"
  timeout "$(left)" $ls eval --device "$DEVICE" "${EAGER_FLAG[@]}" --latent-head "$bundle" \
    --dataset gsm8k "${LIMIT_FLAG[@]}" --max-tokens 16 --max-num-seqs 256 \
    --sweep "max_latent=${SWEEP:-0,4,8,16,32}" --out "$out/eval_$name.json" \
    --plot "$out/eval_$name.png" 2>&1 | tail -8 | tee -a "$log"
done
stamp "done"
python3 - "$out" <<'PY' | tee -a "$log"
import json, os, sys
out = sys.argv[1]
summary = {}
for name in ("cot", "sft", "grpo"):
    p = os.path.join(out, f"eval_{name}.json")
    if os.path.exists(p):
        summary[name] = [{k: r[k] for k in ("max_latent", "n", "accuracy_flexible",
                          "accuracy_strict", "thinking_median", "thinking_max",
                          "latency_median_s")} for r in json.load(open(p))["runs"]]
for name in ("sft", "grpo"):
    p = os.path.join(out, f"head_{name}.safetensors.log.json")
    if os.path.exists(p):
        lg = json.load(open(p))
        summary[f"train_{name}"] = {k: lg.get(k) for k in ("loss_before", "loss_after",
                                                            "traces", "seconds")}
        if name == "grpo":
            summary["train_grpo"]["history"] = lg["history"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
