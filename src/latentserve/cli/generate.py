"""``latentserve generate``: one completion, printed as it decodes."""

from __future__ import annotations

import sys


def register(sub) -> None:
    from latentserve.cli import add_engine_args

    p = sub.add_parser("generate", help="complete one prompt, streamed to stdout")
    add_engine_args(p, exclude=("seed",))  # --seed below seeds the request and the engine
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text (with the model's chat template unless --raw)")
    what.add_argument("--prompt-token-ids", default=None,
                      help="comma-separated token ids, sent as they are (a model directory "
                           "without tokenizer files takes only these; its output is ids)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="answer tokens at most (default 256; given, it also holds for a "
                        "compression-head model, whose answer-budget floor otherwise raises "
                        "it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None,
                   help="the request's sampling seed (also the engine's; default: unseeded)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    p.add_argument("--latent-budget", type=int, default=None,
                   help="latent steps (feedback models), recurrences per token (Huginn, "
                        "Ouro) or block passes (PCCoT, LOTUS); default: the model's own; "
                        "0: no thinking")
    p.add_argument("--exit-criterion", default=None,
                   help="recurrent-depth early exit (docs/models.md), e.g. kl or "
                        "threshold")
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="compression-head models: latent thinking on or off (default: on)")
    p.add_argument("--max-latent", type=int, default=None,
                   help="compression-head models: latent step cap (default: the server's)")
    p.add_argument("--min-output-tokens", type=int, default=None,
                   help="compression-head models: the answer-budget floor (0: --max-tokens "
                        "holds; default: 0 when --max-tokens is given, else "
                        "LATENTSERVE_MIN_OUTPUT_TOKENS, 4096)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from latentserve.cli import engine_config
    from latentserve.detokenizer import IncrementalDetokenizer
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.models.checkpoint import NoTokenizer
    from latentserve.sampling_params import SamplingParams

    floor = args.min_output_tokens
    if floor is None and args.max_tokens is not None:
        floor = 0  # an explicit --max-tokens holds (the floor would raise it)
    max_tokens = 256 if args.max_tokens is None else args.max_tokens  # 0 is refused, not 256
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            latent_budget=args.latent_budget,
                            exit_criterion=args.exit_criterion,
                            exit_threshold=args.exit_threshold,
                            thinking=None if args.thinking is None else args.thinking == "on",
                            max_latent=args.max_latent,
                            min_output_tokens=floor)
    engine = LLMEngine(dataclasses.replace(engine_config(args), seed=args.seed or 0))
    head_flags = [f for f, v in (("--thinking", args.thinking), ("--max-latent", args.max_latent),
                                 ("--min-output-tokens", args.min_output_tokens))
                  if v is not None]
    # As on the server: thinking off is harmless on any model, and so are the other controls.
    if head_flags and args.thinking != "off" and not engine.family.takes_head_controls:
        raise ValueError(f"{head_flags[0]} needs a model with a compression head; this model "
                         "has none")
    tok = engine.tokenizer
    if args.prompt_token_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_token_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-token-ids must be comma-separated integers, got "
                             f"{args.prompt_token_ids!r}") from None
    elif args.raw or not getattr(tok, "chat_template", None):
        ids = tok.encode(args.prompt)
    else:
        ids = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                           add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
    engine.add_request("cli", ids, params)
    if isinstance(tok, NoTokenizer):  # ids out, one line
        out_ids = []
        while engine.has_unfinished_requests():
            out_ids += [t for out in engine.step() for t in out.new_token_ids]
        print(" ".join(map(str, out_ids)))
        return 0
    detok = IncrementalDetokenizer(tok, ids, params.stop, params.skip_special_tokens)
    n_answer, last = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            n_answer += len(out.new_token_ids)
            last = out
            sys.stdout.write(detok.add(out.new_token_ids))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    note = budget_note(last, n_answer)
    if note:
        print(f"latentserve: note: {note}", file=sys.stderr)
    return 0


def budget_note(final, n_answer: int) -> str | None:
    """The note when the latent phase took the whole budget (``final``: the last
    ``StepOutput``, ``n_answer`` answer tokens); None otherwise."""
    stats = getattr(final, "latent_stats", None) or {}
    steps = stats.get("steps") or 0
    if n_answer or final is None or final.finish_reason != "length" or not steps:
        return None
    return (f"the latent phase ({steps} steps) used the whole --max-tokens budget and no "
            "answer token was left; raise --max-tokens, or cap the thinking with "
            "--max-latent N (or --thinking off)")
