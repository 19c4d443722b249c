"""Trained-model benchmark (issue 27): the project's multiplication models, real weights
(LoRA adapters over the embedded SmolLM2-135M-Instruct, ``docs/models.md``), serving iCoT
test questions in the prompt format they were trained with (``eval.colar_eval``): per
concurrency the decode step against its bandwidth floor, tok/s and the accuracy of the
answers of that batch; for the CoLaR model also a latent step against a plain one.
Units: seconds, tokens per second; accuracy a fraction in [0, 1].

Design notes: docs/internals.md, "latentserve.bench.families".
"""

from __future__ import annotations

import json
from pathlib import Path

from latentserve.bench.device_common import free_memory, make_engine
from latentserve.bench.drive import drive
from latentserve.bench.suite import dtype_for, measure, run_suite, step_cost
from latentserve.eval.colar_eval import answers_match, encode_questions, read_answer
from latentserve.eval.datasets import load_items
from latentserve.models.checkpoint import find_models_dir
from latentserve.sampling_params import SamplingParams

# model -> the file that marks its directory (models/ at the repository root)
MODELS = {"smollm2-mult-cot": "adapter_config.json",
          "smollm2-mult-colar": "colar_config.json"}


def model_paths(names, models_dir: str | Path | None = None) -> dict[str, Path]:
    """``{name: directory}`` of ``names`` (``MODELS`` keys) under ``models_dir``, else the
    checkout's ``models/`` (next to ``src/``) or ``./models`` (``find_models_dir``).
    Raises ValueError for an unknown name, RuntimeError naming what is missing (no
    ``models/``, as in a wheel install, or a model directory without its marker file)."""
    unknown = set(names) - set(MODELS)
    if unknown:
        raise ValueError(f"trained models must be among {sorted(MODELS)}, got {sorted(unknown)}")
    if models_dir is not None and not Path(models_dir).is_dir():
        raise RuntimeError(f"models_dir {models_dir} is not a directory")
    root = find_models_dir(models_dir)
    if root is None:
        raise RuntimeError(
            "the trained suite needs the repository's models/ directory (models/"
            f"{', models/'.join(names)}): none next to src/ nor in the working directory "
            "(a wheel install ships none); run from a checkout, pass models_dir, or leave "
            "'trained' out of the families")
    paths = {name: root / name for name in names}
    for name, path in paths.items():
        if not (path / MODELS[name]).is_file():
            raise RuntimeError(f"{path} is not the trained model {name}: it has no "
                               f"{MODELS[name]} (the model ships in the repository's models/)")
    return paths


def _answers(tok, items, outputs, latent: bool) -> list[dict]:
    """``{question, gold, answer, correct}`` per item from its generated ids (the answer read
    as ``latentserve eval`` reads it, ``colar_eval.read_answer`` and ``answers_match``)."""
    out = []
    for it, ids in zip(items, outputs):
        answer = read_answer(tok, ids, latent)
        out.append({"question": it.question, "gold": it.gold, "answer": answer,
                    "correct": answers_match(it.gold, answer)})
    return out


