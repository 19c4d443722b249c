"""The public shape of a latent trace: the engine's entries (``StepOutput.latent_trace``,
``latent/lens.py``) with decoded token strings, and the ``latent`` object of a choice and
of a streamed tick (``docs/server.md``, "Latent reasoning").
Design notes: docs/internals.md, "latentserve.server.latent_trace"."""

from __future__ import annotations


def with_texts(entries: list[dict] | None, texts) -> list[dict] | None:
    """Copies of trace ``entries`` with ``top_texts`` next to each ``top_tokens`` (``texts``:
    ``logprobs.TokenTexts``); the engine's dicts are not changed."""
    if entries is None:
        return None
    return [{**e, "top_texts": [texts.text(int(t)) for t, _ in e["top_tokens"]]}
            if isinstance(e, dict) and "top_tokens" in e else e for e in entries]


def tick_infos(delta, first_step: int, asked: bool, texts) -> list[dict]:
    """One ``latent`` object per step ``first_step + 1 .. delta.latent_steps`` of a tick:
    ``steps`` its 1-based number, ``trace`` (when ``asked``) ``[entry]`` or ``[]``."""
    return [{"steps": first_step + j + 1, "trace": ([] if e is None else [e]) if asked else None,
             "stats": None, "recurrence": None}
            for j, e in enumerate(with_texts(tick_entries(delta, first_step), texts))]


def tick_entries(delta, first_step: int) -> list[dict | None]:
    """The trace entries (or None) of a tick's steps ``first_step + 1 .. latent_steps``."""
    new = max(delta.latent_steps - first_step, 0)
    entries = list(delta.latent_trace or [])[-new:] if new else []
    return [None] * (new - len(entries)) + entries


def latent_info(final, asked: bool, texts) -> dict | None:
    """A choice's ``latent`` field (None: no latent work): ``steps`` run (0 for recurrent
    depth), a compression head's ``stats``; if ``asked``, the ``trace`` and recurrent depth's
    ``recurrence`` ``{"tokens", "mean_iterations", "histogram"}``."""
    if not asked and not final.latent_steps and final.latent_stats is None:
        return None
    return {"steps": final.latent_steps,
            "trace": with_texts(final.latent_trace, texts) if asked else None,
            "stats": final.latent_stats, "recurrence": final.recurrence if asked else None}
