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
    """``(openai.OpenAI client, model name)``; the model named, else the server's first."""
    import openai

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
    shown on a terminal) until end of input."""
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
        if line.strip():
            yield line.rstrip("\n")


def _extra(args) -> dict:
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def run_chat(args, out=None) -> int:
    """Chat: each turn streamed to ``out`` (default stdout), the conversation kept; a
    server error ends the command with its message (ValueError)."""
    import openai

    out = out or sys.stdout
    client, model = _connect(args)
    messages = [] if args.system_prompt is None else [{"role": "system",
                                                       "content": args.system_prompt}]
    for text in _turns(args, out):
        messages.append({"role": "user", "content": text})
        answer = []
        try:
            stream = client.chat.completions.create(model=model, messages=messages,
                                                    stream=True, **_extra(args))
            thinking = False
            for chunk in stream:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                reasoning = getattr(delta, "reasoning_content", None)
                if reasoning:
                    out.write(("" if thinking else "[") + reasoning)
                    thinking = True
                if delta.content:
                    out.write(("] " if thinking else "") + delta.content)
                    thinking = False
                    answer.append(delta.content)
                out.flush()
            out.write("]\n" if thinking else "\n")
        except openai.APIError as exc:
            raise ValueError(f"the server refused the message: {exc}") from None
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 0


def run_complete(args, out=None) -> int:
    """Complete each prompt, streamed to ``out`` (default stdout); no history."""
    import openai

    out = out or sys.stdout
    client, model = _connect(args)
    for text in _turns(args, out):
        try:
            for chunk in client.completions.create(model=model, prompt=text, stream=True,
                                                   **_extra(args)):
                if chunk.choices:
                    out.write(chunk.choices[0].text)
                    out.flush()
            out.write("\n")
        except openai.APIError as exc:
            raise ValueError(f"the server refused the prompt: {exc}") from None
    return 0
