"""The compression head's float32 Linears on the GPU: which ``decode_linear`` tiling each
layer wants, and the whole head (``LatentHead.serve_outputs``) per CUDA graph replay with
each candidate rule. Usage: ``python -m benchmarks.head_tiling [OUT.json] [--rows 64]``.

The head is the Llama-3.2-1B-shaped random head of ``latentserve.bench.head_gpu`` (hidden
2048, latent 512, MLP 1024; eight Linears, 32 MB of float32 weights). For every Linear
``[n, k]`` it times ``decode_linear`` (3xTF32, SiLU epilogue where the head has one) at each
``block_n`` x ``split_k`` (ten calls per graph, CUDA events), then the head's serve path
per replay on ``--rows`` anchors: float32 torch, and ``decode_linear`` with its default
tiling and with ``latent.head.fp32_tiling``. Needs CUDA. (Session 29's run also timed the
``small_linear`` kernel the head ran on before; docs/benchmarks.md.)"""

from __future__ import annotations

import sys

from benchmarks.common import command, parser, write_json

NAME = "head_tiling"

BLOCK_NS = (16, 32, 64)
SPLITS = (1, 2, 4, 8, 16)


def _linears(head, latent_dim: int) -> list[tuple[str, object, object, bool]]:
    """``(name, weight, bias, silu)`` of each Linear the fused serve path launches."""
    import torch.nn as nn

    out = []
    for part, seq in (("policy", head.reasoning_head.net), ("decoder", head.decoder.net),
                      ("stop", head.reasoning_head.stop_head)):
        lins = [m for m in seq if isinstance(m, nn.Linear)]
        for i, lin in enumerate(lins):
            last = i == len(lins) - 1
            w, b = lin.weight, lin.bias
            if part == "policy" and last:
                w, b = w[:latent_dim], b[:latent_dim]
            out.append((f"{part}{i}", w, b, not last))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(NAME, __doc__)
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args(argv)
    import torch

    from latentserve.bench.device_common import time_graph
    from latentserve.bench.head_gpu import HEADS
    from latentserve.latent.bundle import random_bundle
    from latentserve.ops.kernels.decode_linear import decode_linear, pick_tiling

    cfg = HEADS["llama-3.2-1b"]
    hidden, lat = 2048, cfg["latent_dim"]
    head = random_bundle(hidden, lat, source_layer=cfg["source_layer"], seed=0,
                         stop_bias=0.0).build().to("cuda").eval()
    m = args.rows
    result = {"device": torch.cuda.get_device_name(), "rows": m, "layers": [], "head": {}}
    for name, w, b, silu in _linears(head, lat):
        n, k = w.shape
        x = torch.randn(m, k, device="cuda")
        row = {"layer": name, "n": n, "k": k, "silu": silu,
               "default_tiling": list(pick_tiling(m, n, k)), "us": {}}
        for bn in BLOCK_NS:
            for sk in SPLITS:
                if k // sk < 64:
                    continue
                us, g = time_graph(lambda x=x, w=w, b=b, s=silu, bn=bn, sk=sk: decode_linear(
                    x, w, b, silu=s, block_n=bn, split_k=sk), calls=10)
                del g
                row["us"][f"{bn}x{sk}"] = round(us, 2)
        row["best"] = min(row["us"], key=row["us"].get)
        result["layers"].append(row)
        print(name, n, k, row["best"], row["us"][row["best"]], file=sys.stderr)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    from latentserve.latent import head as head_mod

    rule = head_mod.fp32_tiling
    for name, fused, tiling in (("torch_fp32", False, rule),
                                ("decode_linear_default_tiling", True,
                                 lambda m, k, n: (None, None)),
                                ("decode_linear_fp32_tiling", True, rule)):
        head_mod.fp32_tiling = tiling
        us, g = time_graph(lambda f=fused: head.serve_outputs(x, fused=f))
        del g
        result["head"][name] = round(us, 2)
    head_mod.fp32_tiling = rule
    result["command"] = command(NAME, argv)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
