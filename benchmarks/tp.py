"""Tensor-parallel benchmark (issue 10): output throughput at a fixed concurrency for TP=1
and TP=2 on random-weight checkpoints of real shapes (bf16, CUDA graphs), the Llama-3.2-1B
shape and the Huginn-0125 shape (32 recurrences per token).

Run on a machine with 2 GPUs: ``python -m benchmarks.tp --json-out PATH``. Each
(shape, TP size) runs in its own process so GPU memory starts clean. Throughput in output
tokens per second, times in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import command, parser, write_json

# (prompt_len, output_len) per shape: Huginn's KV is 132 banks deep, so its requests are
# shorter to keep 64 of them in memory at TP=1.
LENGTHS = {"llama-3.2-1b": (256, 256), "huginn": (128, 64)}


def _write(shape: str, root: Path) -> Path:
    import torch

    if shape == "huginn":
        from latentserve.bench.baseline.recurrent_models import write_huginn

        shape_cfg = {"n_embd": 5280, "num_attention_heads": 55, "num_key_value_heads": 55,
                     "intermediate_size": 17920, "vocab_size": 65536, "block_size": 4096,
                     "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
                     "n_layers_in_coda": 2, "mean_recurrence": 32, "max_recurrence": 32}
        return write_huginn(root / shape, save_dtype=torch.bfloat16, init_device="cuda",
                            **shape_cfg)
    from latentserve.bench.gpu import SHAPES, save_random_llama

    path = save_random_llama(root / shape, SHAPES[shape])
    torch.cuda.empty_cache()
    return path


def run_one(path: str, shape: str, tp: int, concurrency: int) -> dict:
    """One engine at TP size ``tp``: a warm-up, then ``concurrency`` requests at once."""
    import torch

    from latentserve.bench.drive import drive
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams

    prompt_len, output_len = LENGTHS[shape]
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="bfloat16",
                                    max_model_len=prompt_len + output_len + 8,
                                    max_num_seqs=concurrency,
                                    kv_slots=concurrency * (prompt_len + output_len + 8),
                                    tensor_parallel_size=tp))
    try:
        g = torch.Generator().manual_seed(0)
        drive(engine, torch.randint(3, 1000, (2, 16), generator=g).tolist(),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "cuda", "warm")
        prompts = torch.randint(3, 1000, (concurrency, prompt_len), generator=g).tolist()
        run = drive(engine, prompts, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                    ignore_eos=True), "cuda", "run")
        graphs = engine.runner.num_graph_steps
    finally:
        engine.shutdown()
    return {"tok_s": run["tokens"] / run["wall_s"], "wall_s": run["wall_s"],
            "decode_step_s": run["step_s"].get("decode"),
            "replay_s": run.get("replay_s", {}).get("decode"), "graph_steps": graphs,
            "prompt_len": prompt_len, "output_len": output_len}


def run_tp_bench(shapes=tuple(LENGTHS), sizes=(1, 2), concurrency: int = 64,
                 command: str = "") -> dict:
    import platform

    import torch

    out = {"command": command, "concurrency": concurrency,
           "machine": {"gpus": [torch.cuda.get_device_name(i)
                                for i in range(torch.cuda.device_count())],
                       "torch": torch.__version__, "python": platform.python_version()},
           "shapes": {}}
    with tempfile.TemporaryDirectory() as d:
        for shape in shapes:
            path = _write(shape, Path(d))
            rows = {}
            for tp in sizes:
                res = Path(d) / f"{shape}-{tp}.json"
                subprocess.run([sys.executable, "-m", "benchmarks.tp", "--one", str(path),
                                shape, str(tp), str(concurrency), str(res)], check=True)
                rows[tp] = json.loads(res.read_text())
            if 1 in rows:
                for row in rows.values():
                    row["speedup_vs_tp1"] = row["tok_s"] / rows[1]["tok_s"]
            out["shapes"][shape] = rows
            print(json.dumps({shape: rows}, indent=1), flush=True)
    return out


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one":  # child: path shape tp concurrency out.json
        path, shape, tp, conc, res = argv[1:]
        Path(res).write_text(json.dumps(run_one(path, shape, int(tp), int(conc))))
        return 0
    p = parser("tp", __doc__)
    p.add_argument("--shapes", default=",".join(LENGTHS))
    p.add_argument("--sizes", default="1,2", help="TP sizes (default 1,2)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    res = run_tp_bench(tuple(args.shapes.split(",")),
                       tuple(int(s) for s in args.sizes.split(",")), args.concurrency,
                       command("tp", argv))
    if args.json_out:
        write_json(args.json_out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
