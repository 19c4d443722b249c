"""One ``LLM.generate`` completion built from ``StepOutput``s: text, logprobs and stop reasons
(vLLM's ``vllm/outputs.py``, ``vllm/v1/engine/logprobs.py``)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from latentserve.detokenizer import IncrementalDetokenizer
from latentserve.models.checkpoint import NoTokenizer
from latentserve.outputs import CompletionOutput, Logprob, RequestOutput, StepOutput, TokenLogprob
from latentserve.sampling_params import SamplingParams
from latentserve.server.latent_trace import with_texts


def token_strings(tokenizer) -> SimpleNamespace:
    """``.text(token_id)``: ``tokenizer.decode([token_id])``, cached (None without a tokenizer),
    as ``server.latent_trace.with_texts`` reads it."""
    decode = None if isinstance(tokenizer, NoTokenizer) else tokenizer.decode
    return SimpleNamespace(text=functools.cache(lambda t: None if decode is None else decode([t])))


def logprob_dict(lp: TokenLogprob, strings: SimpleNamespace) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}``: the sampled token, then the top k (ranks 1..k)."""
    return {lp.token_id: Logprob(lp.logprob, lp.rank, strings.text(lp.token_id)), **{
        t: Logprob(v, rank, strings.text(t)) for rank, (t, v) in enumerate(lp.top, start=1)}}


class CompletionBuilder:
    """Turns one engine request's ``StepOutput``s into ``result.outputs[index]`` (index 0
    also fills the prompt's ``prompt_logprobs`` and ``num_cached_tokens``). Raises
    ``NoTokenizerError`` for stop strings without a tokenizer."""

    def __init__(self, result: RequestOutput, index: int, params: SamplingParams, tokenizer,
                 strings: SimpleNamespace, eos_ids) -> None:
        self.result, self.index, self.params = result, index, params
        self.strings, self.eos_ids = strings, eos_ids
        self.detok = IncrementalDetokenizer(tokenizer, result.prompt_token_ids, params.stop,
                                            params.skip_special_tokens,
                                            params.include_stop_str_in_output,
                                            params.min_tokens)
        self.completion = CompletionOutput(index, "", [], None,
                                           logprobs=None if params.logprobs is None else [],
                                           cumulative_logprob=(None if params.logprobs is None
                                                               else 0.0))
        self.finished = False

    def add(self, out: StepOutput) -> bool:
        """Take one step's output; True when a stop string just ended it (the caller aborts
        the engine request). Outputs after the end are ignored."""
        if self.finished:
            return False
        comp = self.completion
        comp.token_ids.extend(out.new_token_ids)
        comp.latent_steps = out.latent_steps
        if out.latent_stats is not None:  # settled phase, then the final output
            comp.latent_stats = out.latent_stats
        if out.finished:
            comp.latent_trace = with_texts(out.latent_trace, self.strings)
            comp.recurrence = out.recurrence
        if out.logprobs is not None and comp.logprobs is not None:
            for lp in out.logprobs:
                comp.logprobs.append(logprob_dict(lp, self.strings))
                comp.cumulative_logprob += lp.logprob
        if out.prompt_logprobs is not None and self.index == 0:
            self.result.prompt_logprobs = [None if lp is None else logprob_dict(lp, self.strings)
                                           for lp in out.prompt_logprobs]
        if self.index == 0:
            self.result.num_cached_tokens = out.num_cached_tokens
        text_ids = out.new_token_ids
        if (out.finished and out.finish_reason == "stop" and text_ids
                and not self.params.include_stop_str_in_output):
            text_ids = text_ids[:-1]  # the EOS / stop token is not text (vLLM)
        self.detok.add(text_ids)
        if self.detok.stopped is not None and not out.finished:
            self._finish("stop")
            return True
        if out.finished:
            self._finish(out.finish_reason)
        return False

    def _finish(self, reason: str | None) -> None:
        self.detok.flush()
        comp = self.completion
        comp.text, comp.finish_reason = self.detok.text, reason
        if self.detok.stopped is not None:
            comp.finish_reason, comp.stop_reason = "stop", self.detok.stopped
        elif reason == "stop" and comp.token_ids:
            last = comp.token_ids[-1]
            eos = last in self.eos_ids and not self.params.ignore_eos
            if last in self.params.stop_token_ids and not eos:
                comp.stop_reason = last
        self.finished = True
