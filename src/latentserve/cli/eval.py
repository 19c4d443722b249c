"""``latentserve eval``: accuracy, thinking and latency on GSM8K, ProsQA or multiplication,
in-process or against an OpenAI-compatible URL; ``--sweep`` and ``--plot`` over a field."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


def register(sub) -> None:
    from latentserve.cli import add_engine_args
    from latentserve.eval.datasets import DATASETS
    from latentserve.eval.run import SWEEP_BOUNDS
    from latentserve.options import ranged

    p = sub.add_parser("eval", help="evaluate text CoT or latent reasoning on a data set")
    add_engine_args(p)
    p.add_argument("--dataset", choices=sorted(DATASETS),
                   help="data set (default gsm8k; the CoLaR prompt format reads iCoT lines: "
                        "mult4, mult5 or gsm8k-icot); its test set ships with the package")
    p.add_argument("--data-file", "--dataset-file", dest="data_file",
                   help="override the data set's file (iCoT text lines or GSM8K jsonl)")
    p.add_argument("--data-dir",
                   help="folder searched first for --dataset's file (gsm8k/test.jsonl, "
                        "prosqa/test.json, multiplication/4x4_test.txt, ...); default "
                        "$LATENTSERVE_DATA, then the test sets shipped in the package")
    p.add_argument("--prompt-format", default="auto", choices=["auto", "colar", "chat"],
                   help="colar: CoLaR's prompt (models from `latentserve train`; in-process "
                        "only, not with --url); auto: colar when the model directory has "
                        "colar_config.json or train_config.json")
    p.add_argument("--compression-factor",
                   type=ranged(int, "compression_factor", **SWEEP_BOUNDS["compression_factor"]),
                   help="CoLaR models: thinking speed (default: the model's)")
    p.add_argument("--json-out", help="colar format: write the summary (JSON)")
    p.add_argument("--limit", type=ranged(int, "limit", ge=1), help="first N items only")
    p.add_argument("--max-tokens", type=ranged(int, "max_tokens", ge=1), default=256,
                   help="answer tokens (latent steps come on top)")
    p.add_argument("--max-latent", type=ranged(int, "max_latent", **SWEEP_BOUNDS["max_latent"]),
                   help="latent step cap (a head or a CoLaR model); absent: in the chat "
                        "format text CoT, thinking off; in the CoLaR format the model's cap "
                        "(a head's: $LATENTSERVE_MAX_LATENT, default 256), recorded in the "
                        "summary")
    p.add_argument("--sweep", help="e.g. max_latent=0,4,8,16,32 (CoLaR models "
                   "also compression_factor=1,2,3,4,5); each value once")
    p.add_argument("--min-latent", type=ranged(int, "min_latent", ge=0))
    p.add_argument("--stop-threshold", type=ranged(float, "stop_threshold", ge=0.0, le=1.0),
                   help="compression-head stop threshold (default: the model's)")
    p.add_argument("--no-stop", action="store_true", help="run every budget to its cap")
    p.add_argument("--url",
                   help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1; without "
                        "/v1 it is tried with /v1 added) instead of an in-process engine; "
                        "chat prompt format only")
    p.add_argument("--api-model", help="with --url: the model name there (default: first)")
    p.add_argument("--api-key", help="with --url: the server's API key (default: none)")
    p.add_argument("--concurrency", type=ranged(int, "concurrency", ge=1),
                   help="with --url: requests in flight (default 16)")
    p.add_argument("--out", help="write summary and per-item records (JSON; a sweep's "
                                 "records under each run's value)")
    p.add_argument("--plot", help="sweep plot (PNG)")
    p.add_argument("--baseline",
                   help="with --plot: a text-CoT run's --out JSON (CoLaR format: its "
                        "--json-out), drawn as a reference line")
    p.set_defaults(func=run)


def refuse_engine_flags(args) -> None:
    """ValueError naming the first engine flag set beside ``--url`` (``--model`` or an
    ``EngineConfig`` field off its default): the server's model and settings answer."""
    from latentserve.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):  # --model first: its default is None too
        if hasattr(args, f.name) and getattr(args, f.name) not in (None, f.default):
            raise ValueError(f"--{f.name.replace('_', '-')} is for an in-process engine; with "
                             "--url the server's model and settings answer (name the model "
                             "with --api-model)")


def model_label(args) -> str:
    """The plot's name of the evaluated model: ``--model``'s last path part, else the
    embedded SmolLM2's; ``+ <bundle>`` with ``--latent-head``."""
    name = (os.path.basename(os.path.normpath(args.model)) if args.model
            else "SmolLM2-135M-Instruct")
    head = getattr(args, "latent_head", None)
    return f"{name} + {os.path.basename(head)}" if head else name


