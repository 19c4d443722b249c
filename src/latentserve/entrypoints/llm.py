"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence

from latentserve.config import EngineConfig
from latentserve.outputs import CompletionOutput, RequestOutput
from latentserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Run the engine in-process.

    Args:
        model: a Hugging Face-style directory, a ``.gguf`` file, or None for the embedded
            SmolLM2-135M-Instruct.
        **engine_options: any ``EngineConfig`` field (device, dtype, max_model_len,
            max_num_seqs, kv_slots, enable_prefix_caching, ...).

    Raises:
        TypeError for an unknown option; ValueError / FileNotFoundError from loading.
    """

    def __init__(self, model: str | None = None, **engine_options):
        from latentserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; returns one ``RequestOutput`` per prompt, in order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one for all prompts or one per prompt (default: vLLM's,
        ``SamplingParams()``). Raises ValueError for a bad prompt before anything runs (a
        model directory without tokenizer files takes token ids only: a string prompt or a
        stop string is ``models.checkpoint.NoTokenizerError``, and output text is empty).
        """
        from latentserve.detokenizer import IncrementalDetokenizer

        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling_params; pass one or one per prompt")
        encoded = [self._encode(p) for p in prompts]
        results: dict[str, RequestOutput] = {}
        detoks = {}
        sampling_of: dict[str, SamplingParams] = {}
        order = []
        for (text, ids), params in zip(encoded, sampling_params):
            rid = f"offline-{self._counter}"
            self._counter += 1
            try:
                detoks[rid] = IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, params.skip_special_tokens,
                    params.include_stop_str_in_output, params.min_tokens)
                self.engine.add_request(rid, ids, params)
            except Exception:  # a bad prompt or params: nothing of this call stays queued
                for queued in order:
                    self.engine.abort_request(queued)
                while self.engine.has_unfinished_requests():
                    self.engine.step()
                raise
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], None)],
                                         finished=False)
            sampling_of[rid] = params
            order.append(rid)
        bar = _progress(len(order), use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.rid not in results:  # not this call's (an earlier call's abort echo)
                    continue
                res, detok = results[out.rid], detoks[out.rid]
                if res.finished:  # ended here on a stop string; this is the abort's echo
                    continue
                comp = res.outputs[0]
                comp.token_ids.extend(out.new_token_ids)
                comp.latent_steps = out.latent_steps
                if out.latent_stats is not None:  # settled phase, then the final output
                    comp.latent_stats = out.latent_stats
                if out.finished:
                    comp.latent_trace, comp.recurrence = out.latent_trace, out.recurrence
                text_ids = out.new_token_ids
                if (out.finished and out.finish_reason == "stop" and text_ids
                        and not sampling_of[out.rid].include_stop_str_in_output):
                    text_ids = text_ids[:-1]  # the EOS / stop token is not text (vLLM)
                detok.add(text_ids)
                res.num_cached_tokens = out.num_cached_tokens
                finished, reason = out.finished, out.finish_reason
                if detok.stopped is not None and not finished:
                    self.engine.abort_request(out.rid)
                    finished, reason = True, "stop"
                if finished and not res.finished:
                    detok.flush()
                    comp.text = detok.text
                    comp.finish_reason = reason
                    res.finished = True
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of
        ``{"role", "content"}``) or a list of them, then ``generate``.

        As on ``/v1/chat/completions``, ``chat_template_kwargs`` ``thinking`` /
        ``enable_thinking`` turn a compression head's thinking on or off for the
        sampling params that leave ``thinking`` unset, and a ``thinking`` that is set is
        passed to the template under both names."""
        import dataclasses

        from latentserve.latent.head import template_thinking

        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(convs)
        sampling_params = list(sampling_params)
        from_kwargs = template_thinking(chat_template_kwargs)
        prompts = []
        for i, c in enumerate(convs):
            kwargs = dict(chat_template_kwargs or {})
            p = sampling_params[i] if i < len(sampling_params) else None
            if p is not None and p.thinking is None and from_kwargs is not None:
                sampling_params[i] = p = dataclasses.replace(p, thinking=from_kwargs)
            if p is not None and p.thinking is not None:  # the template renders the opening
                kwargs.update(thinking=p.thinking, enable_thinking=p.thinking)
            prompts.append({"prompt_token_ids": self._chat_ids(c, kwargs)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_ids(self, conv: list[dict], kwargs: dict) -> list[int]:
        out = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                 tokenize=True, **kwargs)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # vLLM's TokensPrompt, or its TextPrompt
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' (a list of ids) or "
                             f"'prompt' (a string), got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids' or 'prompt', got {type(prompt).__name__}")


def _progress(total: int, enabled: bool):
    if not enabled or total <= 1:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")
