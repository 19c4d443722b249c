"""Plain decode benchmark: random Llama shapes through the engine, the decode step against
its bandwidth floor and HF ``generate``. Seconds, output tokens/s, bytes/s."""

from __future__ import annotations

from pathlib import Path

import torch

from latentserve.bench.baseline.tiny_models import save_tiny, save_word_tokenizer
from latentserve.bench.device_common import free_memory, make_engine, profile_replay, timed
from latentserve.bench.suite import dtype_for, engine_rows, greedy, random_batches
from latentserve.engine.cuda_graph import CudaGraphRunner

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
}
# ``tiny``: a 3-layer hidden-64 Llama (``tiny_models.save_tiny``), for runs on the CPU
TINY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024}
# the largest concurrency again with one engine option changed
VARIANTS = (("unfused", {"fused_ops": False}), ("sync", {"overlap_schedule": False}))
NOTES = {"ignore_eos": True, "goal": "decode step <= 1.5x its bandwidth floor at 64 concurrent"}


def save_random_llama(out_dir: Path, shape: dict, device: str = "cuda") -> Path:
    """A random bf16 Llama of ``shape`` (drawn on ``device``) with a word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    save_word_tokenizer(out_dir)
    return out_dir


def build_llama(root: Path, name: str, device: str) -> Path:
    """``save_random_llama`` of ``SHAPES[name]``, or for ``tiny`` a float32 ``TINY_SHAPE``."""
    if name == "tiny":
        return save_tiny(root, "llama", word_tokenizer=True, **TINY_SHAPE)
    return save_random_llama(root, SHAPES[name], device)


def _hf_run(model, prompts, output_len: int, device: str) -> float:
    """Output tokens/s of HF ``generate`` on ``prompts`` as one padded batch."""
    ids = torch.tensor(prompts, device=device)
    _, wall = timed(device, lambda: model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
        min_new_tokens=output_len, pad_token_id=0))
    return len(prompts) * output_len / wall


def _inject_cost(engine, bs: int, iters: int = 50) -> dict:
    """Replay time (s) of a decode graph with the latent inject buffers bound vs without."""
    r = engine.runner
    z = torch.zeros(bs, dtype=torch.int64, device="cuda")
    kv = torch.full((bs,), 384, dtype=torch.int32, device="cuda")
    rows = torch.full((bs,), r.table.dummy_row, dtype=torch.int64, device="cuda")
    out = {}
    for key, capable in (("with_inject_s", True), ("without_inject_s", False)):
        g = CudaGraphRunner(r.model, r.backend, r.kv_pool, r.table, bs,
                            r.graphs.embeds.shape[1], r.graphs.embeds.dtype,
                            latent_capable=capable)
        for _ in range(3):
            g.replay(z, z, rows, kv, z)
        out[key] = timed("cuda", lambda g=g: [g.replay(z, z, rows, kv, z)
                                              for _ in range(iters)])[1] / iters
    out["overhead_pct"] = 100 * (out["with_inject_s"] / out["without_inject_s"] - 1)
    return out


def bench_model(name: str, root: Path, bw: float, device: str, concurrency,
                prompt_len: int = 256, output_len: int = 256, hf_baseline: bool = True,
                variants: bool = True) -> dict:
    """One shape (``SHAPES`` key, or ``tiny``): ``engine_rows`` (with ``kernels`` and
    ``inject_cost`` on CUDA), with ``variants`` the ``VARIANTS``, with ``hf_baseline`` HF
    ``generate`` on the same batches padded and on one prompt."""
    dtype, cuda, max_c = dtype_for(device), device.startswith("cuda"), max(concurrency)
    path = build_llama(root / name, name, device)
    max_len = prompt_len + output_len + 8
    sp, warm = greedy(output_len), greedy(8)
    batches = random_batches(concurrency, prompt_len)

    def run(conc, inject: bool = False, **opts):  # -> (rows, inject cost or None)
        engine = make_engine(path, device, dtype, max(conc), max_len, **opts)
        rows, _ = engine_rows(engine, sp, {c: batches[c] for c in conc}, device, bw, warm)
        graphs = engine.runner.graphs
        for c in conc if cuda else ():  # c's bucket's decode graph on the last step's inputs
            b = next(x for x in graphs.buckets if x >= c)
            rows[c]["kernels"] = {"bucket": b,
                                  **profile_replay(graphs.graphs[graphs.graph_depths[0], b])}
        cost = _inject_cost(engine, max_c) if inject else None
        del engine, graphs
        free_memory(device)
        return rows, cost

    rows, inject = run(concurrency, inject=cuda)
    for key, opts in VARIANTS if variants else ():
        rows[max_c][key] = run((max_c,), **opts)[0][max_c]
    if hf_baseline:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        hf = hf.to(device).eval()
        _hf_run(hf, batches[max_c][:1], 8, device)  # warm-up
        tps1 = _hf_run(hf, batches[max_c][:1], output_len, device)
        for c in concurrency:
            tps = _hf_run(hf, batches[c], output_len, device)
            rows[c].update(hf_padded_batch_tok_s=tps, speedup=rows[c]["tok_s"] / tps,
                           hf_batch1_tok_s=tps1, speedup_vs_hf_batch1=rows[c]["tok_s"] / tps1)
        del hf
    return {"shape": SHAPES.get(name, TINY_SHAPE), "max_model_len": max_len,
            "concurrency": rows, "inject_cost": inject}
