"""``latentserve chat`` and ``latentserve complete``: a terminal client of a running server
through the ``openai`` package, with vLLM's ``vllm chat`` / ``vllm complete`` flags."""

from __future__ import annotations

import os
import sys

DEFAULT_URL = "http://localhost:8000/v1"


def register(sub) -> None:
    from latentserve.options import ranged

    for name, helptext in (("chat", "chat with a running server, streaming its answers"),
                           ("complete", "complete prompts on a running server")):
        p = sub.add_parser(name, help=helptext,
                           description=f"{helptext[0].upper()}{helptext[1:]} (one line a "
                                       "turn; end with Ctrl-D). Reasoning, latent steps "
                                       "included, is shown in brackets where the server "
                                       "sends it.")
        p.add_argument("--url", default=DEFAULT_URL,
                       help=f"the server's OpenAI API base (default {DEFAULT_URL})")
        p.add_argument("--model-name",
                       help="the model to ask (default: the first of /v1/models)")
        p.add_argument("--api-key",
                       help="the server's API key (default: $OPENAI_API_KEY, else none)")
        p.add_argument("-q", "--quick", metavar="MESSAGE" if name == "chat" else "PROMPT",
                       help="send this one message (prompt), print the answer and exit")
        p.add_argument("--max-tokens", type=ranged(int, "max_tokens", ge=1),
                       help="answer tokens per turn (default: the server's)")
        if name == "chat":
            p.add_argument("--system-prompt", help="a system message opening the chat")
        p.set_defaults(func=run_chat if name == "chat" else run_complete)


def _connect(args):
    """``(openai.OpenAI client, model name)``; the model named, else the server's first.
    ValueError naming ``--url`` for an address that is not an http(s) URL or where no
    server answers."""
    import httpx
    import openai

    try:
        url = httpx.URL(args.url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"--url {args.url!r} is not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"--url must be an http:// or https:// address, got {args.url!r}")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=key, max_retries=0)
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIConnectionError:
        raise ValueError(f"no server answers at {args.url} (--url)") from None
    except openai.APIError as exc:
        raise ValueError(f"the server at {args.url} refused to list its models: {exc}"
                         ) from None
    except IndexError:
        raise ValueError(f"the server at {args.url} serves no model") from None
    return client, model


def _turns(args, out):
    """The user's inputs: ``--quick`` alone, else one line a turn read from stdin (``> ``
    shown on a terminal) until end of input. ValueError for a line that is not UTF-8."""
    if args.quick is not None:
        yield args.quick
        return
    while True:
        if sys.stdin.isatty():
            out.write("> ")
            out.flush()
        line = sys.stdin.readline()
        if not line:
            return
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("an input line is not valid UTF-8") from None
        if line.strip():
            yield line.rstrip("\n")


def _extra(args) -> dict:
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def _turn(args, out, stream, text_of) -> str | None:
    """Write one streamed answer to ``out`` (``text_of(chunk)``: ``(reasoning, text)``);
    returns its text, or None when the server refused it: with ``--quick`` a ValueError,
    else the error on stderr and the session goes on. ValueError when the connection is
    lost."""
    import openai

    parts: list[str] = []
    started = thinking = False
    try:
        for chunk in stream():
            reasoning, text = text_of(chunk)
            if reasoning:
                out.write(("" if thinking else "[") + reasoning)
                started = thinking = True
            if text:
                out.write(("] " if thinking else "") + text)
                started, thinking = True, False
                parts.append(text)
            out.flush()
        out.write("]\n" if thinking else "\n")
        return "".join(parts)
    except openai.APIConnectionError:
        if started:
            out.write("\n")
            raise ValueError(f"lost the connection to {args.url}") from None
        raise ValueError(f"no server answers at {args.url} (--url)") from None
    except openai.APIError as exc:
        if started:
            out.write("\n")
        if args.quick is not None:
            raise ValueError(f"the server refused the request: {exc}") from None
        print(f"latentserve: the server refused the request: {exc}", file=sys.stderr)
        return None


def _run(args, out, ask) -> int:
    """Each turn through ``ask(text)`` (a :func:`_turn` result); a closed stdout ends the
    command quietly (``... | head``)."""
    out = out or sys.stdout
    try:
        for text in _turns(args, out):
            ask(text, out)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's flush at exit: no error
    return 0


def run_chat(args, out=None) -> int:
    """Chat: each turn streamed to ``out`` (default stdout), the conversation kept (a
    refused turn is dropped from it)."""
    client, model = _connect(args)
    messages = [] if args.system_prompt is None else [{"role": "system",
                                                       "content": args.system_prompt}]

    def ask(text: str, out) -> None:
        sent = [*messages, {"role": "user", "content": text}]

        def stream():
            return client.chat.completions.create(model=model, messages=sent, stream=True,
                                                  **_extra(args))

        def text_of(chunk):
            if not chunk.choices:
                return None, None
            delta = chunk.choices[0].delta
            return getattr(delta, "reasoning_content", None), delta.content

        answer = _turn(args, out, stream, text_of)
        if answer is not None:
            messages[:] = [*sent, {"role": "assistant", "content": answer}]

    return _run(args, out, ask)


def run_complete(args, out=None) -> int:
    """Complete each prompt, streamed to ``out`` (default stdout); no history."""
    client, model = _connect(args)

    def ask(text: str, out) -> None:
        def stream():
            return client.completions.create(model=model, prompt=text, stream=True,
                                             **_extra(args))

        _turn(args, out, stream,
              lambda c: (None, c.choices[0].text if c.choices else None))

    return _run(args, out, ask)
