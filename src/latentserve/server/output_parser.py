"""One chat choice's text -> reasoning, answer and tool calls, streamed or whole.
Design notes: docs/internals.md, "latentserve.server.output_parser"."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from latentserve.server.reasoning import ThinkParser
from latentserve.server.tool_parsers import CALL_END, CALL_START, TOOL_PARSERS, ParsedCall
from latentserve.server.tools import ToolChoice, call_schema, json_constraint, new_call_id
from latentserve.token_masks import REASONING_PARSERS, THINK_END, THINK_START


@dataclass(slots=True)
class CallDelta:
    """A piece of call ``index``: ``id`` and ``name`` on its first piece, then ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Piece:
    """What one step releases of a choice: reasoning and content text, call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass(slots=True)
class Call:
    """A whole call: :class:`CallDelta` s of one index joined."""

    id: str
    name: str
    arguments: str


class OutputParser:
    """Splits a choice's text: calls by the tool parser for ``auto``, the whole answer as a
    ``named`` choice's arguments or a JSON array of calls for ``required``."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 choice: ToolChoice | None = None, include_reasoning: bool = True,
                 id_prefix: str = "call_"):
        self.think = (ThinkParser(REASONING_PARSERS[reasoning_parser])
                      if reasoning_parser else None)
        self.mode = choice.mode if choice is not None else "none"
        self.name = choice.name if choice is not None else None
        self.single = bool(choice is not None and choice.single)
        self.tools = (TOOL_PARSERS[tool_parser]() if tool_parser and self.mode == "auto"
                      else None)
        self.include_reasoning = include_reasoning
        self.id_prefix = id_prefix
        self.num_calls = 0
        self.required_text = ""  # required: the answer, parsed at the end
        self.named_open = False

    def feed(self, text: str) -> Piece:
        """The piece released by one more text delta."""
        return self._release(text, final=False)

    def finish(self) -> Piece:
        """What is held back, at the end of the output."""
        return self._release("", final=True)

    def step(self, text: str, final: bool) -> Piece:
        """:meth:`feed`, joined with :meth:`finish` when ``final``."""
        out = self.feed(text)
        if final:
            rest = self.finish()
            out = Piece(out.reasoning + rest.reasoning, out.content + rest.content,
                        out.calls + rest.calls)
        return out

    def _release(self, text: str, final: bool) -> Piece:
        if self.think is None:
            return self._answer(text, final)
        split = self.think.finish() if final else self.think.feed(text)
        out = self._answer(split.content, final)
        out.reasoning = split.reasoning if self.include_reasoning else ""
        return out

    def _answer(self, text: str, final: bool) -> Piece:
        out = Piece()
        if self.mode == "named":
            if not self.named_open and (text or final):
                self.named_open = True
                out.calls.append(self._new_call(self.name, ""))
            if text:
                out.calls.append(CallDelta(0, arguments=text))
        elif self.mode == "required":
            self.required_text += text
            if final:
                calls = _required_calls(self.required_text)
                if calls is None:  # cut short (length): the text as it is
                    out.content = self.required_text
                for c in calls or []:
                    out.calls.append(self._new_call(c.name, c.arguments))
        elif self.tools is not None:
            parsed = self.tools.feed(text)
            if final:
                rest = self.tools.finish()
                parsed.content += rest.content
                parsed.calls += rest.calls
            out.content = parsed.content
            for c in parsed.calls:
                if not (self.single and self.num_calls):
                    out.calls.append(self._new_call(c.name, c.arguments))
        else:
            out.content = text
        return out

    def _new_call(self, name: str, arguments: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, new_call_id(self.id_prefix), name, arguments)


def _required_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a ``required`` answer (``[{"name", "parameters"}, ...]``), or None."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str)
            and isinstance(i.get("parameters", {}), dict) for i in items):
        return None
    return [ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
            for i in items]


def join_calls(pieces: list[CallDelta]) -> list[Call]:
    """Call pieces (in stream order) joined per index."""
    calls: dict[int, Call] = {}
    for p in pieces:
        if p.index not in calls:
            calls[p.index] = Call(p.id or "", p.name or "", "")
        calls[p.index].arguments += p.arguments
    return [calls[i] for i in sorted(calls)]


def parse_output(parser: OutputParser, text: str) -> tuple[str, str, list[Call]]:
    """``(reasoning, content, calls)`` of a whole output."""
    p = parser.step(text, final=True)
    return p.reasoning, p.content, join_calls(p.calls)


def drops_tags(tokenizer, parser: OutputParser) -> bool:
    """Whether ``tokenizer`` marks a tag ``parser`` looks for as special (which
    ``skip_special_tokens`` would drop; vLLM's hermes parser keeps them too)."""
    tags = set()
    if parser.think is not None:
        tags |= {THINK_START, THINK_END}
    if parser.tools is not None:
        tags |= {CALL_START, CALL_END}
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    return any(getattr(t, "special", False) and str(getattr(t, "content", t)) in tags
               for t in added)


def answer_params(params, choice: ToolChoice, tools: dict[str, dict], latent_mode: str | None,
                  tokenizer, parser: OutputParser):
    """``params`` with a forced call's JSON schema, per-step traces for ``logit_lens`` and
    special tokens kept when :func:`drops_tags`. APIError from ``json_constraint``."""

    schema = call_schema(choice, tools)
    if schema is not None:
        params = json_constraint(params, schema)
    if latent_mode == "logit_lens":  # each step's logit lens arrives with its tick
        params = dataclasses.replace(params, return_latent_trace=True, stream_latent_steps=True)
    if drops_tags(tokenizer, parser):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
