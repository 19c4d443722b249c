"""The decode step's layer chain without attention, on the H200 (issue 3): how much of a
batch-64 Llama-3.2-1B step the GEMM choice and programmatic dependent launch (PDL) save.

1. Per GEMM shape (q/k/v, o, gate/up, down, LM head; M = 64): cuBLAS against
   ``ops.kernels.decode_linear`` over a few tilings with PDL (20 back-to-back launches per
   CUDA graph; a split tiling includes its reduce kernel), and the best without PDL.
2. The 16-layer chain a decode step runs apart from RoPE and attention, captured in one
   CUDA graph: cuBLAS (RMSNorm, q/k/v, o_proj, add + RMSNorm, gate/up, SiLU-mul, down; the
   final norm; the LM head and its fp32 cast: the engine before ``decode_linear``), and the
   engine's decode path (o_proj and down hand split-K partial sums to the RMSNorm kernel,
   SiLU-mul in the gate/up epilogue, fp32 logits; q/k/v stays cuBLAS) without and with
   PDL. Reported: microseconds per replay against the weights' read floor at 4.28 TB/s.

Run on the H200: ``python -m benchmarks.layer_gpu OUT.json [ROWS] [--ouro]`` (ROWS: the
batch, default 64; ``--ouro``: step 1 only, at Ouro-1.4B's shapes).
"""

from __future__ import annotations

import json
import os

from benchmarks.common import parser, write_json

HIDDEN, INTER, QKV, VOCAB, LAYERS, EPS = 2048, 8192, 3072, 128256, 16, 1e-5
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
# Ouro-1.4B (hidden 2048, 16 heads of 128 without GQA, intermediate 5632): GEMMs only
OURO_SHAPES = {"qkv": (3 * 2048, 2048), "o": (2048, 2048), "gate_up": (2 * 5632, 2048),
               "down": (2048, 5632)}
COPY_BW = 4.28e12


def _set_pdl(on: bool) -> None:
    os.environ["LATENTSERVE_PDL"] = "1" if on else "0"


def gemm_sweep(rows: int = 64, shapes: dict = SHAPES) -> dict:
    """Per shape of ``shapes`` (name -> ``(N, K)``): cuBLAS us, and ``decode_linear`` us per
    tiling (PDL + prefetch, PDL only, none for the best)."""
    import torch
    import torch.nn.functional as F

    from latentserve.bench.device_common import time_graph
    from latentserve.ops.kernels.decode_linear import decode_linear, pick_tiling

    out = {}
    for name, (n, k) in shapes.items():
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(x, w).float()
        row = {"floor_us": n * k * 2 / COPY_BW * 1e6,
               "cublas_us": time_graph(lambda x=x, w=w: F.linear(x, w), 20, 5)[0],
               "picked": list(pick_tiling(rows, n, k)), "tilings": {}}
        _set_pdl(True)
        best = None
        for bn in (32, 64, 128):
            for sk in (1, 2, 4, 8):
                if k // sk < 512 or (n // bn) * sk > 1200:
                    continue
                for st in (3, 4, 6):
                    key = f"bn{bn}_sk{sk}_st{st}"
                    try:
                        def fn(bn=bn, sk=sk, st=st, x=x, w=w):
                            return decode_linear(x, w, block_n=bn, block_k=128, split_k=sk,
                                                 num_stages=st)
                        err = float((fn().float() - ref).abs().max())
                        t = time_graph(fn, 20, 5)[0]
                    except Exception as e:  # noqa: BLE001 - a tiling that fails is reported
                        row["tilings"][key] = repr(e)[:200]
                        continue
                    row["tilings"][key] = [round(t, 2), err]
                    if best is None or t < best[0]:
                        best = (t, bn, sk, st)
        if best:
            t, bn, sk, st = best
            row["best"] = {"us": t, "block_n": bn, "split_k": sk, "stages": st}
            _set_pdl(False)
            row["best_no_pdl_us"] = time_graph(
                lambda: decode_linear(x, w, block_n=bn, block_k=128, split_k=sk,  # noqa: B023
                                      num_stages=st), 20, 5)[0]  # noqa: B023 - timed here
        out[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "tilings"}), flush=True)
    return out


