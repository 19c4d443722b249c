"""Trained-model benchmark: the repository's multiplication models (``docs/models.md``) on
iCoT test questions in their training prompt format; per concurrency ``engine_rows``' figures
and the batch's accuracy (a fraction in [0, 1]).

Design notes: docs/internals.md, "latentserve.bench.families".
"""

from __future__ import annotations

import json
from pathlib import Path

from latentserve.bench.suite import engine_rows, step_cost, suite_engine
from latentserve.eval.colar_eval import answers_match, encode_questions, read_answer
from latentserve.eval.datasets import load_items
from latentserve.models.checkpoint import find_models_dir
from latentserve.sampling_params import SamplingParams

# model -> the file that marks its directory (models/ at the repository root)
MODELS = {"smollm2-mult-cot": "adapter_config.json",
          "smollm2-mult-colar": "colar_config.json"}
NOTES = {"temperature": 0.0, "ignore_eos": False}


def model_paths(names, models_dir: str | Path | None = None) -> dict[str, Path]:
    """``{name: directory}`` of ``names`` (``MODELS`` keys) under ``models_dir``, else the
    checkout's ``models/`` (next to ``src/``) or ``./models`` (``find_models_dir``).
    Raises ValueError for an unknown name, FileNotFoundError for a ``models_dir`` that is no
    directory, RuntimeError naming what is missing (no ``models/``, as in a wheel install, or a
    model directory without its marker file)."""
    if unknown := set(names) - set(MODELS):
        raise ValueError(f"trained models must be among {sorted(MODELS)}, got {sorted(unknown)}")
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


def bench_model(name: str, root: Path, bw: float, device: str, concurrency,
                dataset: str = "mult4", output_len: int = 200, answer_len: int = 32,
                max_latent: int | None = None, cost_steps: int = 32,
                models_dir: str | Path | None = None, data_dir=None) -> dict:
    """One trained model (``MODELS`` key, under ``models_dir``; ``root`` unused) on ``dataset``
    (an ``eval.datasets`` name): ``output_len`` text tokens, or for CoLaR ``answer_len`` after
    ``max_latent`` latents (None: the model's own) and ``step_cost`` at ``cost_steps``. Returns
    ``{path, latent, dataset, max_model_len, concurrency, accuracy, step_cost}``."""
    path = model_paths([name], models_dir)[name]
    latent = (path / "colar_config.json").is_file()
    latent_cap = 0  # the most latent steps a request takes
    if latent:
        own = json.loads((path / "colar_config.json").read_text())["max_latent"]
        latent_cap = max(own if max_latent is None else max_latent, cost_steps)
    items = load_items(dataset, limit=sum(concurrency), data_dir=data_dir)
    if len(items) < sum(concurrency):
        raise ValueError(f"dataset {dataset} has {len(items)} items, the concurrencies "
                         f"{list(concurrency)} ask {sum(concurrency)}")
    batches, start = {}, 0
    for c in concurrency:  # distinct questions per concurrency
        batches[c], start = items[start:start + c], start + c
    tok_len = 64  # the question part is ~30 ids, the speed and ``###`` 8 more
    max_len = tok_len + latent_cap + (answer_len if latent else output_len) + 8
    engine = suite_engine(path, device, concurrency, max_len)
    tok = engine.tokenizer
    prompts = {c: encode_questions(tok, [it.question for it in b], latent)
               for c, b in batches.items()}
    if max(len(p) for ps in prompts.values() for p in ps) > tok_len:
        raise ValueError(f"a {dataset} prompt is longer than {tok_len} ids")

    def params(n: int, steps: int | None = None, **kw) -> SamplingParams:
        if latent:
            kw = {"max_latent": steps if steps is not None else max_latent, **kw}
        return SamplingParams(max_tokens=n, temperature=0.0, **kw)

    rows, outputs = engine_rows(engine, params(answer_len if latent else output_len), prompts,
                                device, bw, params(2, 2))
    answered = []
    for c, row in rows.items():  # each answer read as ``latentserve eval`` reads it
        answers = [{"question": it.question, "gold": it.gold, "answer": a,
                    "correct": answers_match(it.gold, a)}
                   for it, ids in zip(batches[c], outputs[c][1])
                   for a in [read_answer(tok, ids, latent)]]
        row.update(accuracy=sum(a["correct"] for a in answers) / c, answers=answers)
        answered += answers
    cost = None
    if latent:
        ps = prompts[max(concurrency)]
        cost = step_cost(
            engine, (ps, params(1, cost_steps, thinking=True, min_latent=0, use_stop=False,
                                ignore_eos=True)),
            ([p + list(engine.latent_spec.start_ids) for p in ps],
             params(cost_steps + 1, thinking=False, ignore_eos=True)), device, bw)
    return {"path": str(path), "latent": latent, "dataset": dataset, "max_model_len": max_len,
            "concurrency": rows,
            "accuracy": sum(a["correct"] for a in answered) / len(answered),
            "step_cost": cost}
