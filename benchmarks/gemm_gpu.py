"""Small-M GEMM microbenchmark for the H200 (issue 3): cuBLAS (``F.linear``, bf16) against a
column-tiled Triton kernel at the Llama-3.2-1B decode shapes, M = 64 and 16 rows.

Each timing replays a CUDA graph of 20 back-to-back launches (no host gaps) and reports
microseconds per launch; the Triton figure is the best of 18 tilings (column tile 16/32/64,
K tile 64/128/256, 3 or 5 stages). ``floor_us``: the weight bytes over 4.28 TB/s, the copy
bandwidth the decode benchmark measured on the H200. The result decided that the decode
path keeps cuBLAS (docs/benchmarks-history.md).

Run on the H200: ``python -m benchmarks.gemm_gpu OUT.json``.
"""

from __future__ import annotations

import itertools
import json

from benchmarks.common import parser, write_json

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}  # (N, K) of the Llama-1B shape
COPY_BW = 4.28e12  # bytes per second (bench.gpu's copy bandwidth on the H200)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(X, W, Y, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
        pn, pm = tl.program_id(0), tl.program_id(1)
        om = pm * BM + tl.arange(0, BM)
        on = pn * BN + tl.arange(0, BN)
        ok = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + ok
            x = tl.load(X + om[:, None] * sxm + k[None, :],
                        mask=(om < M)[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(W + on[None, :].to(tl.int64) * swn + k[:, None],
                        mask=(k < K)[:, None] & (on < N)[None, :], other=0.0)
            acc = tl.dot(x, w, acc)
        tl.store(Y + om[:, None] * sym + on[None, :], acc.to(Y.dtype.element_ty),
                 mask=(om < M)[:, None] & (on < N)[None, :])

    return gemm


def _time_us(fn) -> float:
    """Microseconds per launch of ``fn``: 20 launches per CUDA graph, 5 replays."""
    from latentserve.bench.device_common import time_graph

    return time_graph(fn, calls=20, replays=5)[0]


def run_gemm_bench(rows=(64, 16)) -> dict:
    """``{"<shape>_M<rows>": {cublas_us, floor_us, triton_best_us, triton_cfg [BN, BK,
    stages, warps], triton_err (max abs difference from cuBLAS)}}``."""
    import torch
    import torch.nn.functional as F
    import triton

    gemm = _kernel()
    out = {}
    for m in rows:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)

            def launch(bn, bk, st, x=x, w=w, y=y, m=m, n=n, k=k):
                gemm[(triton.cdiv(n, bn), triton.cdiv(m, 64))](
                    x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                    BM=64, BN=bn, BK=bk, num_warps=4, num_stages=st)

            row = {"cublas_us": _time_us(lambda x=x, w=w: F.linear(x, w)),
                   "floor_us": n * k * 2 / COPY_BW * 1e6}
            best = None
            for bn, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 5)):
                try:
                    launch(bn, bk, st)
                    err = float((y.float() - ref.float()).abs().max())
                    t = _time_us(lambda bn=bn, bk=bk, st=st: launch(bn, bk, st))
                except Exception:  # noqa: BLE001, S112 - a tiling that does not fit is skipped
                    continue
                if best is None or t < best[0]:
                    best = (t, [bn, bk, st, 4], err)
            row["triton_best_us"], row["triton_cfg"], row["triton_err"] = best
            out[f"{name}_M{m}"] = row
            print(name, m, json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = parser("gemm_gpu", __doc__)
    p.add_argument("out", nargs="?", default="gemm_gpu.json", help="JSON output path")
    write_json(p.parse_args(argv).out, run_gemm_bench())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
