"""``latentserve generate``: one completion, printed as it decodes."""

from __future__ import annotations

import argparse
import sys

# The SamplingParams fields `generate` has a flag for (``--top-p`` for ``top_p``): each value is
# checked by SamplingParams's own check at parse time, and its errors name the flag and field.
_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "latent_budget",
           "exit_criterion", "exit_threshold", "thinking", "max_latent", "min_output_tokens")


def _sampling(conv, name: str):
    """An argparse ``type``: ``conv(text)`` refused (ArgumentTypeError, naming ``name``) when
    ``SamplingParams(name=value)`` refuses it, so the range is declared once."""
    def parse(text: str):
        from latentserve.sampling_params import SamplingParams

        value = conv(text)
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    parse.__name__ = conv.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _flag_error(exc: ValueError) -> ValueError:
    """A ``SamplingParams`` error that starts with a field name, with the flag first:
    ``--top-p (top_p) must be in (0.0, 1.0], got 2.0``."""
    name, _, rest = str(exc).partition(" ")
    flag = "--" + name.replace("_", "-")
    return ValueError(f"{flag} ({name}) {rest}") if name in _FIELDS else exc


def register(sub) -> None:
    from latentserve.cli import add_engine_args
    from latentserve.latent.exit_criteria import (
        EXIT_CRITERIA,
        HUGINN_AUTO_THRESHOLDS,
        OURO_CRITERIA,
    )

    p = sub.add_parser("generate", help="complete one prompt, streamed to stdout")
    add_engine_args(p, exclude=("seed",))  # --seed below seeds the request and the engine
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text (with the model's chat template unless --raw)")
    what.add_argument("--prompt-token-ids",
                      help="comma-separated token ids, sent as they are (a model directory "
                           "without tokenizer files takes only these; its output is ids)")
    p.add_argument("--max-tokens", type=_sampling(int, "max_tokens"),
                   help="answer tokens at most (default 256; given, it also holds for a "
                        "compression-head model, whose answer-budget floor otherwise raises "
                        "it)")
    p.add_argument("--temperature", type=_sampling(float, "temperature"), default=0.0)
    p.add_argument("--top-p", type=_sampling(float, "top_p"), default=1.0)
    p.add_argument("--top-k", type=_sampling(int, "top_k"), default=-1)
    p.add_argument("--seed", type=_sampling(int, "seed"),
                   help="the request's sampling seed (also the engine's; default: unseeded)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    p.add_argument("--latent-budget", type=_sampling(int, "latent_budget"),
                   help="latent steps (feedback models), recurrences per token (Huginn, "
                        "Ouro) or block passes (PCCoT, LOTUS); default: the model's own; "
                        "0: no thinking")
    p.add_argument("--exit-criterion", choices=EXIT_CRITERIA,
                   help=f"recurrent-depth early exit (docs/models.md); Huginn takes "
                        f"{', '.join([*HUGINN_AUTO_THRESHOLDS, 'none'])}, Ouro "
                        f"{', '.join(OURO_CRITERIA)}")
    p.add_argument("--exit-threshold", type=_sampling(float, "exit_threshold"))
    p.add_argument("--thinking", choices=["on", "off"],
                   help="latent thinking on or off (default: on): a compression head's or "
                        "CoLaR's latent phase; a feedback model's latent steps (off: none)")
    p.add_argument("--max-latent", type=_sampling(int, "max_latent"),
                   help="compression-head and CoLaR models: latent step cap (default: the "
                        "server's, CoLaR's colar_config.json)")
    p.add_argument("--min-output-tokens", type=_sampling(int, "min_output_tokens"),
                   help="compression-head models: the answer-budget floor (0: --max-tokens "
                        "holds; default: 0 when --max-tokens is given, else "
                        "LATENTSERVE_MIN_OUTPUT_TOKENS, 4096)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from latentserve.cli import engine_config
    from latentserve.detokenizer import IncrementalDetokenizer
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.eval.datasets import chat_prompt_ids
    from latentserve.models.checkpoint import NoTokenizer
    from latentserve.sampling_params import SamplingParams

    floor = args.min_output_tokens
    if floor is None and args.max_tokens is not None:
        floor = 0  # an explicit --max-tokens holds (the floor would raise it)
    max_tokens = 256 if args.max_tokens is None else args.max_tokens  # 0 is refused, not 256
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, latent_budget=args.latent_budget,
            exit_criterion=args.exit_criterion, exit_threshold=args.exit_threshold,
            thinking=None if args.thinking is None else args.thinking == "on",
            max_latent=args.max_latent, min_output_tokens=floor)
    except ValueError as exc:
        raise _flag_error(exc) from None
    engine = LLMEngine(dataclasses.replace(engine_config(args), seed=args.seed or 0))
    if args.min_output_tokens is None and "min_output_tokens" not in (
            getattr(engine.latent_spec, "controls", None) or ()):
        params = dataclasses.replace(params, min_output_tokens=None)  # no floor (CoLaR) to lift
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
    else:
        ids = tok.encode(args.prompt) if args.raw else chat_prompt_ids(tok, args.prompt)
    engine.add_request("cli", ids, params)
    detok = None if isinstance(tok, NoTokenizer) else IncrementalDetokenizer(
        tok, ids, params.stop, params.skip_special_tokens)
    out_ids, last = [], None
    while engine.has_unfinished_requests():
        for last in engine.step():
            out_ids += last.new_token_ids
            if detok is not None:
                sys.stdout.write(detok.add(last.new_token_ids))
                sys.stdout.flush()
    if detok is None:  # ids out, one line
        print(" ".join(map(str, out_ids)))
        return 0
    sys.stdout.write(detok.flush() + "\n")
    steps = (getattr(last, "latent_stats", None) or {}).get("steps") or 0
    if not out_ids and last is not None and last.finish_reason == "length" and steps:
        print(f"latentserve: note: the latent phase ({steps} steps) used the whole --max-tokens "
              "budget and no answer token was left; raise --max-tokens, or cap the thinking "
              "with --max-latent N (or --thinking off)", file=sys.stderr)
    return 0
