"""Tool calls parsed out of a model's text (``--tool-call-parser``), streamed or whole, and
the pieces every output parser releases.
Design notes: docs/internals.md, "latentserve.server.tool_parsers"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def split_held(text: str, tag: str) -> tuple[str, str]:
    """``text`` split before its longest suffix that is a proper prefix of ``tag`` (held
    back until more text decides it)."""
    n = next((n for n in range(min(len(text), len(tag) - 1), 0, -1)
              if tag.startswith(text[-n:])), 0)
    return text[:len(text) - n], text[len(text) - n:]


@dataclass(slots=True)
class CallDelta:
    """Call ``index`` or a piece of it: ``id`` and ``name`` on its first piece, then
    ``arguments`` (whole: a JSON object string); the parsers here leave ``index`` and ``id``
    to ``OutputParser``."""

    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Piece:
    """What a parser releases of a choice: reasoning and content (answer) text, call pieces;
    either text may be ""."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.reasoning + other.reasoning, self.content + other.content,
                     self.calls + other.calls)


def parse_call(raw, key: str = "arguments") -> CallDelta | None:
    """The call ``raw`` holds (``{"name": str, key: object or JSON string}``, as JSON text or
    decoded), or None."""
    try:
        obj = json.loads(raw) if isinstance(raw, str) else raw
        args = obj.get(key, {}) if isinstance(obj, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict) or not isinstance(obj.get("name"), str):
        return None
    return CallDelta(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def required_calls(text: str) -> list[CallDelta] | None:
    """The calls of a ``required`` answer (``[{"name", "parameters"}, ...]``), or None."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        return None
    calls = [parse_call(i, "parameters") for i in items]
    return None if None in calls else calls


class HermesToolParser:
    """One choice's answer text -> content and calls: :meth:`feed` each delta, then
    :meth:`finish`; the pieces equal those of the whole text fed at once."""

    @staticmethod
    def structural_tag(tools: dict[str, dict], single: bool) -> dict:
        """The structural tag (xgrammar's format) that decodes an answer this parser reads:
        free text, and each ``<tool_call>`` block a call of one of ``tools`` (by name: its
        function dict) whose arguments follow its ``parameters`` when it is ``strict``, else
        any JSON object; ``single``: the answer ends after its first call."""
        tags = [{"type": "tag",
                 "begin": f'{CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": (
                     fn.get("parameters") or {"type": "object", "properties": {}}
                     if fn.get("strict") else {"type": "object"})},
                 "end": f"}}\n{CALL_END}"} for name, fn in tools.items()]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [CALL_START], "tags": tags,
            "at_least_one": False, "stop_after_first": single}}

    def __init__(self):
        self.inside = False
        self.buf = ""
        self.after_block = False  # drop whitespace until the first text after a block
        self.ws_before = ""  # the whitespace dropped before the open block

    def feed(self, text: str) -> Piece:
        self.buf += text
        out = Piece()
        while True:
            if self.inside:
                end = self.buf.find(CALL_END)
                if end < 0:
                    return out
                self._close(self.buf[:end], out)
                self.buf = self.buf[end + len(CALL_END):]
                continue
            if self.after_block:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.after_block = False
            start = self.buf.find(CALL_START)
            if start >= 0:
                text = self.buf[:start]
                out.content += text.rstrip()
                self.ws_before = text[len(text.rstrip()):]
                self.inside, self.buf = True, self.buf[start + len(CALL_START):]
                continue
            text, tail = split_held(self.buf, CALL_START)
            ws = len(text) - len(text.rstrip())  # may precede a block: held too
            out.content += text[:len(text) - ws]
            self.buf = text[len(text) - ws:] + tail
            return out

    def _close(self, raw: str, out: Piece, end: str = CALL_END) -> None:
        """The block ``raw`` as a call, or back in the text (closed by ``end``)."""
        call = parse_call(raw)
        if call is not None:
            out.calls.append(call)
        else:
            out.content += self.ws_before + CALL_START + raw + end
        self.inside, self.after_block = False, call is not None

    def finish(self) -> Piece:
        """What is held back, at the end: a block left open is parsed, else left as text."""
        out = Piece()
        held, self.buf = self.buf, ""
        if self.inside:
            self._close(held, out, end="")
        elif not self.after_block:
            out.content = held
        return out


TOOL_PARSERS = {"hermes": HermesToolParser}
