"""Triton kernels compiled for an H100/H200 (sm_90: TTIR, PTX, cubin) on the CPU machine,
without a GPU: what the interpreter does not check (a non-constexpr global read inside a
kernel runs interpreted and fails to compile). Each case compiles in a fresh process without
``TRITON_INTERPRET``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SRC = Path(__file__).parents[2] / "src"

# module, kernel, signature, constexprs
CASES = [
    ("latentserve.ops.kernels.gumbel", "_gumbel_chunks_kernel",
     {"X": "*fp32", "Temps": "*fp32", "Vals": "*fp32", "Idx": "*i32", "temp": "fp32",
      "seed": "i64", "n_cols": "i32", "n_chunks": "i32", "stride_x": "i32"},
     [{"PER_ROW": True, "BLOCK": 4096}, {"PER_ROW": False, "BLOCK": 4096}]),
    ("latentserve.ops.kernels.argmax", "_argmax_rows_kernel",
     {"Vals": "*fp32", "Idx": "*i32", "Out": "*i64", "n_cols": "i32", "n_chunks": "i32"},
     [{"PDL": True, "BLOCK_C": 16}, {"PDL": False, "BLOCK_C": 64}]),
]

SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, sig, variants = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
for const in variants:
    src = ASTSource(fn=kernel, signature={**sig, **{k: "constexpr" for k in const}},
                    constexprs=const)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert out.asm["cubin"], const
print("ok")
"""


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_kernel_compiles_for_sm90(case):
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(case)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
