"""One chat choice's text -> reasoning, answer and tool calls, streamed or whole.
Design notes: docs/internals.md, "latentserve.server.output_parser"."""

from __future__ import annotations

import dataclasses
import uuid

from latentserve.sampling_params import StructuredOutputsParams
from latentserve.server.errors import APIError
from latentserve.server.reasoning import ThinkParser
from latentserve.server.tool_parsers import (
    CALL_END,
    CALL_START,
    TOOL_PARSERS,
    CallDelta,
    Piece,
    required_calls,
)
from latentserve.server.tools import ToolChoice, call_schema
from latentserve.token_masks import REASONING_PARSERS, THINK_END, THINK_START


class OutputParser:
    """Splits a choice's text: calls by the tool parser for ``auto``, the whole answer as a
    ``named`` choice's arguments or a JSON array of calls for ``required``. ``opened``:
    whether the answer starts inside its reasoning (``token_masks.reasoning_open`` of the
    prompt, the engine's rule), so that an answer not opening with ``<think>`` is reasoning
    up to ``</think>``; None: the parser's default (``deepseek_r1`` yes, ``qwen3`` no)."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 choice: ToolChoice | None = None, include_reasoning: bool = True,
                 id_prefix: str = "call_", opened: bool | None = None):
        implicit = REASONING_PARSERS.get(reasoning_parser) if opened is None else opened
        self.think = ThinkParser(bool(implicit)) if reasoning_parser else None
        choice = choice or ToolChoice("none")
        self.mode, self.name, self.single = choice.mode, choice.name, choice.single
        self.tools = (TOOL_PARSERS[tool_parser]() if tool_parser and self.mode == "auto"
                      else None)
        self.include_reasoning = include_reasoning
        self.id_prefix = id_prefix
        self.num_calls = 0
        self.required_text = ""  # required: the answer, parsed at the end

    def step(self, text: str, final: bool = False) -> Piece:
        """The piece released by one more text delta; ``final``: with what is held back, at
        the end of the output."""
        split = _step(self.think, text, final) if self.think else Piece(content=text)
        out = self._answer(split.content, final)
        out.reasoning = split.reasoning if self.include_reasoning else ""
        return out

    def _answer(self, text: str, final: bool) -> Piece:
        out = Piece()
        if self.mode == "named":
            if not self.num_calls and (text or final):
                out.calls.append(self._new_call(self.name, ""))
            if text:
                out.calls.append(CallDelta(0, arguments=text))
        elif self.mode == "required":
            self.required_text += text
            if final:
                calls = required_calls(self.required_text)
                if calls is None:  # cut short (length): the text as it is
                    out.content = self.required_text
                for c in calls or []:
                    out.calls.append(self._new_call(c.name, c.arguments))
        elif self.tools is not None:
            parsed = _step(self.tools, text, final)
            out.content = parsed.content
            for c in parsed.calls:
                if not (self.single and self.num_calls):
                    out.calls.append(self._new_call(c.name, c.arguments))
        else:
            out.content = text
        return out

    def _new_call(self, name: str, arguments: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, self.id_prefix + uuid.uuid4().hex[:24], name,
                         arguments)


def _step(parser, text: str, final: bool) -> Piece:
    """``parser.feed(text)``, and ``parser.finish()`` when ``final``."""
    out = parser.feed(text)
    return out + parser.finish() if final else out


def join_calls(pieces: list[CallDelta]) -> list[CallDelta]:
    """Call pieces (in stream order) joined per index."""
    calls: dict[int, CallDelta] = {}
    for p in pieces:
        call = calls.setdefault(p.index, CallDelta(p.index, p.id or "", p.name or ""))
        call.arguments += p.arguments
    return [calls[i] for i in sorted(calls)]


def parse_output(parser: OutputParser, text: str) -> tuple[str, str, list[CallDelta]]:
    """``(reasoning, content, calls)`` of a whole output."""
    p = parser.step(text, final=True)
    return p.reasoning, p.content, join_calls(p.calls)


def drops_tags(tokenizer, parser: OutputParser) -> bool:
    """Whether ``tokenizer`` marks a tag ``parser`` looks for as special (which
    ``skip_special_tokens`` would drop; vLLM's hermes parser keeps them too)."""
    tags = {*((THINK_START, THINK_END) if parser.think is not None else ()),
            *((CALL_START, CALL_END) if parser.tools is not None else ())}
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    return any(getattr(t, "special", False) and str(getattr(t, "content", t)) in tags
               for t in added)


def answer_params(params, choice: ToolChoice, tools: dict[str, dict], latent_mode: str | None,
                  tokenizer, parser: OutputParser,
                  field=lambda i, key: f"tools[{i}].function.{key}"):
    """``params`` with a forced call's JSON schema (or, under ``auto`` with a ``strict`` tool,
    the tool parser's structural tag), per-step traces for ``logit_lens`` and special tokens
    kept when :func:`drops_tags`. APIError (400 naming ``tool_choice``, or ``tools`` for a
    strict tool) with the request's own structured output; a schema the engine refuses is a
    400 naming the tool's ``field(i, "parameters")`` when one tool's schema is decoded
    (a named function, or the only tool), else ``tools``."""
    kind, param = {"json": call_schema(choice, tools)}, "tool_choice"
    names = list(tools)
    schema_param = (field(names.index(choice.name), "parameters") if choice.mode == "named"
                    else field(0, "parameters") if len(names) == 1 else "tools")
    if parser.tools is not None and any(fn.get("strict") for fn in tools.values()):
        kind, param = {"structural_tag": parser.tools.structural_tag(tools, choice.single)}, "tools"
        schema_param = "tools"
    if None not in kind.values():
        if params.structured_outputs is not None:
            what = "a forced tool call" if param == "tool_choice" else "a strict tool's call"
            raise APIError(f"{param}: {what} is decoded under its own JSON schema; it cannot "
                           f"be combined with {params.structured_outputs.param}", param=param)
        param = schema_param
        try:
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
                **kind, param=param))
        except (TypeError, ValueError) as exc:  # named once, however the message begins
            raise APIError(f"{param}: {str(exc).removeprefix(param).lstrip(': ')}",
                           param=param) from None
    if latent_mode == "logit_lens":  # each step's logit lens arrives with its tick
        params = dataclasses.replace(params, return_latent_trace=True, stream_latent_steps=True)
    if drops_tags(tokenizer, parser):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
