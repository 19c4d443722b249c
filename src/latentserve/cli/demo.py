"""``latentserve demo``: text chain of thought beside CoLaR (arXiv 2505.16552) on held-out
multiplications, through one server and the ``openai`` client.

Design notes: docs/internals.md, "latentserve.cli.demo".
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from latentserve.eval.datasets import Item

TEXT_MODEL = "smollm2-mult-cot"
COLAR_MODEL = "smollm2-mult-colar"
QUESTIONS_FILE = "multiplication.txt"  # package data: iCoT test lines, see LICENSE-multiplication
DEFAULT_MAX_TOKENS = 200  # a 5x5 chain of thought and its answer take about 160


def register(sub) -> None:
    from latentserve.cli import add_engine_args
    from latentserve.options import ranged

    p = sub.add_parser("demo", help="serve the text-CoT and CoLaR multiplication models and "
                                    "compare them on held-out questions",
                       description=f"Serve {TEXT_MODEL} and {COLAR_MODEL} from one server, ask "
                                   "both the same multiplications and print their answers, "
                                   "thinking and time side by side. With --model: serve that "
                                   "model alone and stream its answers to grade-school math "
                                   "questions.")
    add_engine_args(p)
    p.add_argument("--num-questions", type=ranged(int, "num_questions", ge=1), default=4,
                   help="questions to ask (default 4: two 4x4, two 5x5)")
    p.add_argument("--max-tokens", type=ranged(int, "max_tokens", ge=1),
                   default=DEFAULT_MAX_TOKENS,
                   help="tokens each model may write per question (text CoT: thinking and "
                        "answer; CoLaR: the answer, latent steps come on top)")
    p.add_argument("--models-dir",
                   help=f"where {TEXT_MODEL} and {COLAR_MODEL} are (default: models/ of the "
                        "source checkout, else of the working directory)")
    p.add_argument("--compression-factor", type=ranged(int, "compression_factor", ge=1),
                   help="CoLaR's thinking speed c, at most its max_compression_factor "
                        "(default: its colar_config.json)")
    p.add_argument("--questions",
                   help="iCoT multiplication file (question||steps #### answer lines) to take "
                        "the questions from (default: 8 test items shipped with the package)")
    p.set_defaults(func=run)


def label(question: str) -> str:
    """An iCoT multiplication (``"7 6 9 2 * 1 6 3 6"``, digits least significant first) as
    usually written (``"2967 x 6361"``)."""
    a, _, b = question.partition("*")
    return f"{number(a)} x {number(b)}"


def number(digits: str) -> str:
    """``"7 8 0 3 7 8 8 1"`` (least significant first) as ``"18873087"``; text that is not
    space-separated digits comes back stripped."""
    parts = digits.split()
    if not parts or not all(len(p) == 1 and p.isdigit() for p in parts):
        return digits.strip()
    return "".join(reversed(parts)).lstrip("0") or "0"


def load_questions(n: int, path: str | Path | None = None) -> list[Item]:
    """The first ``n`` items (``eval.datasets.Item``) of an iCoT file (default: the
    package's), shortest first. Raises ValueError for too few questions or a malformed line
    (naming it)."""
    from latentserve.eval.datasets import package_data_dir, parse_file

    p = Path(path) if path is not None else package_data_dir() / QUESTIONS_FILE
    out = parse_file(p, "icot", "digits", None)
    if len(out) < n:
        raise ValueError(f"--num-questions {n}: {p} has {len(out)}")
    return sorted(out[:n], key=lambda q: len(q.question))


def _model(models_dir: Path | None, name: str, marker: str) -> Path | None:
    """``models_dir/name`` (links resolved) when it holds the file ``marker``, else None."""
    d = models_dir / name if models_dir else None
    return d.resolve() if d and (d / marker).is_file() else None


@dataclass(frozen=True, slots=True)
class Reply:
    """One model's reply: ``thinking`` counts text tokens before ``###`` or latent steps;
    ``stopped``: the model closed its thinking itself (not a cap)."""

    answer: str
    correct: bool
    thinking: int
    stopped: bool
    seconds: float


def thinking_tokens(tokens: list[str]) -> int | None:
    """How many of the generated ``tokens`` (their texts, in order) lie wholly before the first
    ``###``; None when the text has none."""
    from latentserve.latent.colar import SEPARATOR

    at = "".join(tokens).find(SEPARATOR)
    return None if at < 0 else sum(end <= at for end in accumulate(map(len, tokens)))


def ask(client, model: str, q: Item, max_tokens: int, latent: bool = False,
        compression_factor: int | None = None) -> Reply:
    """Ask one question (completions, greedy): the text-CoT model the whole speed-1 prompt
    (its tokens from ``logprobs=0``) or, with ``latent``, the CoLaR model the question part
    (``compression_factor`` in the body, None: the model's; thinking ``latent.stats.steps``)."""
    from latentserve.latent import colar

    extra = {} if compression_factor is None else {"compression_factor": compression_factor}
    start = time.perf_counter()
    r = client.completions.create(model=model, max_tokens=max_tokens, temperature=0.0, **(
        {"prompt": colar.QUESTION.format(q.question), "extra_body": extra} if latent
        else {"prompt": colar.prompt_text(q.question), "logprobs": 0}))
    seconds = time.perf_counter() - start
    choice = r.choices[0]
    if latent:
        stats = ((choice.model_extra or {}).get("latent") or {}).get("stats") or {}
        text = choice.text.strip().removeprefix(colar.SEPARATOR)
        prefix = colar.ANSWER.format("")
        answer = (text.partition(prefix)[2] if prefix in text else text).strip()
        thinking, stopped = int(stats.get("steps", 0)), stats.get("end") == "stop"
    else:
        tokens = list(choice.logprobs.tokens) if choice.logprobs else []
        before = thinking_tokens(tokens)
        answer = colar.split_output(choice.text)[1] if before is not None else ""
        thinking, stopped = len(tokens) if before is None else before, before is not None
    return Reply(answer, answer.split() == q.gold.split(), thinking, stopped, seconds)


_Q, _REF, _ANS = 13, 12, 12  # column widths: question, reference, answer


def _cell(reply: Reply, unit: str) -> str:
    ok = "right" if reply.correct else "WRONG"
    think = f"{reply.thinking} {unit}" + ("" if reply.stopped else "+")
    return f"{number(reply.answer) or '-':<{_ANS}.{_ANS}} {ok:<5}  {think:>10}  " \
           f"{reply.seconds:5.1f} s"


def _total(replies: list[Reply], unit: str) -> str:
    right = sum(r.correct for r in replies)
    return (f"{right}/{len(replies)} right, {sum(r.thinking for r in replies)} {unit}, "
            f"{sum(r.seconds for r in replies):.1f} s")


def compare(base_url: str, text_model: str, colar_model: str | None,
            questions: list[Item], max_tokens: int,
            compression_factor: int | None = None) -> None:
    """Ask each question to both models, one request at a time; print the table and summary."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    speed = f" c={compression_factor}" if compression_factor is not None else ""
    print("the models get each question as they were trained: digits least significant "
          f"first ({label(questions[0].question)} is '{questions[0].question}')\n")
    columns = [f"text CoT ({TEXT_MODEL})"]
    if colar_model is not None:
        columns.append(f"CoLaR{speed} ({COLAR_MODEL})")
    sub = f"{'answer':<{_ANS}} {'':<5}  {'thinking':>10}  {'time':>7}"
    print(f"{'#':<2} {'question':<{_Q}} {'reference':<{_REF}}"
          + "".join(f" | {c:<{len(sub)}.{len(sub)}}" for c in columns).rstrip())
    print(f"{'':<2} {'':<{_Q}} {'':<{_REF}}" + f" | {sub}" * len(columns), flush=True)
    text, latent = [], []
    for i, q in enumerate(questions, 1):
        text.append(ask(client, text_model, q, max_tokens))
        cells = [_cell(text[-1], "tokens")]
        if colar_model is not None:
            latent.append(ask(client, colar_model, q, max_tokens, True, compression_factor))
            cells.append(_cell(latent[-1], "steps"))
        print(f"{i:<2} {label(q.question):<{_Q}} {number(q.gold):<{_REF}}"
              + "".join(f" | {c}" for c in cells), flush=True)
    if not all(r.stopped for r in text + latent):
        print("('+': the thinking ran into a cap without the model closing it)")
    line = f"\ntotal: text CoT {_total(text, 'thinking tokens')}"
    if colar_model is not None:
        line += f"; CoLaR {_total(latent, 'latent steps')}"
        tokens, steps = sum(r.thinking for r in text), sum(r.thinking for r in latent)
        t_text, t_latent = sum(r.seconds for r in text), sum(r.seconds for r in latent)
        if steps and t_latent:
            line += (f" ({tokens / steps:.1f}x fewer thinking steps, "
                     f"{t_text / t_latent:.1f}x faster)")
    print(line, flush=True)


def convert_embedded(dtype: str = "float32") -> None:
    """Convert the embedded SmolLM2 GGUF into the cache once, before both engines would."""
    from latentserve.models.checkpoint import cache_dir_for, embedded_gguf_path, resolve_model_dir

    try:
        target = cache_dir_for(embedded_gguf_path(), dtype)
    except FileNotFoundError:
        return
    if (target / "config.json").is_file():
        return
    print(f"converting the embedded SmolLM2-135M GGUF into {target.parent} (once, ~30 s) ...",
          flush=True)
    start = time.perf_counter()
    resolve_model_dir(None, dtype)
    print(f"  done ({time.perf_counter() - start:.0f} s)", flush=True)


def start_verbose(configs: list, labels: list[str]):
    """``start_server(configs)``, printing progress; Ctrl-C stops the server at once."""
    from latentserve.server.launch import served_model_name, start_server

    fd, log = tempfile.mkstemp(prefix="latentserve-demo-", suffix=".log")
    os.close(fd)
    names = [served_model_name(c) for c in configs]
    start, shown, last = time.perf_counter(), set(), [0.0]

    def progress() -> None:
        elapsed = time.perf_counter() - start
        lines = Path(log).read_text(errors="replace")
        for name, what in zip(names, labels):
            if name not in shown and f"engine ready: {name}," in lines:
                shown.add(name)
                print(f"  {what} ready ({elapsed:.0f} s)", flush=True)
        if elapsed - last[0] >= 15:
            last[0] = elapsed
            print(f"  ... {elapsed:.0f} s", flush=True)

    server = start_server(configs, log_path=log, on_wait=progress)
    print(f"server ready at {server.base_url} ({time.perf_counter() - start:.0f} s); "
          f"its log: {log}\n", flush=True)
    return server


def run(args) -> int:
    from latentserve.cli import engine_configs
    from latentserve.models.checkpoint import find_models_dir

    if args.model is not None:
        _refuse_demo_flags(args, "with --model (which serves that model on grade-school math)")
        return run_gsm8k(args)
    models_dir = find_models_dir(args.models_dir)
    text_dir = _model(models_dir, TEXT_MODEL, "adapter_config.json") \
        or _model(models_dir, TEXT_MODEL, "config.json")
    if text_dir is None:
        where = models_dir / TEXT_MODEL if models_dir else f"models/{TEXT_MODEL}"
        if args.models_dir is not None:
            raise ValueError(f"--models-dir {args.models_dir} holds no {TEXT_MODEL} (the "
                             "source checkout's models/ does)")
        _refuse_demo_flags(args, f"without {where} (it ships with the source checkout, not "
                           "the wheel)")
        print(f"note: {where} not found (it ships with the source checkout, not the wheel); "
              "showing the embedded SmolLM2 on grade-school math instead", flush=True)
        return run_gsm8k(args)
    colar_dir = _model(models_dir, COLAR_MODEL, "colar_config.json")
    if colar_dir is None and args.compression_factor is not None:
        raise ValueError(f"--compression-factor is CoLaR's speed, and {models_dir} holds no "
                         f"{COLAR_MODEL}; leave it out")
    if colar_dir is None:
        print(f"note: {models_dir / COLAR_MODEL} is not there yet (it is trained on a GPU by "
              "scripts/stage1_gpu.sh, see docs/results.md); showing the text CoT alone",
              flush=True)
    questions = load_questions(args.num_questions, args.questions)
    speed = None  # CoLaR's thinking speed: --compression-factor, else its colar_config.json's
    if colar_dir is not None:
        from latentserve.latent.colar import COLAR_CONFIG, ColarConfig

        colar = ColarConfig.from_dict(json.loads((colar_dir / COLAR_CONFIG).read_text()))
        speed = args.compression_factor or colar.compression_factor
        if speed > colar.max_compression_factor:
            raise ValueError(f"--compression-factor must be in [1, "
                             f"{colar.max_compression_factor}] for {colar_dir}, got {speed}")
    args.model = [str(d) for d in (text_dir, colar_dir) if d is not None]
    configs = engine_configs(args)  # two: --max-latent-budget caps CoLaR, not the text model
    convert_embedded()
    labels = ["text CoT model", "CoLaR model"][:len(configs)]
    what = "the text CoT and CoLaR models" if colar_dir else "the text CoT model"
    print(f"starting one server with {what} of {models_dir} (each engine loads SmolLM2, "
          "merges its LoRA adapter and warms up) ...", flush=True)
    with start_verbose(configs, labels) as server:
        compare(server.base_url, configs[0].model, configs[1].model if colar_dir else None,
                questions, args.max_tokens, speed)
    return 0


def _refuse_demo_flags(args, why: str) -> None:
    """ValueError naming the first multiplication-demo flag set (it would be ignored)."""
    for flag, value in (("--questions", args.questions), ("--models-dir", args.models_dir),
                        ("--compression-factor", args.compression_factor)):
        if value is not None:
            raise ValueError(f"{flag} is for the multiplication demo, not {why}; leave it out")


def run_gsm8k(args) -> int:
    """Serve ``--model`` (default: the embedded SmolLM2) and stream its chat answers to
    ``--num-questions`` GSM8K questions, each with TTFT and tokens/s."""
    from openai import OpenAI

    from latentserve.bench.offline import load_questions as gsm8k_questions
    from latentserve.cli import engine_config

    config = engine_config(args)
    if config.model is None:
        convert_embedded(str(config.torch_dtype).removeprefix("torch."))
    print("starting the server ...", flush=True)
    with start_verbose([config], ["model"]) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        print(f"serving {model}\n", flush=True)
        for q in gsm8k_questions()[:args.num_questions]:
            ask_chat(client, model, q, args.max_tokens)
    return 0


def ask_chat(client, model: str, q: dict, max_tokens: int) -> None:
    """Stream one chat answer to stdout, then print TTFT and decode speed."""
    print(f"Q: {q['question']}\nA: ", end="", flush=True)
    start, first, n_tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q["question"]}],
        max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            n_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text = choice.delta.content or ""
            if text and first is None:
                first = time.perf_counter()
            print(text, end="", flush=True)
    end = time.perf_counter()
    ttft = (first or end) - start
    tps = (n_tokens - 1) / (end - first) if first and end > first and n_tokens > 1 else 0.0
    print(f"\n   [reference answer {q['answer']} | TTFT {ttft * 1000:.0f} ms | "
          f"{n_tokens} tokens, {tps:.1f} tokens/s]\n", flush=True)
