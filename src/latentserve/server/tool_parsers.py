"""Tool calls parsed out of a model's text (``--tool-call-parser``), streamed or whole.
Design notes: docs/internals.md, "latentserve.server.tool_parsers"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from latentserve.server.reasoning import held_prefix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ParsedCall:
    """One call the model wrote: ``name`` and ``arguments`` (a JSON object string)."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """What a parser releases: answer text and complete calls."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def parse_call(raw, key: str = "arguments") -> ParsedCall | None:
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
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def required_calls(text: str) -> list[ParsedCall] | None:
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

    def __init__(self):
        self.inside = False
        self.buf = ""
        self.after_block = False  # drop whitespace until the first text after a block
        self.ws_before = ""  # the whitespace dropped before the open block

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
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
            keep = held_prefix(self.buf, CALL_START)
            text, tail = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            ws = len(text) - len(text.rstrip())  # may precede a block: held too
            out.content += text[:len(text) - ws]
            self.buf = text[len(text) - ws:] + tail
            return out

    def _close(self, raw: str, out: Parsed, end: str = CALL_END) -> None:
        """The block ``raw`` as a call, or back in the text (closed by ``end``)."""
        call = parse_call(raw)
        if call is not None:
            out.calls.append(call)
        else:
            out.content += self.ws_before + CALL_START + raw + end
        self.inside, self.after_block = False, call is not None

    def finish(self) -> Parsed:
        """What is held back, at the end: a block left open is parsed, else left as text."""
        out = Parsed()
        held, self.buf = self.buf, ""
        if self.inside:
            self._close(held, out, end="")
        elif not self.after_block:
            out.content = held
        return out


TOOL_PARSERS = {"hermes": HermesToolParser}