def run_colar(args, controls: dict, base: dict | None) -> int:
    """The CoLaR-format evaluation (``eval/colar_eval.py``) of one run or a sweep
    (``controls``: a compression head's; ``base``: ``--baseline``'s reference line). Every
    run's settings are checked before the first one runs."""
    from latentserve.cli import engine_config
    from latentserve.entrypoints.llm import LLM
    from latentserve.eval.colar_eval import check, evaluate
    from latentserve.eval.run import parse_sweep
    from latentserve.train.cot import read_items

    if args.data_file is None:
        from latentserve.eval.datasets import DATASETS, find_data_file

        icot = sorted(n for n, (_, fmt, _) in DATASETS.items() if fmt == "icot")
        if args.dataset not in icot:
            raise ValueError(f"the CoLaR prompt format reads iCoT lines: give --dataset "
                             f"{'|'.join(icot)} or --dataset-file FILE, got --dataset "
                             f"{args.dataset or '(none)'}")
        args.data_file = str(find_data_file(DATASETS[args.dataset][0], args.data_dir))
    key, values = (parse_sweep(args.sweep, ("compression_factor", "max_latent")) if args.sweep
                   else ("compression_factor", [args.compression_factor]))
    if args.sweep and getattr(args, key) is not None:
        flag = "--" + key.replace("_", "-")
        raise ValueError(f"{flag} and --sweep {key}=... both set {key}; give one")
    items = read_items(args.data_file)[:args.limit]
    cfg = engine_config(args)
    llm = LLM(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    runs, records = [], {}
    options = []
    for v in values:
        opts = {"compression_factor": args.compression_factor, "max_latent": args.max_latent}
        if args.sweep:
            opts[key] = v
        try:  # before the first run: a sweep's last value would fail after the others ran
            check(llm, items, args.max_tokens, **opts, **controls)
        except ValueError as exc:
            raise ValueError(f"--sweep {key}={v}: {exc}" if args.sweep else str(exc)) from None
        options.append(opts)
    for v, opts in zip(values, options):
        recs, summary = evaluate(llm, items, args.max_tokens, **opts, **controls)
        summary = {"dataset_file": args.data_file, "max_tokens": args.max_tokens, **summary}
        runs.append(summary)
        records[str(v)] = recs
        print(json.dumps(summary), flush=True)
        out = summary if not args.sweep else {"runs": runs}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=1))
        if args.out:  # a sweep's records under each run's value, as the chat format's
            Path(args.out).write_text(json.dumps(
                {"summary": out, "records": records if args.sweep else recs}, indent=1))
    if args.plot:
        from latentserve.eval.run import plot_sweep

        flat = [{key: r[key], "accuracy": r["accuracy"], "thinking_median":
                 r["thinking"]["median"], "thinking_max": r["thinking"]["max"]} for r in runs]
        plot_sweep({model_label(args): flat}, args.plot,
                   f"{os.path.basename(args.data_file)} (n={len(items)})", base, x=key,
                   accuracy_keys=(("accuracy", "exact"),))
    return 0


