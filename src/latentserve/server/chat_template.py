"""``--chat-template``: a file or the template itself, as vLLM reads it
(``load_chat_template`` in ``vllm/entrypoints/chat_utils.py``)."""

from __future__ import annotations

import codecs

from latentserve.models.checkpoint import NoTokenizer
from latentserve.server.errors import APIError

# A value with none of these characters is taken for a file path.
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The Jinja text of ``value``: a file's text, else ``value`` unescaped. ValueError for an
    unreadable path (no ``{``, ``}`` or newline) or invalid Jinja."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read: {exc.strerror or exc}") from None
        text = codecs.decode(value, "unicode_escape")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template is not a valid Jinja template: {exc}") from None
    return text


def apply_chat_template(tokenizer, template: str | None) -> None:
    """Make ``template`` (unless None) the chat template of ``tokenizer``; ValueError."""
    if template is None:
        return

    if isinstance(tokenizer, NoTokenizer):
        msg = "--chat-template: this model directory has no tokenizer files (token ids only)"
        raise ValueError(msg)  # noqa: TRY004 - a bad flag value: the CLI's one-line error
    tokenizer.chat_template = template


TRUST_FLAG = "--trust-request-chat-template"


def request_chat_template(template: str | None, trusted: bool) -> str | None:
    """A request's ``chat_template``, checked as vLLM's ``_validate_chat_template``; APIError
    (400) without ``--trust-request-chat-template`` or for invalid Jinja."""

    if template is None:
        return None

    if not trusted:
        raise APIError(f"chat_template: a chat template was passed with the request, but the "
                       f"server was not started with {TRUST_FLAG}; the request is refused",
                       param="chat_template")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise APIError(f"chat_template is not a valid Jinja template: {exc}",
                       param="chat_template") from None
    return template
