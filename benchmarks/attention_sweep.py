"""Decode attention alone, per model shape, over its launch settings: microseconds per call of
``decode_attention`` (16 calls per CUDA graph, each on its own layer's KV so that L2 holds
none of it) for KV splits x keys per tile x warps, against the call's KV bytes over the copy
bandwidth. Usage:
``python -m benchmarks.attention_sweep [OUT.json] [--shapes ouro,huginn] [--ctx 100,400]``.

Shapes (heads, KV heads, head_dim): ``ouro`` (Ouro-1.4B, 16/16/128), ``llama`` (Llama-3.2-1B,
32/8/64), ``smollm2`` (9/3/64), ``huginn`` (Huginn-0125, 55/55/96). 64 requests (``--batch``),
every request ``ctx`` keys on random pages, bf16. The row ``default`` is what
``TritonBackend`` picks today. Needs CUDA.
"""

from __future__ import annotations

from benchmarks import common

SHAPES = {"ouro": (16, 16, 128), "llama": (32, 8, 64), "smollm2": (9, 3, 64),
          "huginn": (55, 55, 96)}
LAYERS = 16


def sweep(shape: str, batch: int, ctx: int, bw: float) -> dict:
    import torch

    from latentserve.attention.kernels.decode_attention import decode_attention
    from latentserve.attention.triton_backend import TritonBackend
    from latentserve.bench.device_common import time_graph

    heads, kv_heads, d = SHAPES[shape]
    slots = batch * ctx
    g = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(slots + 1, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    page = torch.randperm(slots, device="cuda", generator=g).view(batch, ctx)
    rows = torch.arange(batch, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    backend = TritonBackend()
    splits0 = backend.decode_splits(batch, kv_heads, q.device)
    tile0 = backend.decode_tile(splits0, d)
    kv_bytes = 2 * batch * ctx * kv_heads * d * 2
    rows_out = []
    configs = [("default", splits0, tile0, 4)] + [
        (f"s{s}_n{n}_w{w}", s, n, w) for s in (1, 2, 4, 8) for n in (16, 32, 64, 128)
        for w in (4, 8) if n * s <= 2 * max(ctx, 64)]
    ref = None
    for name, s, n, w in configs:
        mid_o = torch.empty(batch, heads, s, d, device="cuda")
        mid_lse = torch.empty(batch, heads, s, device="cuda")
        calls = iter(range(1 << 30))

        def fn(s=s, n=n, w=w, mid_o=mid_o, mid_lse=mid_lse, calls=calls):
            i = next(calls) % LAYERS
            decode_attention(q, ks[i], vs[i], page, rows, lens, d ** -0.5, out=out,
                             num_kv_splits=s, block_n=n, mid_o=mid_o, mid_lse=mid_lse,
                             num_warps=w)
        try:
            us, _ = time_graph(fn, calls=LAYERS, replays=50)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            rows_out.append({"config": name, "error": repr(e)[:200]})
            continue
        if ref is None:
            ref = out.clone()
        err = (out.float() - ref.float()).abs().max().item()
        rows_out.append({"config": name, "splits": s, "block_n": n, "num_warps": w,
                         "us": round(us, 2), "x_floor": round(us / (kv_bytes / bw * 1e6), 2),
                         "max_abs_diff": err})
    best = min((r for r in rows_out if "us" in r), key=lambda r: r["us"])
    print(shape, ctx, "default", rows_out[0].get("us"), "best", best["config"], best["us"],
          flush=True)
    return {"shape": shape, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes,
            "floor_us": round(kv_bytes / bw * 1e6, 2), "best": best["config"], "rows": rows_out}


def main(argv: list[str] | None = None) -> None:
    p = common.parser("attention_sweep", __doc__)
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--shapes", default="ouro,huginn")
    p.add_argument("--ctx", default="100,400")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    from latentserve.bench.device_common import copy_bandwidth

    bw = copy_bandwidth("cuda")
    result = {"command": common.command("attention_sweep", argv), "copy_bw": bw, "runs": []}
    for shape in args.shapes.split(","):
        for ctx in map(int, args.ctx.split(",")):
            result["runs"].append(sweep(shape, args.batch, ctx, bw))
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