def bench_model(path: Path, device: str, concurrency, dataset: str,
                output_len: int, answer_len: int, max_latent: int | None, cost_steps: int,
                data_dir, bw: float) -> dict:
    """One trained model: per concurrency c (after a warm-up at each, 2 tokens) the next c
    questions of ``dataset`` through ``drive`` (greedy, each ending at its EOS or its cap:
    ``output_len`` text tokens, CoLaR ``answer_len`` answer tokens after its latent steps,
    at most ``max_latent``), measured by ``suite.measure``, with ``accuracy`` and ``answers``;
    for CoLaR ``suite.step_cost`` at the largest concurrency (``cost_steps`` latent steps
    without the stop against ``cost_steps`` + 1 answer tokens after ``###``, same questions).
    Returns ``{path, latent, dataset, max_model_len, concurrency: rows, accuracy,
    step_cost}`` (``step_cost`` None for the text model)."""
    latent = (path / "colar_config.json").is_file()
    latent_cap = 0  # the most latent steps a request takes
    if latent:
        own = json.loads((path / "colar_config.json").read_text())["max_latent"]
        latent_cap = max(own if max_latent is None else max_latent, cost_steps)
    items = load_items(dataset, limit=sum(concurrency), data_dir=data_dir)
    if len(items) < sum(concurrency):
        raise ValueError(f"dataset {dataset} has {len(items)} items, the concurrencies "
                         f"{list(concurrency)} ask {sum(concurrency)}")
    max_c = max(concurrency)
    batches, start = {}, 0
    for c in concurrency:  # distinct questions per concurrency
        batches[c], start = items[start:start + c], start + c
    dtype = dtype_for(device)
    tok_len = 64  # the question part is ~30 ids, the speed and ``###`` 8 more
    max_len = tok_len + latent_cap + (answer_len if latent else output_len) + 8
    engine = make_engine(path, device, dtype, max_c, max_len, kv_slots=(max_c + 1) * max_len)
    tok = engine.tokenizer
    prompts = {c: encode_questions(tok, [it.question for it in b], latent)
               for c, b in batches.items()}
    if max(len(p) for ps in prompts.values() for p in ps) > tok_len:
        raise ValueError(f"a {dataset} prompt is longer than {tok_len} ids")

    def params(n: int, steps: int | None = None, **kw) -> SamplingParams:
        if latent:
            kw = {"max_latent": steps if steps is not None else max_latent, **kw}
        return SamplingParams(max_tokens=n, temperature=0.0, **kw)

    run_params = params(answer_len if latent else output_len)
    for c in concurrency:
        drive(engine, prompts[c], params(2, 2), device, "warm")
    engine.cache.radix.reset()
    rows, answered = {}, []
    for c in concurrency:
        r = drive(engine, prompts[c], run_params, device, f"c{c}")
        answers = _answers(tok, batches[c], r.pop("outputs"), latent)
        rows[c] = measure(engine, r, c, bw)
        rows[c].update(accuracy=sum(a["correct"] for a in answers) / c, answers=answers)
        answered += answers
    engine.cache.check_idle()
    cost = None
    if latent:
        spec = engine.latent_spec
        ps = prompts[max_c]
        cost = step_cost(
            engine, (ps, params(1, cost_steps, thinking=True, min_latent=0, use_stop=False,
                                ignore_eos=True)),
            ([p + list(spec.start_ids) for p in ps],
             params(cost_steps + 1, thinking=False, ignore_eos=True)), device, bw)
    del engine
    free_memory(device)
    return {"path": str(path), "latent": latent, "dataset": dataset, "max_model_len": max_len,
            "concurrency": rows,
            "accuracy": sum(a["correct"] for a in answered) / len(answered),
            "step_cost": cost}


def run_trained_bench(models=tuple(MODELS), device: str = "cuda", concurrency=(1, 16, 64),
                      dataset: str = "mult4", output_len: int = 200, answer_len: int = 32,
                      max_latent: int | None = None, cost_steps: int = 32,
                      models_dir: str | Path | None = None, data_dir=None,
                      prompt_len: int | None = None, command: str | None = None) -> dict:
    """Every model in ``models`` (``MODELS`` keys, found by ``model_paths``) through
    ``bench_model`` on the questions of ``dataset`` (``eval.datasets`` names: ``mult4``,
    ``mult5``; the file under ``data_dir``, ``$LATENTSERVE_DATA`` or the package);
    ``max_latent`` None: the CoLaR model's own cap. ``prompt_len`` is unused (the prompts are
    the questions; ``bench.families`` passes one to every suite on the CPU). Returns
    ``suite.run_suite``'s result; RuntimeError without the models (``model_paths``)."""
    paths = model_paths(models, models_dir)
    config = {"device": device, "dtype": dtype_for(device), "concurrency": list(concurrency),
              "dataset": dataset, "output_len": output_len, "answer_len": answer_len,
              "max_latent": max_latent, "cost_steps": cost_steps, "temperature": 0.0,
              "ignore_eos": False, "cuda_graphs": device.startswith("cuda")}
    return run_suite(models, lambda name, root, bw: bench_model(
        paths[name], device, concurrency, dataset, output_len, answer_len, max_latent,
        cost_steps, data_dir, bw), device, command, config)
