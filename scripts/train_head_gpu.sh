#!/usr/bin/env bash
# Train a compression head on SmolLM2-135M-Instruct and evaluate it, in one call on the H200
# (<= ~8 minutes): SFT on GSM8K train, a few GRPO steps through our engine, then GSM8K test
# with text CoT (bare backbone) vs the SFT and GRPO heads swept over max_latent.
# Writes (under $WORK_DIR, then packed into $OUT/results.tgz): head_sft.safetensors (+ .log.json), head_grpo.safetensors
# (+ .log.json), eval_cot.json, eval_sft.json / eval_sft.png, eval_grpo.json / eval_grpo.png,
# train_head_gpu.log, summary.json, scaling.png (both heads and the CoT baseline).
# Needs the SmolLM2 GGUF: LATENTSERVE_EMBEDDED_GGUF=/path/to/smollm2.gguf (else the wheel's).
# Knobs (env): DEVICE (cuda), SFT_EXAMPLES (all), SFT_STEPS (1500), GRPO_STEPS (30; the
# bundle is saved every 5), GRPO_Q (16 questions/step), GRPO_G (8 rollouts/question),
# EVAL_LIMIT (all 1319), SWEEP (0,4,8,16,32), COT_TOKENS (256), EAGER (0; 1 = no CUDA
# graphs), LATENTSERVE_DATA (folder holding gsm8k/train.jsonl and gsm8k/test.jsonl), and
# per-stage limits in seconds: T_SFT (130), T_GRPO (90), T_COT (80), T_HEAD (70 per head
# sweep; a sweep writes its JSON after every budget, so a cut-off one keeps what it finished).
# Usage: bash scripts/train_head_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# Everything is written under $out and packed into $OUT/results.tgz at the end (the device
# tool returns at most 8 files per call).
dest="${OUT:-out}"; out="${WORK_DIR:-/tmp/train_head_out}"; mkdir -p "$out" "$dest"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TQDM_MININTERVAL=15
DEVICE="${DEVICE:-cuda}"
EAGER_FLAG=(); [ "${EAGER:-0}" = 1 ] && EAGER_FLAG=(--enforce-eager)
LIMIT_FLAG=(); [ -n "${EVAL_LIMIT:-}" ] && LIMIT_FLAG=(--limit "$EVAL_LIMIT")
SFT_EX_FLAG=(); [ -n "${SFT_EXAMPLES:-}" ] && SFT_EX_FLAG=(--max-examples "$SFT_EXAMPLES")
DATA="${LATENTSERVE_DATA:-$PWD/../shared/data}"
[ -d "$DATA/gsm8k" ] || DATA=/work/shared/data
[ -d "$DATA/gsm8k" ] || DATA="$PWD/shared/data"
if [ ! -f "$DATA/gsm8k/train.jsonl" ] || [ ! -f "$DATA/gsm8k/test.jsonl" ]; then
  echo "no gsm8k/train.jsonl + test.jsonl under \$LATENTSERVE_DATA (${LATENTSERVE_DATA:-unset})" >&2
  exit 2
fi
export LATENTSERVE_DATA="$DATA"
ls="python3 -m latentserve.cli"
log="$out/train_head_gpu.log"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' | tee -a "$log"

stamp "convert the GGUF (once; cached)"
python3 -c 'from latentserve.models.checkpoint import resolve_model_dir as r; print(r(None))' 2>&1 | tail -1 | tee -a "$log"
stamp "sft"
timeout "${T_SFT:-130}" $ls train-head sft --device "$DEVICE" --data "$DATA/gsm8k/train.jsonl" \
  "${SFT_EX_FLAG[@]}" --steps "${SFT_STEPS:-1500}" --batch-size 1024 --lr 1e-3 \
  --capture-batch-size 64 --save-every 500 --out "$out/head_sft.safetensors" 2>&1 | tail -20 | tee -a "$log"

if [ ! -f "$out/head_sft.safetensors" ]; then  # cut off by T_SFT: take the last checkpoint
  last=$(ls -v "$out"/head_sft-step*.safetensors 2>/dev/null | tail -1)
  [ -n "$last" ] && cp "$last" "$out/head_sft.safetensors" && stamp "sft cut off; using $last"
fi
if [ -f "$out/head_sft.safetensors" ]; then
  stamp "grpo"
  timeout "${T_GRPO:-90}" $ls train-head grpo --device "$DEVICE" "${EAGER_FLAG[@]}" \
    --data "$DATA/gsm8k/train.jsonl" --bundle "$out/head_sft.safetensors" \
    --steps "${GRPO_STEPS:-30}" --save-every 5 --questions-per-step "${GRPO_Q:-16}" --group-size "${GRPO_G:-8}" \
    --lr 1e-4 --kl-coef 0.05 --sigma 0.3 --max-latent 32 \
    --out "$out/head_grpo.safetensors" 2>&1 | tail -20 | tee -a "$log"
fi

stamp "eval: text CoT, bare backbone"
timeout "${T_COT:-80}" $ls eval --device "$DEVICE" "${EAGER_FLAG[@]}" --no-latent-head \
  --dataset gsm8k "${LIMIT_FLAG[@]}" --max-tokens "${COT_TOKENS:-256}" --max-num-seqs 256 \
  --out "$out/eval_cot.json" 2>&1 | tail -3 | tee -a "$log"
for name in sft grpo; do
  bundle="$out/head_$name.safetensors"
  [ -f "$bundle" ] || continue
  base_flag=(); [ -f "$out/eval_cot.json" ] && base_flag=(--baseline "$out/eval_cot.json")
  stamp "eval: latent, $name head"
  timeout "${T_HEAD:-70}" $ls eval --device "$DEVICE" "${EAGER_FLAG[@]}" --latent-head "$bundle" \
    --dataset gsm8k "${LIMIT_FLAG[@]}" --max-tokens 16 --max-num-seqs 256 \
    --sweep "max_latent=${SWEEP:-0,4,8,16,32}" --out "$out/eval_$name.json" \
    --plot "$out/eval_$name.png" "${base_flag[@]}" 2>&1 | tail -8 | tee -a "$log"
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
                          "latency_median_s", "latent_end") if k in r}
                        for r in json.load(open(p))["runs"]]
for name in ("sft", "grpo"):
    p = os.path.join(out, f"head_{name}.safetensors.log.json")
    if os.path.exists(p):
        lg = json.load(open(p))
        summary[f"train_{name}"] = {k: lg.get(k) for k in ("loss_before", "loss_after",
                                                            "traces", "seconds")}
        if name == "grpo":
            summary["train_grpo"]["history"] = lg["history"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
from latentserve.eval.run import plot_sweep
series = {f"{n} head": json.load(open(os.path.join(out, f"eval_{n}.json")))["runs"]
          for n in ("sft", "grpo") if os.path.exists(os.path.join(out, f"eval_{n}.json"))}
cot = os.path.join(out, "eval_cot.json")
base = json.load(open(cot))["runs"][0] if os.path.exists(cot) else None
if series:
    n = next(iter(series.values()))[0]["n"]
    plot_sweep(series, os.path.join(out, "scaling.png"),
               f"SmolLM2-135M-Instruct, GSM8K test (n={n})", base)
print(json.dumps(summary, indent=1))
PY
tar czf "$dest/results.tgz" -C "$out" . && echo "packed $(ls "$out" | wc -l) files into $dest/results.tgz"
