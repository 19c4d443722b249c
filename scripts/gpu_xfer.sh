# Sourced by scripts/stage{1,2}_gpu.sh: the embedded GGUF and the data travel to the device in
# four parts (the tree that travels is at most 64 MiB and the repository holds ~30 MB).
# xfer_pack (here): .xfer/p1..p4 (GGUF quarters; p1 also the data and the gguf wheel).
# xfer_take (device): copy the carried .xfer/p1..p3 into $X.
# xfer_start (device): copy .xfer/p4, install the wheel, join the GGUF into /tmp/smollm2.gguf.

xfer_pack() {
  local gguf
  gguf=$(env -u LATENTSERVE_EMBEDDED_GGUF python3 -c \
    'from latentserve.models.checkpoint import embedded_gguf_path as e; print(e())') || return 1
  rm -rf .xfer/p1 .xfer/p2 .xfer/p3 .xfer/p4
  split -n 4 -d "$gguf" .xfer/part_
  for i in 1 2 3 4; do mkdir -p .xfer/p$i && mv .xfer/part_0$((i - 1)) .xfer/p$i/; done
  cp -r "${DATA:-../shared/data}" .xfer/p1/data
  python3 -m pip download -q --no-deps --only-binary=:all: -d .xfer/p1 gguf==0.19.0
  md5sum "$gguf"; du -sh .xfer/p*
}

xfer_take() {
  for p in .xfer/p1 .xfer/p2 .xfer/p3; do [ -d "$p" ] && cp -r "$p"/. "$X"/; done; ls "$X"
}

xfer_start() {
  cp -r .xfer/p4/. "$X"/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$X"/gguf-*.whl || return 1
  cat "$X"/part_00 "$X"/part_01 "$X"/part_02 "$X"/part_03 > /tmp/smollm2.gguf || return 1
  md5sum /tmp/smollm2.gguf
  export LATENTSERVE_EMBEDDED_GGUF=/tmp/smollm2.gguf
  python3 -c 'from latentserve.models.checkpoint import resolve_model_dir as r; print(r(None))' 2>&1 | tail -1
}