def chain(rows: int = 64) -> dict:
    """Replay time of the 16-layer chain per variant (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from latentserve.bench.device_common import profile_replay, time_graph
    from latentserve.ops.kernels import rms_norm, silu_and_mul
    from latentserve.ops.kernels.decode_linear import decode_linear

    dev, dt = "cuda", torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt) / shape[-1] ** 0.5

    layers = [{"wi": torch.ones(HIDDEN, device=dev, dtype=dt), "qkv": rand(QKV, HIDDEN),
               "o": rand(HIDDEN, HIDDEN), "wp": torch.ones(HIDDEN, device=dev, dtype=dt),
               "gate_up": rand(2 * INTER, HIDDEN), "down": rand(HIDDEN, INTER)}
              for _ in range(LAYERS)]
    lm = rand(VOCAB, HIDDEN)
    wf = torch.ones(HIDDEN, device=dev, dtype=dt)
    x0 = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
    floor_us = (sum(w.numel() for ly in layers for w in ly.values()) + lm.numel()) * 2 \
        / COPY_BW * 1e6

    def make(kind):
        def step():
            x, res = x0, None
            for ly in layers:
                if res is None:
                    h, res = rms_norm(x, ly["wi"], EPS), x
                else:
                    h, res = rms_norm(x, ly["wi"], EPS, res)
                qkv = F.linear(h, ly["qkv"])
                if kind == "cublas":
                    o = F.linear(qkv[:, :HIDDEN], ly["o"])
                    h, res = rms_norm(o, ly["wp"], EPS, res)
                    x = F.linear(silu_and_mul(F.linear(h, ly["gate_up"])), ly["down"])
                else:
                    o = decode_linear(qkv[:, :HIDDEN], ly["o"], partials=True)
                    h, res = rms_norm(o, ly["wp"], EPS, res)
                    act = decode_linear(h, ly["gate_up"], swiglu=True)
                    x = decode_linear(act, ly["down"], partials=True)
            h, _ = rms_norm(x, wf, EPS, res)
            if kind == "cublas":
                return F.linear(h, lm).float()
            return decode_linear(h, lm, out_dtype=torch.float32)
        return step

    out = {"floor_us": floor_us}
    ref = None
    for kind, pdl in (("cublas", False), ("decode", False), ("decode_pdl", True)):
        _set_pdl(pdl)
        try:
            fn = make(kind)
            us, graph = time_graph(fn, 1, 50)
            logits = fn().float()
            if ref is None:
                ref = logits
            out[kind] = {"us": us, "over_floor": us / floor_us,
                         "max_abs_diff_vs_cublas": float((logits - ref).abs().max()),
                         "argmax_equal_rows": int((logits.argmax(-1) == ref.argmax(-1)).sum()),
                         "profile": profile_replay(graph)}
        except Exception as e:  # noqa: BLE001 - report the failing variant, run the others
            out[kind] = {"error": repr(e)[:500]}
        print(kind, json.dumps({k: v for k, v in out[kind].items() if k != "profile"}),
              flush=True)
    return out


def main(argv=None) -> int:
    p = parser("layer_gpu", __doc__)
    p.add_argument("out", nargs="?", default="layer_gpu.json", help="JSON output path")
    p.add_argument("rows", nargs="?", type=int, default=64, help="decode rows (default 64)")
    p.add_argument("--ouro", action="store_true",
                   help="Ouro-1.4B's GEMM shapes instead (no chain)")
    args = p.parse_args(argv)
    if args.ouro:
        write_json(args.out, {"rows": args.rows, "model": "ouro-1.4b",
                              "gemms": gemm_sweep(args.rows, OURO_SHAPES)})
        return 0
    write_json(args.out, {"rows": args.rows, "gemms": gemm_sweep(args.rows),
                          "chain": chain(args.rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
