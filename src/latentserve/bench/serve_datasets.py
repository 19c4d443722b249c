"""The prompts of ``latentserve bench serve`` as ``vllm bench serve`` samples them
(``vllm/benchmarks/datasets.py``).

Design notes: docs/internals.md, "latentserve.bench.serve_datasets".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from latentserve.bench.offline import load_questions

DATASETS = ("gsm8k", "random", "sharegpt", "custom")
# vLLM's is_valid_sequence bounds (vllm/benchmarks/datasets.py).
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(slots=True)
class Sample:
    """A request's prompt (text, or ids for a random completions prompt) and output length."""

    prompt: str | list[int]
    output_len: int


def _repeat(samples: list[Sample], n: int, rng: random.Random) -> list[Sample]:
    """``samples`` brought to ``n``: cut, or topped up with random repeats (vLLM's
    ``maybe_oversample_requests``)."""
    if len(samples) >= n or not samples:
        return samples[:n]
    return samples + [rng.choice(samples) for _ in range(n - len(samples))]


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f) if what == "json" else [json.loads(line) for line in f
                                                        if line.strip()]
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not valid {what.upper()} ({exc})") from None


def sample_requests(args, count_tokens, detokenize) -> list[Sample]:
    """``args.num_prompts`` samples of ``args.dataset`` (deterministic for ``args.seed``);
    ``count_tokens`` / ``detokenize`` ask the server. Raises ValueError naming the flag and
    entry for a missing, malformed or empty ``--dataset-path``."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "gsm8k":
        questions = [q["question"] for q in load_questions()]
        return [Sample(questions[i % len(questions)], args.output_len) for i in range(n)]
    if args.dataset == "random":
        chat = args.endpoint == "/v1/chat/completions"
        rows = ([rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(n))
        return [Sample(detokenize(ids) if chat else ids, args.output_len) for ids in rows]
    if args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path FILE")
    if args.dataset == "sharegpt":
        return _sharegpt(args, rng, count_tokens)
    lines = _read_json(args.dataset_path, "jsonl")
    samples = []
    for i, line in enumerate(lines, 1):
        if not isinstance(line, dict) or not isinstance(line.get("prompt"), str):
            msg = f"--dataset-path {args.dataset_path}: line {i} needs a \"prompt\" string"
            raise ValueError(msg)  # noqa: TRY004 - a bad file: the CLI's one-line error
        out = line.get("output_tokens", args.custom_output_len or args.output_len)
        if not isinstance(out, int) or out < 1:
            raise ValueError(f"--dataset-path {args.dataset_path}: line {i}: output_tokens "
                             f"must be an integer >= 1, got {out!r}")
        samples.append(Sample(line["prompt"], out))
    if not samples:
        raise ValueError(f"--dataset-path {args.dataset_path}: no lines")
    return _repeat(samples, n, rng)


def _sharegpt(args, rng: random.Random, count_tokens) -> list[Sample]:
    data = _read_json(args.dataset_path, "json")
    if not isinstance(data, list):
        msg = (f"--dataset-path {args.dataset_path}: a ShareGPT file is a JSON list of "
               f"{{\"conversations\": [...]}} entries")
        raise ValueError(msg)  # noqa: TRY004 - a bad file: the CLI's one-line error
    entries = [e for e in data if isinstance(e, dict)
               and isinstance(e.get("conversations"), list) and len(e["conversations"]) >= 2]
    rng.shuffle(entries)
    fixed = args.sharegpt_output_len
    samples = []
    for entry in entries:
        if len(samples) >= args.num_prompts:
            break
        prompt = entry["conversations"][0].get("value")
        answer = entry["conversations"][1].get("value")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            continue
        prompt_len = count_tokens(prompt)
        out = fixed if fixed is not None else count_tokens(answer)
        if (prompt_len < MIN_LEN or (fixed is None and out < MIN_LEN)
                or prompt_len > MAX_PROMPT_LEN or prompt_len + out > MAX_TOTAL_LEN):
            continue
        samples.append(Sample(prompt, out))
    if not samples:
        raise ValueError(f"--dataset-path {args.dataset_path}: no conversation fits (two "
                         f"turns, a prompt of {MIN_LEN}-{MAX_PROMPT_LEN} tokens, at most "
                         f"{MAX_TOTAL_LEN} with the answer)")
    return _repeat(samples, args.num_prompts, rng)
