#!/usr/bin/env bash
# Stage 0 of CoLaR on the H200 (docs/results.md): text-CoT LoRA backbones on SmolLM2-135M.
# Two back-to-back device calls (a machine goes cold 30 s after a call):
#   bash scripts/stage0_gpu.sh start    # builds the data, starts three trainings in the background
#                                      # (cot_mult, then nocot_mult and cot_gsm8k), returns after ~9 min
#   bash scripts/stage0_gpu.sh finish   # waits for them, evaluates greedy on the full test sets
# Inputs under $XFER (default .xfer/b): part_ab (second half of the GGUF; the first half was
# copied to /tmp/g/part_aa by an earlier call), gguf-*.whl, data/{multiplication,gsm8k}.
# Knobs (env): T_MAIN (seconds of cot_mult training, 840), T_SIDE (nocot_mult, 360), N_MULT
# (generated items per k, 400000), LORA_R (16).
set -uo pipefail
cd "$(dirname "$0")/.."
XFER="${XFER:-.xfer/b}"; W=/tmp/stage0; mkdir -p "$W" "${OUT:=out}"
export PYTHONPATH="$PWD/src:/tmp/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf LATENTSERVE_DATA="$W/data"
ls="python3 -m latentserve.cli"
D="$W/data/multiplication"; G="$W/data/gsm8k"
common=(--device cuda --lora-r "${LORA_R:-16}" --lora-alpha $((2 * ${LORA_R:-16})) --log-every 100)

snapshot() {  # adapters and logs into $OUT (at most 8 files come back)
  for m in cot_mult nocot_mult cot_gsm8k; do
    [ -f "$W/$m/adapter_model.safetensors" ] && cp "$W/$m/adapter_model.safetensors" "$OUT/$m.safetensors"
  done
  tar czf "$OUT/stage0_logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='data' --exclude='*.txt' . 2>/dev/null
}

if [ "${1:-}" = start ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$XFER"/gguf-*.whl || exit 1
  cat /tmp/g/part_aa "$XFER/part_ab" > /tmp/smollm2.gguf && md5sum /tmp/smollm2.gguf
  cp -r "$XFER/data" "$W/"
  nvidia-smi --query-gpu=name,memory.used --format=csv
  python3 -c 'from latentserve.models.checkpoint import resolve_model_dir as r; print(r(None))' 2>&1 | tail -1
  for k in 4 5; do $ls data multiplication --k $k --n "${N_MULT:-400000}" --out "$W/${k}x${k}_train.txt"; done
  setsid nohup $ls train cot "${common[@]}" --data "$W/4x4_train.txt" --data "$W/5x5_train.txt" \
    --eval-data "$D/4x4_valid.txt" --eval-data "$D/5x5_valid.txt" --out "$W/cot_mult" \
    --steps 100000 --max-seconds "${T_MAIN:-840}" --batch-size 128 --lr 1e-3 --save-every 1000 \
    > "$W/cot_mult.log" 2>&1 < /dev/null &
  setsid nohup bash -c "$ls train cot ${common[*]} --mode nocot --data $W/4x4_train.txt \
    --data $W/5x5_train.txt --eval-data $D/4x4_valid.txt --eval-data $D/5x5_valid.txt \
    --out $W/nocot_mult --steps 100000 --max-seconds ${T_SIDE:-360} --batch-size 128 \
    --lr 1e-3 > $W/nocot_mult.log 2>&1; $ls train cot ${common[*]} --data $G/train.jsonl \
    --eval-data $G/test_icot.txt --out $W/cot_gsm8k --steps 600 --batch-size 64 --lr 1e-3 \
    > $W/cot_gsm8k.log 2>&1" < /dev/null > /dev/null 2>&1 &
  sleep "${T_WAIT:-480}"
  tail -n 3 "$W"/*.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  snapshot
  exit 0
fi

if [ "${1:-}" = finish ]; then
  while pgrep -f "latentserve.cli train" > /dev/null; do sleep 10; done
  tail -n 4 "$W"/*.log
  python3 - "$W" <<'EOF' 2>&1 | tee "$W/eval_full.log"
import json, sys
from pathlib import Path
import torch
from peft import PeftModel
from latentserve.train.cot import greedy_accuracy, load_backbone, read_items
w = Path(sys.argv[1]); d = w / "data"
sets = {"cot_mult": ["multiplication/4x4_test.txt", "multiplication/5x5_test.txt"],
        "nocot_mult": ["multiplication/4x4_test.txt", "multiplication/5x5_test.txt"],
        "cot_gsm8k": ["gsm8k/test_icot.txt"]}
res = {}
for name, files in sets.items():
    if not (w / name / "adapter_config.json").is_file():
        continue
    base, tok, _ = load_backbone(None, "cuda")
    model = PeftModel.from_pretrained(base, str(w / name)).cuda()
    for f in files:
        r = greedy_accuracy(model, tok, read_items(d / f), "cuda", max_new_tokens=256)
        res[f"{name}:{f}"] = r
        print(name, f, json.dumps(r), flush=True)
(w / "eval_full.json").write_text(json.dumps(res, indent=1))
EOF
  snapshot
  exit 0
fi
echo "usage: $0 start|finish" >&2; exit 2
