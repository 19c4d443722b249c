"""Engine ``TokenLogprob``s -> the OpenAI chat and completions ``logprobs`` objects.
Design notes: docs/internals.md, "latentserve.server.logprobs"."""

from __future__ import annotations

import contextlib
import functools
import json
import re

from latentserve.outputs import TokenLogprob

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable stand-in character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class TokenTexts:
    """Per-tokenizer token id -> (text, bytes), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = {int(i): str(getattr(t, "content", t))
                      for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        try:
            self.byte_level = "ByteLevel" in json.dumps(
                json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
        except Exception:  # noqa: BLE001 - no or an unknown backend: plain pieces
            self.byte_level = False
        self.get = functools.lru_cache(maxsize=200_000)(self._get)

    def _get(self, token_id: int) -> tuple[str, bytes]:
        """``(text, raw bytes)`` of one token (``get``: cached)."""
        if token_id in self.added:
            raw = self.added[token_id].encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            piece = "" if piece is None else str(piece)
            dec = _byte_decoder()
            sp = _SP_BYTE.match(piece)
            if sp:
                raw = bytes([int(sp.group(1), 16)])
            elif self.byte_level and piece and all(c in dec for c in piece):
                raw = bytes(dec[c] for c in piece)
            else:
                raw = piece.replace("\u2581", " ").encode()
        return raw.decode("utf-8", errors="replace"), raw

    def text(self, token_id: int, as_ids: bool = False) -> str:
        return f"token_id:{token_id}" if as_ids else self.get(token_id)[0]


def token_texts(tokenizer) -> TokenTexts:
    """The (cached, one per tokenizer object) ``TokenTexts`` of ``tokenizer``."""
    cached = getattr(tokenizer, "_latentserve_token_texts", None)
    if cached is None:
        cached = TokenTexts(tokenizer)
        with contextlib.suppress(AttributeError):
            tokenizer._latentserve_token_texts = cached
    return cached


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob], as_ids: bool = False
                  ) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def top(tid: int, lp: float) -> dict:
        return {"token": texts.text(tid, as_ids), "logprob": lp, "bytes": list(texts.get(tid)[1])}

    return {"content": [{**top(t.token_id, t.logprob),
                         "top_logprobs": [top(i, v) for i, v in t.top]} for t in lps]}


def completion_logprobs(texts: TokenTexts, lps: list[TokenLogprob | None], offset: int,
                        as_ids: bool = False, token_ids: list[int] | None = None
                        ) -> tuple[dict, int]:
    """The legacy shape of ``lps`` (parallel lists, one entry per token; ``null`` logprobs for
    None, whose token is in ``token_ids``), and the offset after these tokens. Offsets start
    at ``offset`` characters; ``top_logprobs[i]``: the top k and the sampled token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for p, lp in enumerate(lps):
        token_id = lp.token_id if token_ids is None else token_ids[p]
        text, top = texts.text(token_id, as_ids), None
        if lp is not None:
            top = {texts.text(i, as_ids): v for i, v in lp.top}
            top.setdefault(text, lp.logprob)
        for key, value in zip(out, (text, None if lp is None else lp.logprob, top, offset)):
            out[key].append(value)
        offset += len(texts.get(token_id)[0])
    return out, offset


def echo_logprobs(texts: TokenTexts, prompt_ids: list[int],
                  prompt_lps: list[TokenLogprob | None] | None, as_ids: bool = False
                  ) -> dict:
    """The legacy shape for an echoed prompt; the first token (every one when ``prompt_lps``
    is None) has ``null`` logprobs, as in OpenAI's API."""
    lps = prompt_lps or []
    return completion_logprobs(texts, [lps[p] if p < len(lps) else None
                                       for p in range(len(prompt_ids))], 0, as_ids, prompt_ids)[0]
