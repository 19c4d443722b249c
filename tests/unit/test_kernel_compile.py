"""Every Triton kernel the package launches, compiled for an H100/H200 (sm_90: TTIR, PTX,
cubin) on the CPU machine, without a GPU: what the Triton interpreter of the CPU tests never
checks. A non-constexpr global read inside a kernel runs interpreted and fails to compile; so
may a constexpr branch the CPU tests do not take, a TMA descriptor or a pipelined loop, none
of which the interpreter lowers. Each compiled kernel must also fit an sm_90 block's shared
memory (227 KiB; more raises OutOfResources at launch).

A case is a kernel launched as ``kernel[grid](...)`` somewhere under ``src/latentserve``
(helpers called only from kernels compile with them), with the argument types its wrapper
passes and its keyword arguments: the constexprs and the launch options (``num_warps``,
``num_stages``, ``launch_pdl``), one variant per constexpr branch the wrappers take (PDL on
and off, TMA on and off, ...), at the shapes of the served models (SmolLM2-135M: hidden 576,
9 q / 3 kv heads of 64; a Llama-3-8B-like: hidden 4096, 32 / 8 heads of 128; Ouro: hidden
2048; Huginn: 55 heads of 96; bf16). Pointers are 16-byte aligned, as torch allocates them
(the JIT specializes on it, except where a kernel opts out); integers are not specialized.
The cases compile in one fresh process without ``TRITON_INTERPRET``.
``test_every_launched_kernel_has_a_case`` keeps the table complete."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# not imported here: a process's first import of triton must come after the interpreted
# tests set TRITON_INTERPRET (tests/unit/test_argmax_kernel.py and others)
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

SRC = Path(__file__).parents[2] / "src"
OPS = "latentserve.ops.kernels."
ATTN = "latentserve.attention.kernels."


def _sig(names: str, ty: str) -> dict:
    """``{name: ty}`` for each space-separated name."""
    return dict.fromkeys(names.split(), ty)


def _desc(rows: int, cols: int) -> str:
    """A host ``TensorDescriptor`` of a bf16 tensor, block ``[rows, cols]``."""
    return f"tensordesc<bf16[{rows}, {cols}]>"


PDL = {"PDL": True, "launch_pdl": True}  # ops.kernels.pdl.pdl_launch on an sm_90 device
NO_PDL = {"PDL": False}

# decode_linear: the argument types of its TMA (bf16) and pointer launches
_LINEAR_INTS = _sig("M N K k_per_split stride_xm stride_wn stride_ym", "i32")
_LINEAR_CONSTS = {"HAS_BIAS": False, "SWIGLU": False, "PARTIALS": False, "ROUND_TO_X": False,
                  "ARGMAX": False, "PRECISION": None, "SILU": False, "num_warps": 4}
# qkv_rope: everything but the weight's and x's (descriptors with TMA)
_QKV = {**_sig("B Q Cos Sin KCache VCache", "*bf16"), "Slots": "*i64",
        **_sig("M K n_q_heads n_kv_heads stride_xm stride_wn stride_qt stride_qh stride_ct "
               "stride_st stride_kc_s stride_kc_h stride_vc_s stride_vc_h", "i32")}
_ROTARY_STRIDES = _sig("stride_qt stride_qh stride_kt stride_kh stride_ct stride_st "
                       "n_q_heads n_k_heads", "i32")
_STORE_STRIDES = _sig("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ct "
                      "stride_st stride_kc_s stride_kc_h stride_vc_s stride_vc_h n_q_heads "
                      "n_k_heads", "i32")
_SMOL_ROPE = {"HALF": 32, "BLOCK_HQ": 16, "BLOCK_HK": 4, "BLOCK_HALF": 32, "num_warps": 1}
_HUGINN_ROPE = {"HALF": 48, "BLOCK_HQ": 64, "BLOCK_HK": 64, "BLOCK_HALF": 64, "num_warps": 4}
_ATTN_STRIDES = "stride_qt stride_qh stride_ks stride_kh stride_vs stride_vh stride_ot stride_oh"
_MID_STRIDES = "stride_mo_b stride_mo_h stride_mo_s stride_ml_b stride_ml_h"

# module, kernel, signature (every non-constexpr parameter), variants (the wrapper's keyword
# arguments: constexprs, and launch options as Triton's launcher takes them)
CASES = [
    # sampling: logits are fp32 (compute_logits)
    (OPS + "gumbel", "_gumbel_chunks_kernel",
     {"X": "*fp32", "Temps": "*fp32", "Bits": "*i32", "Vals": "*fp32", "Idx": "*i32",
      "temp": "fp32", "seed": "i64", "n_cols": "i32", "n_chunks": "i32", "stride_x": "i32",
      "n_words": "i32"},
     [{"PER_ROW": p, "MASKED": m, "BLOCK": 4096, "num_warps": 8}
      for p in (True, False) for m in (False, True)]),
    (OPS + "argmax", "_argmax_chunks_kernel",
     {"X": "*fp32", "Bits": "*i32", "Vals": "*fp32", "Idx": "*i32", "n_cols": "i32",
      "n_chunks": "i32", "stride_x": "i32", "n_words": "i32"},
     [{"MASKED": m, "BLOCK": 4096, "num_warps": 8} for m in (False, True)]),
    (OPS + "argmax", "_argmax_rows_kernel",  # argmax_of_chunks after the LM head; argmax_rows
     {"Vals": "*fp32", "Idx": "*i32", "Out": "*i64", "n_cols": "i32", "n_chunks": "i32"},
     [{**PDL, "BLOCK_C": 512, "num_warps": 4}, {**NO_PDL, "BLOCK_C": 16, "num_warps": 1}]),
    # logprobs of the sampled tokens: fp32 logits, a float64 row per token
    (OPS + "logprobs", "_score_kernel",
     {"X": "*fp32", "Targets": "*i64", "Out": "*fp64", "Stats": "*fp32",
      **_sig("n_cols stride_x stride_o", "i32")},
     [{"BLOCK": 4096, "num_warps": 8}]),
    (OPS + "logprobs", "_pack_top_kernel",
     {"Vals": "*fp32", "Idx": "*i64", "Stats": "*fp32", "Out": "*fp64", "k": "i32",
      "stride_o": "i32"},
     [{"BLOCK_K": 1}, {"BLOCK_K": 32}]),
    # penalties: fp32 logits, int32 counts, the prompt's tokens as uint8, float64 penalties
    (OPS + "penalties", "_penalize_kernel",
     {"X": "*fp32", "Out": "*fp32", "Counts": "*i32", "Prompt": "*u8", "Rows": "*i64",
      "Params": "*fp64", "big": "fp32",
      **_sig("n_rows n_cols stride_x stride_o stride_c", "i32")},
     [{"BLOCK": 2048, "num_warps": 8}]),
    (OPS + "penalties", "_count_kernel",
     {"Counts": "*i32", "Entries": "*i64", "Tokens": "*i64", "n": "i32"},
     [{"BLOCK": 256}]),
    # the model's inputs
    (OPS + "decode_inputs", "_decode_inputs_kernel",  # Slots: no alignment specialization
     {**_sig("Packed Pending Table Slots Ids Pos Rows", "*i64"), "KvLens": "*i32",
      "OutSlots": "*i64", **_sig("n b k m off_dst off_w stride_table dummy_row", "i32")},
     [{"BLOCK_R": 64, "BLOCK_K": 64, "num_warps": 4}]),
    (OPS + "embed_inject", "_embed_inject_kernel",  # latent rows: fp32 vectors, a bool mask
     {"W": "*bf16", "Ids": "*i64", "E": "*fp32", "Mask": "*u1", "Out": "*bf16",
      **_sig("H vocab stride_w stride_e stride_o", "i32")},
     [{"HAS_LATENT": True, "BLOCK_H": 1024, **PDL, "num_warps": 4}]),
    (OPS + "embed_inject", "_embed_inject_kernel",  # no latents: E = Out, Mask = Ids
     {"W": "*bf16", "Ids": "*i64", "E": "*bf16", "Mask": "*i64", "Out": "*bf16",
      **_sig("H vocab stride_w stride_e stride_o", "i32")},
     [{"HAS_LATENT": False, "BLOCK_H": 1024, **PDL, "num_warps": 4},
      {"HAS_LATENT": False, "BLOCK_H": 1024, **NO_PDL, "num_warps": 4}]),
    (OPS + "rope_rows", "_rope_rows_kernel",  # the [max_positions, 2, head_dim] cos/sin table
     {"Table": "*bf16", "Pos": "*i64", "Out": "*bf16", "last_row": "i32", "row_elems": "i32"},
     [{"BLOCK": 128, **PDL, "num_warps": 1}, {"BLOCK": 256, **NO_PDL, "num_warps": 1}]),
    # a decoder layer
    (OPS + "rms_norm", "_rms_norm_kernel",  # x, a residual and the weights all bf16
     {**_sig("X R W Out ResOut WPre", "*bf16"),
      **_sig("stride_xs stride_x stride_r stride_o stride_ro n_cols", "i32"),
      **_sig("inv_n eps eps_pre", "fp32")},
     [{"HAS_RESIDUAL": False, "PRE_NORM": False, "SPLIT": 0, "BLOCK": 1024, **PDL,
       "num_warps": 4},
      {"HAS_RESIDUAL": True, "PRE_NORM": False, "SPLIT": 0, "BLOCK": 4096, **NO_PDL,
       "num_warps": 8},
      {"HAS_RESIDUAL": True, "PRE_NORM": True, "SPLIT": 0, "BLOCK": 2048, **PDL,  # Ouro
       "num_warps": 8}]),
    (OPS + "rms_norm", "_rms_norm_kernel",  # x: decode_linear's fp32 split-K partials
     {"X": "*fp32", **_sig("R W Out ResOut WPre", "*bf16"),
      **_sig("stride_xs stride_x stride_r stride_o stride_ro n_cols", "i32"),
      **_sig("inv_n eps eps_pre", "fp32")},
     [{"HAS_RESIDUAL": True, "PRE_NORM": False, "SPLIT": 2, "BLOCK": 4096, **PDL,
       "num_warps": 8},
      {"HAS_RESIDUAL": True, "PRE_NORM": True, "SPLIT": 2, "BLOCK": 2048, **PDL,  # Ouro
       "num_warps": 8}]),
    (OPS + "silu_and_mul", "_silu_and_mul_kernel",
     {"GU": "*bf16", "Out": "*bf16", "stride_gu": "i32", "stride_o": "i32", "n_cols": "i32"},
     [{"BLOCK": 1024, **PDL, "num_warps": 4}, {"BLOCK": 1024, **NO_PDL, "num_warps": 4}]),
    (OPS + "rotary", "_rotary_kernel",  # rotate-half, cos/sin in the activation dtype
     {**_sig("Q K Cos Sin", "*bf16"), **_ROTARY_STRIDES},
     [_SMOL_ROPE]),
    (OPS + "rotary_pairs", "_rotary_pairs_kernel",  # Huginn: fp32 cos/sin, optional qk bias
     {**_sig("Q K QBias KBias", "*bf16"), **_sig("Cos Sin", "*fp32"), **_ROTARY_STRIDES},
     [{"HAS_BIAS": True, **_HUGINN_ROPE}, {"HAS_BIAS": False, **_HUGINN_ROPE}]),
    (OPS + "rotary_store_kv", "_rotary_store_kv_kernel",
     {**_sig("Q K V Cos Sin KCache VCache", "*bf16"), "Slots": "*i64", **_STORE_STRIDES},
     [{**_SMOL_ROPE, **PDL}, {**_SMOL_ROPE, **NO_PDL}]),
    (OPS + "rotary_store_kv", "_rotary_pairs_store_kv_kernel",
     {**_sig("Q K V QBias KBias", "*bf16"), **_sig("Cos Sin", "*fp32"),
      **_sig("KCache VCache", "*bf16"), "Slots": "*i64", **_STORE_STRIDES},
     [{"HAS_BIAS": True, **_HUGINN_ROPE, **PDL}, {"HAS_BIAS": False, **_HUGINN_ROPE, **NO_PDL}]),
    (OPS + "qkv_rope", "_qkv_rope_kernel",  # the served path: TMA, PDL, an L2 prefetch
     {"X": "*bf16", "W": "*bf16", "XD": _desc(64, 128), "WD": _desc(64, 128), **_QKV},
     [{"HAS_BIAS": False, "HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_M": 64,
       "BLOCK_K": 128, "PRECISION": None, "TMA": True, "PREFETCH_K": 256, "LINE": 64, **PDL,
       "num_warps": 4, "num_stages": 4}]),
    (OPS + "qkv_rope", "_qkv_rope_kernel",  # SmolLM2's heads of 64, a bias (as Qwen2's)
     {"X": "*bf16", "W": "*bf16", "XD": _desc(64, 128), "WD": _desc(16, 128), **_QKV},
     [{"HAS_BIAS": True, "HEAD_DIM": 64, "HALF": 32, "BLOCK_HALF": 16, "BLOCK_M": 64,
       "BLOCK_K": 128, "PRECISION": None, "TMA": True, "PREFETCH_K": 1024, "LINE": 64, **PDL,
       "num_warps": 4, "num_stages": 6},
      {"HAS_BIAS": True, "HEAD_DIM": 64, "HALF": 32, "BLOCK_HALF": 16, "BLOCK_M": 64,
       "BLOCK_K": 128, "PRECISION": None, "TMA": True, "PREFETCH_K": 0, "LINE": 64, **NO_PDL,
       "num_warps": 4, "num_stages": 6}]),
    (OPS + "qkv_rope", "_qkv_rope_kernel",  # tma=False: pointer loads
     {**_sig("X W XD WD", "*bf16"), **_QKV},
     [{"HAS_BIAS": True, "HEAD_DIM": 64, "HALF": 32, "BLOCK_HALF": 16, "BLOCK_M": 64,
       "BLOCK_K": 128, "PRECISION": None, "TMA": False, "PREFETCH_K": 0, "LINE": 64, **NO_PDL,
       "num_warps": 4, "num_stages": 6}]),
    (OPS + "decode_linear", "_decode_linear_kernel",  # o_proj / down: split-K fp32 partials
     {"X": "*bf16", "W": "*bf16", "XD": _desc(16, 128), "WD": _desc(64, 128), "B": "*bf16",
      **_sig("Y P AV AI", "*fp32"), **_LINEAR_INTS},
     [{**_LINEAR_CONSTS, "PARTIALS": True, **PDL, "TMA": True, "BLOCK_M": 16, "BLOCK_N": 64,
       "BLOCK_K": 128, "num_stages": 4}]),
    (OPS + "decode_linear", "_decode_linear_kernel",  # gate/up with the SiLU-mul epilogue
     {"X": "*bf16", "W": "*bf16", "XD": _desc(16, 128), "WD": _desc(32, 128),
      **_sig("B Y P AV AI", "*bf16"), **_LINEAR_INTS},
     [{**_LINEAR_CONSTS, "SWIGLU": True, **PDL, "TMA": True, "BLOCK_M": 16, "BLOCK_N": 32,
       "BLOCK_K": 128, "num_stages": 4}]),
    (OPS + "decode_linear", "_decode_linear_kernel",  # LM head: fp32 logits, argmax pass 1
     {"X": "*bf16", "W": "*bf16", "XD": _desc(16, 128), "WD": _desc(128, 128), "B": "*bf16",
      **_sig("Y P AV", "*fp32"), "AI": "*i32", **_LINEAR_INTS},
     [{**_LINEAR_CONSTS, "ROUND_TO_X": True, "ARGMAX": True, **PDL, "TMA": True,
       "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 4}]),
    (OPS + "decode_linear", "_decode_linear_kernel",  # no TMA (unaligned, or forced off)
     {**_sig("X W XD WD B Y P AV AI", "*bf16"), **_LINEAR_INTS},
     [{**_LINEAR_CONSTS, "HAS_BIAS": True, "SWIGLU": True, **NO_PDL, "TMA": False,
       "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 4}]),
    (OPS + "decode_linear", "_decode_linear_kernel",  # fp32 weights (the latent head): 3xTF32
     {**_sig("X W XD WD B Y P AV AI", "*fp32"), **_LINEAR_INTS},
     [{**_LINEAR_CONSTS, "HAS_BIAS": True, "PRECISION": "tf32x3", "SILU": silu, **PDL,
       "TMA": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 4}
      for silu in (True, False)]
     + [{**_LINEAR_CONSTS, "PARTIALS": True, "PRECISION": "tf32x3", **PDL, "TMA": False,
         "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 4}]),
    (OPS + "decode_linear", "_split_k_reduce_kernel",
     {"P": "*fp32", **_sig("B Y XT", "*bf16"), **_sig("M N stride_ym", "i32")},
     [{"HAS_BIAS": True, "SPLIT_K": 2, "ROUND_TO_X": False, **PDL, "SILU": False,
       "BLOCK": 1024, "num_warps": 4}]),
    (OPS + "decode_linear", "_split_k_reduce_kernel",  # the latent head's fp32 Linear + SiLU
     {**_sig("P B Y XT", "*fp32"), **_sig("M N stride_ym", "i32")},
     [{"HAS_BIAS": True, "SPLIT_K": 4, "ROUND_TO_X": False, **PDL, "SILU": True,
       "BLOCK": 1024, "num_warps": 4}]),
    (OPS + "decode_linear", "_split_k_reduce_kernel",  # fp32 logits of a bf16 x
     {"P": "*fp32", "B": "*bf16", "Y": "*fp32", "XT": "*bf16", **_sig("M N stride_ym", "i32")},
     [{"HAS_BIAS": False, "SPLIT_K": 4, "ROUND_TO_X": True, **NO_PDL, "SILU": False,
       "BLOCK": 1024, "num_warps": 4}]),
    (OPS + "lm_head", "_lm_head_persistent_kernel",  # 33..64 rows, 132 SMs
     {"XD": _desc(64, 128), "WD": _desc(128, 128), **_sig("X W B", "*bf16"), "Y": "*fp32",
      "AV": "*fp32", "AI": "*i32", **_sig("M N K stride_ym n_tiles", "i32")},
     [{"HAS_BIAS": False, "ROUND_TO_X": True, "PRECISION": None, **PDL, "NUM_PROGS": 132,
       "STAGES": 4, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
       "num_stages": 4},
      {"HAS_BIAS": True, "ROUND_TO_X": True, "PRECISION": None, **NO_PDL, "NUM_PROGS": 132,
       "STAGES": 4, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
       "num_stages": 4}]),
    # attention (Triton backend)
    (ATTN + "store_kv", "_store_kv_kernel",
     {**_sig("K V KCache VCache", "*bf16"), "Slots": "*i64",
      **_sig("stride_kt stride_kh stride_vt stride_vh stride_kc_s stride_kc_h stride_vc_s "
             "stride_vc_h", "i32")},
     [{"NUM_KV_HEADS": 3, "HEAD_DIM": 64, "BLOCK_H": 4, "BLOCK_D": 64, "num_warps": 1}]),
    (ATTN + "decode_attention", "_decode_stage1_kernel",
     {**_sig("Q KCache VCache", "*bf16"), **_sig("PageTable Rows", "*i64"), "KvLens": "*i32",
      **_sig("MidO MidLse", "*fp32"), "Out": "*bf16", "sm_scale_log2": "fp32",
      **_sig(_ATTN_STRIDES + " stride_pt " + _MID_STRIDES + " last_slot next_last", "i32"),
      "Next": "*bf16"},
     [{"GROUP": 4, "HEAD_DIM": 128, "NUM_SPLITS": 8, "BLOCK_H": 16, "BLOCK_N": 64,
       "BLOCK_D": 128, "DIRECT": False, "ROW_LINES": 2, "KV_LINE": 64, "NEXT_LINES": 64,
       "LINE": 64, **PDL, "num_warps": 4, "num_stages": 3},
      {"GROUP": 3, "HEAD_DIM": 64, "NUM_SPLITS": 1, "BLOCK_H": 16, "BLOCK_N": 128,
       "BLOCK_D": 64, "DIRECT": True, "ROW_LINES": 1, "KV_LINE": 64, "NEXT_LINES": 32,
       "LINE": 64, **PDL, "num_warps": 4, "num_stages": 3},  # o_proj's weight into L2
      {"GROUP": 3, "HEAD_DIM": 64, "NUM_SPLITS": 1, "BLOCK_H": 16, "BLOCK_N": 128,
       "BLOCK_D": 64, "DIRECT": True, "ROW_LINES": 1, "KV_LINE": 64, "NEXT_LINES": 0,
       "LINE": 1, **NO_PDL, "num_warps": 4, "num_stages": 3}]),
    (ATTN + "decode_attention", "_decode_stage2_kernel",
     {**_sig("MidO MidLse", "*fp32"), "KvLens": "*i32", "Out": "*bf16",
      **_sig(_MID_STRIDES + " stride_ot stride_oh", "i32")},
     [{"HEAD_DIM": 64, "NUM_SPLITS": 8, "BLOCK_N": 64, "BLOCK_D": 64, **PDL, "num_warps": 1},
      {"HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_N": 64, "BLOCK_D": 128, **NO_PDL,
       "num_warps": 2}]),
    (ATTN + "extend_attention", "_extend_kernel",
     {**_sig("Q KCache VCache Out", "*bf16"), **_sig("PageTable Rows", "*i64"),
      **_sig("QStart KvLens", "*i32"), "sm_scale_log2": "fp32",
      **_sig(_ATTN_STRIDES + " stride_pt", "i32")},
     [{"GROUP": 3, "HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64,
       "num_warps": 4},
      {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128,
       "num_warps": 8}]),
]

SCRIPT = """
import dataclasses, importlib, json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}  # the other keywords: constexprs
SHARED = 227 * 1024  # an sm_90 block's shared memory at most; more: OutOfResources at launch
failed = []
for module, name, sig, variants in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    for variant in variants:
        const = {k: v for k, v in variant.items() if k not in OPTIONS}
        given = {**sig, **dict.fromkeys(const, "constexpr")}
        try:
            if sorted(given) != sorted(kernel.arg_names):
                raise TypeError(f"the case gives {sorted(given)}, the kernel takes "
                                f"{kernel.arg_names}")
            attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
                     if given[p.name].startswith("*") and not p.do_not_specialize_on_alignment}
            src = ASTSource(fn=kernel, signature={n: given[n] for n in kernel.arg_names},
                            constexprs=const, attrs=attrs)
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={k: v for k, v in variant.items() if k in OPTIONS})
            assert out.asm["cubin"], "no cubin"
            assert out.metadata.shared <= SHARED, f"{out.metadata.shared} bytes of shared memory"
        except Exception:
            failed.append(f"{module}.{name} {variant}:\\n{traceback.format_exc()}")
