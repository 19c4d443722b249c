"""Per-token cost of incremental detokenization (``latentserve.detokenizer``) on the embedded
SmolLM2 tokenizer, on the CPU: ``DecodeStream`` (the fast path) against the Python window
(the fallback, the detokenizer's only path before; selected by handing it an object with
only ``decode``).

The text is the 40 bundled GSM8K questions (``data/questions.json``) as one output of about
2,400 tokens after a chat prompt; each pass feeds it one token at a time to a fresh
detokenizer and flushes it, without stop strings and with one that never matches (so the
held-back search runs on every token), the two paths' passes interleaved. Reports the fastest
of ``--repeats`` passes (the least disturbed by other work on a shared machine), in
microseconds per token, and checks that both paths give the same text.

Run: ``python -m benchmarks.detok [--repeats 15]``.
"""

from __future__ import annotations

import json
import time
from importlib import resources

from benchmarks.common import parser

CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


class _DecodeOnly:
    """The tokenizer seen through ``decode`` only (the detokenizer's window path)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs)


def _pass(tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[float, str]:
    from latentserve.detokenizer import IncrementalDetokenizer

    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    return time.perf_counter() - start, text


def run(repeats: int = 15) -> dict:
    """``{"tokens": n, "<path> / <stop>": us per token, ...}`` (fastest of ``repeats``)."""
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    data = json.loads(resources.files("latentserve.data").joinpath("questions.json").read_text())
    text = "\n\n".join(q["question"] for q in data["questions"])
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = tok(CHAT_PROMPT).input_ids
    out: dict = {"tokens": len(ids)}
    for stop_name, stop in (("no stop", []), ("one stop string", ["<never matches>"])):
        paths = {"DecodeStream": tok, "window": _DecodeOnly(tok)}
        times: dict[str, list[float]] = {p: [] for p in paths}
        texts = {}
        for _ in range(repeats):  # interleaved, so both paths see the same machine load
            for path, t in paths.items():
                seconds, texts[path] = _pass(t, prompt, ids, stop)
                times[path].append(seconds)
        for path in paths:
            out[f"{path} / {stop_name}"] = min(times[path]) / len(ids) * 1e6
        if texts["DecodeStream"] != texts["window"] or texts["window"] != tok.decode(ids):
            raise RuntimeError("the two detokenizer paths gave different text")
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("detok", __doc__)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    result = run(args.repeats)
    print(f"{result.pop('tokens')} tokens, same text on both paths")
    for name, us in result.items():
        print(f"{name:34s} {us:7.2f} us/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