def run(args) -> int:
    from latentserve.eval.datasets import data_dirs, dataset_file, load_items
    from latentserve.eval.run import read_baseline
    from latentserve.extras import require

    if args.plot:  # before any work: the sweep would run first and only then fail
        require("matplotlib", "--plot")
    # Options that are wrong whatever the run gives: refuse them before it starts.
    if args.plot and args.sweep is None:
        raise ValueError("--plot needs --sweep")
    if args.baseline and not args.plot:
        raise ValueError("--baseline is a reference line on --plot's sweep plot; give --plot "
                         "and --sweep, or leave --baseline out")
    if args.baseline and not os.path.isfile(args.baseline):
        raise FileNotFoundError(f"--baseline {args.baseline} does not exist")
    if args.url is None:
        for flag, value in (("--api-model", args.api_model), ("--api-key", args.api_key),
                            ("--concurrency", args.concurrency)):
            if value is not None:
                raise ValueError(f"{flag} is for the server at --url; without --url the run "
                                 "is in-process")
    if args.data_dir is not None:
        data_dirs(args.data_dir)  # a folder that does not exist, even beside --dataset-file
    check_paths(args)
    controls = {k: v for k, v in (("min_latent", args.min_latent),  # heads and CoLaR
                                  ("stop_threshold", args.stop_threshold),
                                  ("use_stop", False if args.no_stop else None)) if v is not None}
    d = Path(args.model) if args.model else None
    trained = next((f for f in ("colar_config.json", "train_config.json")  # CoLaR, `train cot`
                    if d is not None and d.is_dir() and (d / f).is_file()), None)
    if args.prompt_format == "colar" or args.prompt_format == "auto" and trained:
        if args.url:
            why = ("--prompt-format colar" if args.prompt_format == "colar" else
                   f"automatic: --model {args.model} holds {trained}")
            raise ValueError(f"--url: the CoLaR prompt format ({why}) runs in-process only "
                             "(it sends token ids and reads latent stats an OpenAI-compatible "
                             "server does not give); leave --url out, or give --prompt-format "
                             "chat to evaluate the server in the chat format")
        base = read_baseline(args.baseline, colar=True) if args.baseline else None
        return run_colar(args, controls, base)
    args.dataset = args.dataset or "gsm8k"
    from latentserve.eval.run import check, evaluate, parse_sweep, plot_sweep

    if args.url:
        refuse_engine_flags(args)

    speed = args.compression_factor is not None or (
        args.sweep or "").partition("=")[0].strip() == "compression_factor"
    if speed or args.json_out:
        what = "--json-out" if args.json_out and not speed else "compression_factor"
        given = ("the embedded SmolLM2 is not one" if not args.model
                 else f"--model {args.model} is not one" if d is not None and d.exists()
                 else f"--model {args.model} does not exist")
        raise ValueError(f"{what} needs the CoLaR prompt format: a model directory holding "
                         f"colar_config.json or train_config.json ({given}), or "
                         f"--prompt-format colar")
    budgets = parse_sweep(args.sweep)[1] if args.sweep else [args.max_latent]
    if args.sweep and args.max_latent is not None:
        raise ValueError("--max-latent and --sweep both set the latent budget; give one")
    if controls and budgets == [None]:  # no latent phase runs: they would do nothing
        flags = [("--no-stop" if k == "use_stop" else "--" + k.replace("_", "-"))
                 for k in controls]
        raise ValueError(f"{', '.join(flags)} control{'s' if len(flags) == 1 else ''} a "
                         "compression head's latent phase, which runs only with --max-latent "
                         "or --sweep max_latent=...")
    base = read_baseline(args.baseline, colar=False) if args.baseline else None
    path = str(dataset_file(args.dataset, args.data_file, args.data_dir))
    items = load_items(args.dataset, path, args.limit)
    if args.url:
        backend = url_backend(args.url, args.api_model, args.api_key or "none",
                              args.concurrency or 16)
    else:
        from latentserve.cli import engine_config
        from latentserve.engine.llm_engine import LLMEngine
        from latentserve.eval.backends import EngineBackend

        backend = EngineBackend(LLMEngine(engine_config(args)))
    for b in budgets:  # before the first run: a sweep's last value would fail after the rest
        try:
            check(items, backend, args.max_tokens, b, **controls)
        except ValueError as exc:
            raise ValueError(f"--sweep max_latent={b}: {exc}" if args.sweep else str(exc)) \
                from None
    runs, records = [], {}
    for b in budgets:
        recs, summary = evaluate(items, backend, args.max_tokens, b, **controls)
        summary |= {"dataset": args.dataset, "dataset_file": path}
        runs.append(summary)
        records[str(b)] = recs
        print(json.dumps(summary), flush=True)
        if args.out:  # after every budget: a sweep cut off keeps what it finished
            Path(args.out).write_text(json.dumps({"dataset": args.dataset, "dataset_file": path,
                                                  "runs": runs, "records": records}, indent=1))
    if args.plot:
        plot_sweep({"head": runs}, args.plot, f"{args.dataset} (n={len(items)})", base)
    return 0


def check_paths(args) -> None:
    """Refuse before the run what only its end would trip on: an output path (``--out``,
    ``--json-out``, ``--plot``) that is empty, a folder (or ends with ``/``), lies in a
    missing folder or names the data file or another output; a ``--dataset-file`` that is a
    folder. ValueError / FileNotFoundError naming the flag."""
    outs = {flag: path for flag, path in (("--out", args.out), ("--json-out", args.json_out),
                                          ("--plot", args.plot)) if path is not None}
    for flag, path in outs.items():
        if not path or path.endswith(("/", os.sep)) or Path(path).is_dir():
            raise ValueError(f"{flag} {path!r} is not a file path")
        folder = Path(path).absolute().parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise FileNotFoundError(f"{flag} {path}: its folder {Path(path).parent} {what}")
    named = {}
    for flag, path in [("--dataset-file", args.data_file), ("--baseline", args.baseline),
                       *outs.items()]:
        if path is not None and (same := named.get(os.path.realpath(path))):
            raise ValueError(f"{flag} {path} is also {same}'s file; the run would overwrite it")
        if path is not None:
            named[os.path.realpath(path)] = flag
    if args.data_file is not None and Path(args.data_file).is_dir():
        raise ValueError(f"--dataset-file {args.data_file} is a folder; give a file (iCoT "
                         "text lines or GSM8K jsonl)")


def url_backend(url: str, model: str | None, api_key: str, concurrency: int):
    """``OpenAIBackend`` for ``url``, or ``url/v1`` when ``url`` answers 404. Raises
    ConnectionError naming the URLs tried when no server answered ``GET .../models``."""
    import openai

    from latentserve.eval.backends import OpenAIBackend

    base = url.rstrip("/")
    tries = [base] if base.endswith("/v1") else [base, base + "/v1"]
    for i, u in enumerate(tries):
        try:
            return OpenAIBackend(u, model, api_key, concurrency)
        except openai.NotFoundError:
            if i + 1 < len(tries):
                continue
            error = "404 Not Found"
        except openai.APIError as exc:  # the first call (models.list) reaches the server
            error = f"{type(exc).__name__}: {exc}"
        tried = " and ".join(f"GET {t}/models" for t in tries[:i + 1])
        raise ConnectionError(f"--url {url}: no OpenAI-compatible server answered {tried} "
                              f"({error}); give the server's base URL, e.g. "
                              "http://127.0.0.1:8000/v1")
