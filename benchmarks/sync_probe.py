"""Where the host waits for the device in an engine's steady decode steps: every call that
synchronizes (``torch.cuda.set_sync_debug_mode("warn")``: a blocking copy, ``.item()``,
``.tolist()`` of a device tensor, a stream sync; not ``Event.synchronize``), with the stack of
latentserve frames that made it, counted over ``--steps`` steps of a full batch. An
overlapped engine that syncs on anything but the previous step's event waits for its own
forward. Usage:
``python -m benchmarks.sync_probe [OUT.json] [--models a,b] [--variants a,b] [--batch 64]``.

Models: those of ``benchmarks.family_profile`` (random bf16 weights) and ``smollm2``
(SmolLM2-135M's shape; with ``--tokenizer DIR`` its JSON-schema variant too). Variants:
``greedy``; ``t1`` (temperature 1, unseeded); ``mixed`` (temperatures 0.7 and 1.0, top-k 50,
top-p 0.9, min-p 0.05 across the rows); ``seeded`` (temperature 1, a seed per request);
``json`` (a JSON schema per request, temperature 1; smollm2 with a tokenizer only).
Each row: ``{"steps", "step_ms" (mean, probe off), "syncs": [{"count", "stack"}]}``.
Needs CUDA.
"""

from __future__ import annotations

import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

from benchmarks import common
from benchmarks.host import steady_step_ms

VARIANTS = ("greedy", "t1", "mixed", "seeded", "json")
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}},
          "required": ["title"]}


def _fields(variant: str, i: int) -> dict:
    if variant == "greedy":
        return {"temperature": 0.0}
    if variant == "t1":
        return {"temperature": 1.0}
    if variant == "seeded":
        return {"temperature": 1.0, "seed": i}
    if variant == "json":
        return {"temperature": 1.0, "structured_outputs": {"json": SCHEMA}}
    return {"temperature": (0.7, 1.0)[i % 2], "top_k": 50, "top_p": 0.9, "min_p": 0.05}


def _stack() -> tuple[str, ...]:
    frames = [f for f in traceback.extract_stack()[:-2]
              if "latentserve" in f.filename or "benchmarks" in f.filename]
    return tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-7:])


def probe(engine, fields: dict, variant: str, batch: int, steps: int, tag: str) -> dict:
    """Run ``batch`` requests of ``variant``; once every row decodes, time ``steps`` steps,
    then count the syncs of ``steps`` more."""
    import torch

    from latentserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (batch, 32), generator=g).tolist()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{variant}-{i}", p, SamplingParams(
            max_tokens=2 * steps + 24, ignore_eos=variant != "json", **fields,
            **_fields(variant, i)))
    step_ms = steady_step_ms(engine, steps)
    seen: Counter = Counter()
    show = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):
        seen[_stack()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        warnings.showwarning = hook  # after: enabling the mode warns once itself
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    while engine.has_unfinished_requests():
        engine.step()
    return {"steps": steps, "step_ms": round(step_ms, 3),
            "syncs": [{"count": n, "stack": list(s)} for s, n in seen.most_common()]}


def _engine(name: str, root: Path, batch: int, tokenizer: str | None):
    import torch

    from latentserve.bench.device_common import make_engine

    if name == "smollm2":
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "bench_structured_gpu", Path(__file__).parents[1] / "scripts/bench_structured_gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if tokenizer:
            path = mod.build_model(tokenizer, root / name)
        else:
            from latentserve.bench.gpu import build_llama

            path = build_llama(root / name, "smollm2-135m", "cuda")
        fields: dict = {}
    elif name == "coconut-gpt2-124m":
        from latentserve.bench.latent import build_coconut_gpt2

        path, fields = build_coconut_gpt2(root / name), {"latent_budget": 6}
    else:
        from benchmarks.family_profile import _build

        path, fields = _build(name, root)
    engine = make_engine(path, "cuda", "bfloat16", batch, 512, kv_slots=(batch + 1) * 512)
    engine.warmup()
    torch.cuda.synchronize()
    return engine, fields


def main(argv: list[str] | None = None) -> None:
    p = common.parser("sync_probe", __doc__)
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--models", default="smollm2,codi-llama-3.2-1b,head-llama-3.2-1b,ouro-1.4b,"
                                        "coconut-gpt2-124m")
    p.add_argument("--variants", default="greedy,t1,mixed,seeded,json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tokenizer", default=None)
    args = p.parse_args(argv)
    result = {"command": common.command("sync_probe", argv), "models": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            engine, fields = _engine(name, Path(d), args.batch, args.tokenizer)
            rows = result["models"][name] = {"fields": fields}
            for v in args.variants.split(","):
                if v == "json" and not (name == "smollm2" and args.tokenizer):
                    continue
                try:
                    rows[v] = probe(engine, fields, v, args.batch, args.steps, name)
                except Exception as e:  # noqa: BLE001 - one variant's failure is a result
                    rows[v] = {"error": repr(e)}
                r = rows[v]
                print(name, v, r.get("step_ms"), "ms,",
                      sum(s["count"] for s in r.get("syncs", [])), "syncs", r.get("error", ""),
                      flush=True)
                for s in r.get("syncs", [])[:4]:
                    print("   ", s["count"], " <- ".join(reversed(s["stack"][-3:])), flush=True)
            del engine
            import torch

            torch.cuda.empty_cache()
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
