#!/usr/bin/env bash
# Every GPU test and the GPU benchmark in one call on the H200: pytest -m gpu, then
# benchmarks.gpu; results as JSON in $OUT (or ./out): gpu_tests.json, gpu_bench.json.
# Usage on the device machine: bash scripts/gpu_tests.sh [extra pytest args]
# Only tests/gpu is collected: tests/unit turns on the Triton interpreter at import.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
python3 -m pytest -n 0 -m gpu -q -p no:cacheprovider --junitxml="$out/gpu_tests.xml" "$@" tests/gpu 2>&1 | tee "$out/gpu_tests.log"
rc=${PIPESTATUS[0]}
python3 - "$out" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
root = ET.parse(f"{out}/gpu_tests.xml").getroot()
cases = []
for tc in root.iter("testcase"):
    status = "passed"
    for tag in ("failure", "error", "skipped"):
        if tc.find(tag) is not None:
            status = tag
    cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "status": status,
                  "seconds": float(tc.get("time", 0))})
json.dump({"cases": cases}, open(f"{out}/gpu_tests.json", "w"), indent=1)
print(json.dumps({s: sum(c["status"] == s for c in cases) for s in ("passed", "failure", "error", "skipped")}))
PY
[ "${SKIP_BENCH:-0}" = 1 ] || python3 -m benchmarks.gpu "$out/gpu_bench.json" 2>&1 | grep -v "Loading\|Writing" | tail -5
exit $rc