print("\\n".join(failed), file=sys.stderr)
print("ok" if not failed else f"{len(failed)} failed")
"""


def test_kernels_compile_for_sm90():
    """All cases in one process (torch's import, not the compiles, is most of a process's
    time); its report names every kernel and variant that failed."""
    # neither the interpreter nor the switch letting compiled kernels read non-constexpr
    # globals (serving sets neither)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-8000:]


def _is_jit(decorator: ast.expr) -> bool:
    # @triton.jit, @triton.jit(...), @jit
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(node, ast.Attribute) and node.attr == "jit"
            or isinstance(node, ast.Name) and node.id == "jit")


def test_every_launched_kernel_has_a_case():
    """The cases name exactly the ``@triton.jit`` functions under ``src/latentserve``
    launched as ``f[grid](...)``, directly or through a wrapper such as
    ``triton.autotune(...)(f)``."""
    trees = {".".join(p.relative_to(SRC).with_suffix("").parts): ast.parse(p.read_text())
             for p in (SRC / "latentserve").rglob("*.py")}
    defined = {}  # kernel name -> modules defining it
    for module, tree in trees.items():
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef) and any(map(_is_jit, f.decorator_list)):
                defined.setdefault(f.name, set()).add(module)
    launched = set()
    for module, tree in trees.items():
        alias = {}  # e.g. _tuned = triton.autotune(...)(_kernel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                wrapped = [a.id for a in node.value.args
                           if isinstance(a, ast.Name) and a.id in defined]
                alias.update({t.id: wrapped[0] for t in node.targets
                              if wrapped and isinstance(t, ast.Name)})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)):
                name = alias.get(node.func.value.id, node.func.value.id)
                if name in defined:  # defined here, else where it is imported from
                    homes = {module} & defined[name] or defined[name]
                    launched |= {(home, name) for home in homes}
    covered = {c[:2] for c in CASES}
    assert launched == covered, (f"launched without a case: {sorted(launched - covered)}; "
                                 f"a case but not launched: {sorted(covered - launched)}")
