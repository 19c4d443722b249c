"""Where evaluation prompts go: the engine in-process, or an OpenAI-compatible server.

Design notes: docs/internals.md, "latentserve.eval.backends".
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from latentserve.config import EngineConfig
from latentserve.eval.datasets import chat_prompt_ids
from latentserve.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    text: str
    completion_tokens: int
    latent_steps: int
    latency_s: float
    finish_reason: str | None = None
    latent_end: str | None = None  # how a head's latent phase ended: stop, cap or length
    stats: dict | None = None  # the latent stats: the resolved head controls among them


@dataclass(frozen=True, slots=True)
class Request:
    """One evaluation prompt; ``max_tokens`` answer tokens (latent steps on top);
    ``max_latent`` None: thinking off."""

    user: str
    max_tokens: int
    max_latent: int | None = None


class EngineBackend:
    """Our ``LLMEngine`` in-process (``engine_options``: ``EngineConfig`` fields), one
    continuous batch, greedy; ``max_latent`` runs a head's closed loop with that cap."""

    def __init__(self, engine=None, **engine_options):
        if engine is None:
            from latentserve.engine.llm_engine import LLMEngine  # torch: not on the --url path

            engine = LLMEngine(EngineConfig(**engine_options))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.has_head = engine.latent_spec is not None and engine.latent_spec.kind == "head"
        self._ids = itertools.count()

    def _params(self, r: Request, head_controls: dict) -> SamplingParams:
        """The engine's sampling params of ``r``. ValueError for ``max_latent`` without a
        head."""
        if r.max_latent is not None and not self.has_head:
            raise ValueError("max_latent needs a model with a compression head "
                             "(--latent-head)")
        extra = {"thinking": r.max_latent is not None} if self.has_head else {}
        max_tokens = r.max_tokens
        if r.max_latent is not None:
            extra |= {"max_latent": r.max_latent, **head_controls}
            if "min_output_tokens" in self.engine.latent_spec.controls:
                extra["min_output_tokens"] = 0  # max_tokens counts the answer alone
            max_tokens += r.max_latent + len(self.engine.latent_spec.end_ids)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)

    def check(self, requests: list[Request], **head_controls) -> None:
        """The engine's checks of :meth:`run`'s requests, nothing queued; ValueError naming
        the field (a control out of range, ``max_latent`` without a head, ...)."""
        for r in requests:
            self.engine.check_request(chat_prompt_ids(self.tokenizer, r.user),
                                      self._params(r, head_controls))

    def run(self, requests: list[Request], **head_controls) -> list[Completion]:
        start, reqs = time.perf_counter(), {}
        for r in requests:
            rid = f"eval-{next(self._ids)}"
            reqs[rid] = r
            self.engine.add_request(rid, chat_prompt_ids(self.tokenizer, r.user),
                                    self._params(r, head_controls))
        toks: dict[str, list[int]] = {rid: [] for rid in reqs}
        done = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.rid not in reqs:
                    continue
                toks[o.rid] += o.new_token_ids
                if o.finished:
                    # The latent steps a stop head left unused would otherwise lengthen the
                    # answer (they share max_tokens): every answer gets at most max_tokens.
                    st, answer = o.latent_stats or {}, toks[o.rid][:reqs[o.rid].max_tokens]
                    done[o.rid] = Completion(
                        self.tokenizer.decode(answer, skip_special_tokens=True), len(answer),
                        st.get("steps", o.latent_steps) or 0, time.perf_counter() - start,
                        "length" if len(answer) < len(toks[o.rid]) else o.finish_reason,
                        st.get("end"), o.latent_stats)
        return [done[rid] for rid in reqs]


class OpenAIBackend:
    """An OpenAI-compatible chat server, ``concurrency`` requests in flight, greedy; the head
    controls go as latentserve's body fields, latent steps come from ``latent.steps``."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str = "none",
                 concurrency: int = 16, timeout: float = 600.0):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key, timeout=timeout)
        self.model = model or self.client.models.list().data[0].id
        self.concurrency = concurrency

    def _one(self, r: Request, start: float, controls: dict) -> Completion:
        body, headers = {}, None
        if r.max_latent is not None:
            body = {"thinking": True, "max_latent": r.max_latent, "min_output_tokens": 0,
                    **controls}
        else:  # text mode: a latentserve server with a head would think by default
            headers = {"x-latent-thinking": "false"}
        resp = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": r.user}],
            # latent steps and the closing ids spend max_tokens too; 8 covers the closing
            max_tokens=r.max_tokens + (r.max_latent + 8 if r.max_latent is not None else 0),
            temperature=0.0,
            extra_body=body or None, extra_headers=headers)
        ch = resp.choices[0]
        latent = (ch.model_extra or {}).get("latent") or {}
        return Completion(ch.message.content or "",
                          resp.usage.completion_tokens if resp.usage else 0,
                          int(latent.get("steps") or 0), time.perf_counter() - start,
                          ch.finish_reason, (latent.get("stats") or {}).get("end"),
                          latent.get("stats"))

    def run(self, requests: list[Request], **head_controls) -> list[Completion]:
        start = time.perf_counter()
        pool = ThreadPoolExecutor(self.concurrency)
        try:
            return list(pool.map(lambda r: self._one(r, start, head_controls), requests))
        finally:  # Ctrl-C: drop the queued requests (only the in-flight ones are awaited)
            pool.shutdown(wait=True, cancel_futures=True)
