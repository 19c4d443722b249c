"""``--chat-template``: a file or the template itself, as vLLM reads it
(``load_chat_template`` in ``vllm/entrypoints/chat_utils.py``)."""

from __future__ import annotations

import codecs

# A value with none of these characters is taken for a file path.
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The Jinja text of ``value``: the file's text when it can be read, else ``value``
    itself with its backslash escapes decoded (``\\n`` in a one-line template); None: none.

    Raises:
        ValueError: a value that looks like a path (no ``{``, ``}`` or newline) and cannot
            be read, or text that is not a valid Jinja template; the message names
            ``--chat-template``.
    """
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
    """Make ``template`` the chat template of ``tokenizer`` (None: leave it as it is).

    Raises:
        ValueError: the model has no tokenizer (token ids only) to take a template.
    """
    if template is None:
        return
    from latentserve.models.checkpoint import NoTokenizer

    if isinstance(tokenizer, NoTokenizer):
        msg = "--chat-template: this model directory has no tokenizer files (token ids only)"
        raise ValueError(msg)  # noqa: TRY004 - a bad flag value: the CLI's one-line error
    tokenizer.chat_template = template


TRUST_FLAG = "--trust-request-chat-template"


def request_chat_template(template: str | None, trusted: bool) -> str | None:
    """A request's ``chat_template`` (vLLM's field: Jinja text used instead of the model's
    template), checked; None: the model's. As vLLM, the server must trust request templates
    (``--trust-request-chat-template``, off by default: a template is code the server runs,
    and a slow one holds a tokenizer worker); ``_validate_chat_template`` in
    ``vllm/entrypoints/openai/serving_engine.py``.

    Raises:
        APIError: 400 naming ``chat_template`` when the server does not trust request
            templates or the text is not a valid Jinja template.
    """
    if template is None:
        return None
    from latentserve.server.errors import APIError

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
