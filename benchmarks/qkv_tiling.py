"""The fused q/k/v projection + RoPE + KV store (``ops.kernels.qkv_rope``) on the GPU: its
time per call at each ``block_half`` and stage count, for the decode shapes of the benchmark
models, against ``decode_linear`` on the same merged weight (the plain GEMM, no epilogue).
Usage: ``python -m benchmarks.qkv_tiling [OUT.json] [--rows 1,16,64]``. Needs CUDA.

Weights are cold as in a decode step: each timed graph cycles through enough copies of the
merged weight to exceed twice the L2 cache. Shapes (hidden, q heads, kv heads, head dim) are
those of ``latentserve.bench.gpu`` / ``recurrent_gpu``'s models."""

from __future__ import annotations

import sys

from benchmarks.common import command, parser, write_json

NAME = "qkv_tiling"

SHAPES = {"llama-3.2-1b": (2048, 32, 8, 64), "ouro-1.4b": (2048, 16, 16, 128),
          "huginn-0125": (5280, 55, 55, 96), "smollm2-135m": (576, 9, 3, 64)}
BLOCK_HALVES = (16, 32, 64, 128)
STAGES = (3, 6)


def _cycled(fn, weights):
    """A call of ``fn(w)`` on the next of ``weights`` (round robin), for ``time_graph``."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(w)
    return call


def _time_shape(name: str, rows: list[int], l2: int) -> list[dict]:
    """One result row per batch size in ``rows`` for shape ``name`` (``SHAPES``)."""
    import torch
    import triton

    from latentserve.bench.device_common import time_graph
    from latentserve.ops.kernels.decode_linear import decode_linear
    from latentserve.ops.kernels.qkv_rope import default_block_half, qkv_rope_store_kv

    hidden, nq, nkv, d = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_w = (nq + 2 * nkv) * d
    nbytes = rows_w * hidden * 2
    copies = max(2, -(-2 * l2 // nbytes))
    ws = [torch.randn(rows_w, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies)]
    kc = torch.zeros(4097, nkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    out = []
    for m in rows:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(1, m + 1, device="cuda")
        row = {"shape": name, "rows": m, "weight_bytes": nbytes, "copies": copies,
               "block_half_before": default_block_half(d // 2),
               "block_half_rule": default_block_half(d // 2, nq + 2 * nkv, m, sms),
               "us": {}}
        us, g = time_graph(_cycled(lambda w, x=x: decode_linear(x, w), ws), calls=copies)
        del g
        row["decode_linear_us"] = round(us, 2)
        for bh in BLOCK_HALVES:
            if bh > max(16, triton.next_power_of_2(d // 2)):
                continue
            for st in STAGES:
                def qkv(w, x=x, cos=cos, sin=sin, slots=slots, bh=bh, st=st):
                    return qkv_rope_store_kv(x, w, None, cos, sin, kc, vc, slots, nq, nkv,
                                             block_half=bh, num_stages=st)
                us, g = time_graph(_cycled(qkv, ws), calls=copies)
                del g
                row["us"][f"{bh}x{st}"] = round(us, 2)
        best = min(row["us"], key=row["us"].get)
        row["best"], row["best_TBps"] = best, round(nbytes / row["us"][best] / 1e6, 3)
        row["before_us"] = row["us"].get(f"{row['block_half_before']}x6")
        row["rule_us"] = row["us"].get(f"{row['block_half_rule']}x6")
        out.append(row)
        print(name, m, "before", row["before_us"], "rule", row["rule_us"], "best", best,
              row["us"][best],
              "decode_linear", row["decode_linear_us"], file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(NAME, __doc__)
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    import torch

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"device": torch.cuda.get_device_name(), "l2_bytes": l2, "shapes": []}
    for name in args.shapes.split(","):
        result["shapes"] += _time_shape(name, [int(r) for r in args.rows.split(",")], l2)
        torch.cuda.empty_cache()
    result["command"] = command(NAME, argv)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
