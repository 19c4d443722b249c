"""Reasoning output: a model's ``<think>...</think>`` text split from its answer
(``--reasoning-parser``), and a latent model's latent steps rendered as readable text.
Design notes: docs/internals.md, "latentserve.server.reasoning"."""

from __future__ import annotations

import json

from latentserve.server.errors import APIError
from latentserve.server.latent_trace import tick_entries
from latentserve.server.tool_parsers import Piece, split_held
from latentserve.token_masks import THINK_END, THINK_START

LATENT_REASONING = ("count", "logit_lens")
LOGIT_LENS_TOP = 3  # top tokens shown per latent step


class ThinkParser:
    """Splits one choice's streamed text at ``</think>``; ``implicit``: an output not opening
    with ``<think>`` is reasoning."""

    def __init__(self, implicit: bool):
        self.implicit = implicit
        self.state = "start"  # start (undecided) | reasoning | content
        self.buf = ""

    def feed(self, text: str) -> Piece:
        self.buf += text
        out = Piece()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_START):
                self.state, self.buf = "reasoning", head[len(THINK_START):]
            elif THINK_START.startswith(head):
                return out  # "" or "<thi": undecided
            else:
                self.state = "reasoning" if self.implicit else "content"
        if self.state == "reasoning":
            end = self.buf.find(THINK_END)
            if end < 0:
                out.reasoning, self.buf = split_held(self.buf, THINK_END)
                return out
            out.reasoning = self.buf[:end]
            self.state, self.buf = "content", self.buf[end + len(THINK_END):]
        out.content, self.buf = self.buf, ""
        return out

    def finish(self) -> Piece:
        """What is held back, at the end of the output."""
        held, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.implicit):
            return Piece(reasoning=held)
        return Piece(content=held)


def latent_count_text(steps: int) -> str:
    """``[12 latent steps]`` (``[1 latent step]``); "" for none."""
    return f"[{steps} latent step{'s' if steps != 1 else ''}]" if steps > 0 else ""


def latent_step_text(step: int, entry: dict | None, texts) -> str:
    """One latent step as a line, ``[step 3: "7", "8", " 7"]\\n`` (top tokens of ``entry`` as
    JSON strings; no entry: ``[step 3]\\n``); ``step`` counts from 1."""
    top = (entry or {}).get("top_tokens") or []
    if not top:
        return f"[step {step}]\n"
    shown = ", ".join(json.dumps(texts.text(int(t)), ensure_ascii=False)
                      for t, _ in top[:LOGIT_LENS_TOP])
    return f"[step {step}: {shown}]\n"


def latent_reasoning_mode(body, spec) -> str | None:
    """``"count"`` (the default, null, on a model with latent steps), ``"logit_lens"`` or None
    (no reasoning shown). APIError (400) for another value, ``"logit_lens"`` on a model that
    is not feedback-latent, or any value but null on a model without latent steps (plain,
    recurrent-depth: it would silently do nothing)."""
    mode = getattr(body, "latent_reasoning", None)
    if mode is not None and mode not in LATENT_REASONING:
        raise APIError(f"latent_reasoning must be one of {list(LATENT_REASONING)}, got "
                       f"{mode!r}", param="latent_reasoning")
    kind = getattr(spec, "kind", None)
    if mode == "logit_lens" and kind != "feedback":
        raise APIError("latent_reasoning 'logit_lens' needs a feedback-latent model (COCONUT, "
                       "CODI), whose latent steps the LM head can read; this model has "
                       f"{'none' if kind is None else kind + ' latent steps'}",
                       param="latent_reasoning")
    stepped = kind in ("feedback", "head", "loop")
    if mode is not None and not stepped:
        what = ("a recurrent-depth model" if kind is not None
                else "a model without latent reasoning")
        raise APIError(f"latent_reasoning needs a model with latent steps, not {what} (it would "
                       "silently do nothing); leave it out or null", param="latent_reasoning")
    if getattr(body, "include_reasoning", True) is False or not stepped:
        return None
    return mode or "count"


class LatentReasoning:
    """One streamed choice's latent steps as ``reasoning_content``: a line per step
    (``logit_lens`` or ``ticks``), else ``[N latent steps]`` once."""

    def __init__(self, mode: str, texts, ticks: bool = False):
        self.mode, self.texts = mode, texts
        self.per_step = mode == "logit_lens" or ticks
        self.steps_shown = 0
        self.count_shown = False

    def step_texts(self, delta) -> list[str]:
        """The reasoning texts one ``TextDelta`` releases, one per chunk."""
        if delta.latent_tick:
            entries = tick_entries(delta, self.steps_shown)
            first, self.steps_shown = self.steps_shown, self.steps_shown + len(entries)
            return [latent_step_text(first + i + 1, e if self.mode == "logit_lens" else None,
                                     self.texts)
                    for i, e in enumerate(entries)] if self.per_step else []
        if (not self.per_step and not self.count_shown and delta.latent_steps
                and (delta.text or delta.finish_reason is not None)):
            self.count_shown = True
            return [latent_count_text(delta.latent_steps)]
        return []


def latent_reasoning_text(mode: str, steps: int, trace: list[dict] | None, texts) -> str:
    """A whole response's latent reasoning: a line per ``trace`` entry, or the count."""
    if mode == "logit_lens":
        return "".join(latent_step_text(i + 1, e, texts) for i, e in enumerate(trace or []))
    return latent_count_text(steps)
