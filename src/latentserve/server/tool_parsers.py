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


def parse_call(raw: str) -> ParsedCall | None:
    """The call a block holds (``{"name": str, "arguments": object or JSON string}``), or
    None."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


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

    def _close(self, raw: str, out: Parsed) -> None:
        call = parse_call(raw)
        if call is not None:
            out.calls.append(call)
        else:  # not a call: the block stays in the text
            out.content += self.ws_before + CALL_START + raw + CALL_END
        self.inside, self.after_block = False, call is not None

    def finish(self) -> Parsed:
        """What is held back, at the end: a block left open is parsed, else left as text."""

        out = Parsed()
        held, self.buf = self.buf, ""
        if self.inside:
            call = parse_call(held)
            if call is not None:
                out.calls.append(call)
            else:
                out.content = self.ws_before + CALL_START + held
        elif not self.after_block:
            out.content = held
        return out


TOOL_PARSERS = {"hermes": HermesToolParser}
