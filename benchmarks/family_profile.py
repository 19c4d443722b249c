"""Where a family's decode step goes on the GPU: the device operations of one replay of each
CUDA graph the engine captured at the largest batch (``torch.profiler``), for the shapes that
miss issue 27's goals (Ouro-1.4B, CODI and the compression head on Llama-3.2-1B), with the
plain Llama-3.2-1B beside them. Usage:
``python -m benchmarks.family_profile [OUT.json] [model,model] [--batch 64]``.

Models: ``ouro-1.4b``, ``codi-llama-3.2-1b``, ``head-llama-3.2-1b``, ``llama-3.2-1b``.
Each is built with random bf16 weights (``latentserve.bench``'s builders), its engine runs
one batch of ``--batch`` requests (so every graph is captured and warm), then each captured
graph of that bucket is timed (CUDA events, ``device_common.time_replays``) and profiled
(``device_common.profile_replay``). Needs CUDA.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import common

MODELS = ("ouro-1.4b", "codi-llama-3.2-1b", "head-llama-3.2-1b", "llama-3.2-1b")


def _build(name: str, root: Path) -> tuple[Path, dict]:
    """The model directory of ``name`` and the sampling fields its requests need."""
    import torch

    if name == "ouro-1.4b":
        from latentserve.bench.baseline import recurrent_models as rm
        from latentserve.bench.recurrent_gpu import OURO_1_4B

        path = rm.write_ouro(root / name, save_dtype=torch.bfloat16, init_device="cuda",
                             **OURO_1_4B)
        return path, {"latent_budget": 4, "exit_criterion": "last"}
    if name == "codi-llama-3.2-1b":
        from latentserve.bench.latent import build_codi_llama_1b

        return build_codi_llama_1b(root / name), {"latent_budget": 6}
    if name == "head-llama-3.2-1b":
        from latentserve.bench.head_gpu import build_head_model

        return build_head_model(root, "llama-3.2-1b"), {"latent_budget": 16}
    from latentserve.bench.gpu import build_llama

    return build_llama(root, "llama-3.2-1b", "cuda"), {}


def profile_model(name: str, root: Path, batch: int, output_len: int = 48) -> dict:
    """Run ``batch`` requests of ``name`` through a CUDA-graph engine, then time and profile
    each captured graph of the ``batch`` bucket: ``{graph key: {replay_us, ...profile}}``."""
    import torch

    from latentserve.bench.device_common import make_engine, profile_replay, time_replays
    from latentserve.sampling_params import SamplingParams

    path, fields = _build(name, root)
    engine = make_engine(path, "cuda", "bfloat16", batch, 64 + output_len + 8,
                         kv_slots=(batch + 1) * (64 + output_len + 8))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (batch, 64), generator=g).tolist()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, **fields)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    graphs = engine.runner.graphs
    out: dict = {"model": name, "batch": batch, "fields": fields}
    found = {f"decode depth {d}": gr for (d, b), gr in graphs.graphs.items() if b == batch}
    for key, graph in found.items():
        out[key] = {"replay_us": time_replays(graph, 100), **profile_replay(graph)}
        print(name, key, round(out[key]["replay_us"], 1), "us,",
              out[key]["device_ops"], "ops", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = common.parser("family_profile", __doc__)
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("models", nargs="?", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    result = {"command": common.command("family_profile", argv), "models": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            result["models"][name] = profile_model(name, Path(d), args.batch)
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
