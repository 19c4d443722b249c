"""The public shape of a latent trace: the engine's entries (``StepOutput.latent_trace``,
``latent/lens.py``) with decoded token strings, and the ``latent`` object a streamed tick
carries (``docs/server.md``, "Latent reasoning").

Design notes: docs/internals.md, "latentserve.server.latent_trace".
"""

from __future__ import annotations


def with_texts(entries: list[dict] | None, texts) -> list[dict] | None:
    """Copies of trace ``entries`` with ``top_texts`` next to each ``top_tokens`` (``texts``:
    the tokenizer's ``logprobs.TokenTexts``); None stays None. The engine's dicts are not
    changed (a delta's entries are also a choice's collected trace)."""
    if entries is None:
        return None
    out = []
    for e in entries:
        if isinstance(e, dict) and "top_tokens" in e:
            e = {**e, "top_texts": [texts.text(int(t)) for t, _ in e["top_tokens"]]}
        out.append(e)
    return out


def tick_infos(delta, first_step: int, asked: bool, texts) -> list:
    """One ``LatentInfo`` per step ``first_step + 1 .. delta.latent_steps`` of a tick:
    ``steps`` its 1-based number, ``trace`` (when ``asked``) ``[entry]`` or ``[]``."""
    from latentserve.server.protocol import LatentInfo

    new = max(delta.latent_steps - first_step, 0)
    entries = with_texts(list(delta.latent_trace or [])[-new:] if new else [], texts) or []
    entries = [None] * (new - len(entries)) + entries
    return [LatentInfo(steps=first_step + j + 1,
                       trace=([] if e is None else [e]) if asked else None)
            for j, e in enumerate(entries)]
