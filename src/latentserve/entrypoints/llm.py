"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from latentserve.config import EngineConfig
from latentserve.entrypoints.completion import CompletionBuilder, token_strings
from latentserve.models.checkpoint import NO_TOKENIZER, NoTokenizer, NoTokenizerError
from latentserve.outputs import RequestOutput
from latentserve.sampling_params import SEED_MAX, SamplingParams, prompt_tokens_kept

PromptType = str | list[int] | dict

# vLLM ``LLM`` options that change nothing here, at these values (None: at any value: stats
# are not logged offline; preemption recomputes, it never swaps); another value is refused.
VLLM_NO_EFFECT: dict[str, tuple | None] = {
    "disable_log_stats": None, "swap_space": None, "kv_cache_dtype": ("auto",),
    "tokenizer_mode": ("auto",), "enable_lora": (False,), "quantization": (None,)}


class LLM:
    """Run the engine in-process; ``engine_options`` are ``EngineConfig`` fields
    (``trust_remote_code`` is ignored; ``VLLM_NO_EFFECT``'s vLLM options are taken at values
    that change nothing, else a ValueError naming them). TypeError for an unknown option;
    ValueError or FileNotFoundError from loading."""

    def __init__(self, model: str | None = None, **engine_options):
        # NOTE: torch at construction: `from latentserve import LLM` stays light
        from latentserve.engine.llm_engine import LLMEngine

        if engine_options.pop("trust_remote_code", False):
            import logging

            logging.getLogger(__name__).warning(
                "trust_remote_code is ignored: latentserve runs no code from checkpoints")
        for name, allowed in VLLM_NO_EFFECT.items():
            if name in engine_options:
                value = engine_options.pop(name)
                if allowed is not None and value not in allowed:
                    raise ValueError(f"{name}={value!r} is not supported (only "
                                     f"{', '.join(map(repr, allowed))}, vLLM's default)")
        known = [f.name for f in dataclasses.fields(EngineConfig) if f.init]
        if unknown := [name for name in engine_options if name not in known]:
            hints = [f"{name} (did you mean {', '.join(close)}?)" if close else name
                     for name in unknown for close in [difflib.get_close_matches(name, known)]]
            raise TypeError(f"LLM got unknown engine option(s) {', '.join(hints)}; the options "
                            "are EngineConfig's fields (latentserve serve --help lists them as "
                            "flags)")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    @property
    def llm_engine(self):
        """The ``LLMEngine`` (vLLM's name for :attr:`engine`)."""
        return self.engine

    def get_tokenizer(self):
        """The engine's tokenizer (``NoTokenizer`` for a directory without tokenizer files)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh ``SamplingParams`` with the model's ``generation_config.json`` defaults
        (none with ``generation_config="vllm"``), as vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the radix prefix cache, its KV slots back to the pool (vLLM's): True, or False
        while a running request holds cached slots (never between calls here).
        ``reset_running_requests=True`` is refused (ValueError): requests finish first."""
        if reset_running_requests:
            raise ValueError("reset_running_requests=True is not supported: a running "
                             "request keeps its cached prefix until it finishes")
        radix = self.engine.cache.radix
        if radix.protected_size:
            return False
        radix.reset()
        return True

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | Callable[..., Any] = True, lora_request: None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order, each with ``params.n`` completions
        (choice i: ``seed + i``). A prompt is a string, token ids, or vLLM's ``{"prompt"}`` /
        ``{"prompt_token_ids"}``; ``sampling_params``: one, or one per prompt; a prompt is cut
        to its last ``truncate_prompt_tokens`` ids (-1: ``max_model_len``; at most
        ``max_model_len - 1``, which leaves the engine room for one output token). vLLM's
        ``lora_request`` is taken as None only (adapters are merged at load) and ``priority``
        (one, or one per prompt) as None or 0 (one queue, first come first served).
        ValueError (``NoTokenizerError`` for text without tokenizer files) before anything
        runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and _is_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt (a string, a list of token ids or a "
                            f"prompt dict) or a list of them, got {type(prompts).__name__}")
        _check_no_effect(lora_request, priority, len(prompts))
        sampling_params = self._params_list(sampling_params, len(prompts))
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling_params; pass one or one per prompt")
        encoded = [self._encode(p) for p in prompts]
        for j, params in enumerate(sampling_params):
            _check_fanout(params)
            keep = prompt_tokens_kept(params.truncate_prompt_tokens, self.engine.max_model_len)
            if keep is not None:
                # NOTE: the engine needs a free position for the output token; vLLM keeps
                # max_model_len ids and stops after one token
                keep = min(keep, self.engine.max_model_len - 1)
                encoded[j] = (encoded[j][0], encoded[j][1][-keep:])
        strings = token_strings(self.tokenizer)
        results: list[RequestOutput] = []
        running: dict[str, CompletionBuilder] = {}
        queued: list[str] = []
        try:
            for (text, ids), params in zip(encoded, sampling_params):
                result = RequestOutput(f"offline-{self._counter}", text, ids, [],
                                       finished=False)
                self._counter += 1
                for i, child in enumerate(_children(params)):
                    rid = f"{i}_{result.request_id}"
                    self.engine.add_request(rid, ids, child)  # checks the ids first
                    queued.append(rid)
                    running[rid] = CompletionBuilder(result, i, child, self.tokenizer, strings,
                                                     self.engine.eos_ids)
                    result.outputs.append(running[rid].completion)
                results.append(result)
        except Exception:  # a bad prompt or params: nothing of this call stays queued
            for rid in queued:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        if use_tqdm and not callable(use_tqdm) and len(results) > 1:
            from tqdm.auto import tqdm as use_tqdm
        bar = use_tqdm(total=len(results), desc="Processed prompts", unit="prompt") \
            if callable(use_tqdm) else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    builder = running.get(out.rid)
                    if builder is None or builder.finished:  # another call's, an abort's echo
                        continue
                    if builder.add(out):  # a stop string ended it
                        self.engine.abort_request(out.rid)
                    result = builder.result
                    if builder.finished and all(running[f"{i}_{result.request_id}"].finished
                                                for i in range(len(result.outputs))):
                        result.finished = True
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a step raised (or Ctrl-C): this call's requests leave the engine
            for rid, builder in running.items():
                if not builder.finished:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: None = None,
             priority: int | Sequence[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render one conversation or a list of them as ``/v1/chat/completions`` does (vLLM's
        ``LLM.chat`` arguments, in its order), then :meth:`generate`; template thinking sets
        unset ``params.thinking``. Message content reaches the template as a string
        (``chat_template_content_format`` "auto" or "string"; "openai", a list of parts, is
        refused). ValueError naming the message or field (``NoTokenizerError``);
        ``continue_final_message`` needs ``add_generation_prompt=False`` (as HF's template
        call, hence vLLM's ``LLM.chat``)."""
        # NOTE: latent.head imports torch (LLM imports it at construction, not at import);
        # the server's message models need pydantic, which generate() does not
        from pydantic import ValidationError

        from latentserve.latent.head import template_thinking
        from latentserve.server.errors import APIError
        from latentserve.server.latent_params import thinking_kwargs
        from latentserve.server.params import refuse_nested
        from latentserve.server.prompts import chat_conversation, chat_tools, render_chat
        from latentserve.server.protocol import ChatMessage, ChatTool

        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} "
                             "is not supported (only 'auto' or 'string': message content "
                             "reaches the template as a string)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False: "
                             "the final message is continued, no new one is opened")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        _check_no_effect(lora_request, priority, len(convs))
        sampling_params = self._params_list(sampling_params, len(convs))
        from_kwargs = template_thinking(chat_template_kwargs)
        if convs and isinstance(self.tokenizer, NoTokenizer):
            raise NoTokenizerError(NO_TOKENIZER)
        prompts = []
        for i, c in enumerate(convs):
            p = sampling_params[i] if i < len(sampling_params) else None
            if p is not None and p.thinking is None and from_kwargs is not None:
                sampling_params[i] = p = dataclasses.replace(p, thinking=from_kwargs)
            kwargs = thinking_kwargs(chat_template_kwargs, None if p is None else p.thinking)
            try:
                tool_list = None if tools is None else [ChatTool.model_validate(t) for t in tools]
                msgs = [ChatMessage.model_validate(m) for m in c]
                refuse_nested(msgs, "messages")  # as the route: no unknown key is ignored
                refuse_nested(tool_list, "tools")
                ids = render_chat(self.tokenizer, chat_conversation(msgs),
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  template_kwargs=kwargs, tools=chat_tools(tool_list),
                                  chat_template=chat_template)
            except APIError as exc:
                raise ValueError(exc.message) from None
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                raise ValueError(f"a chat message or tool is malformed at {where}: "
                                 f"{err['msg']}") from None
            prompts.append({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False),
                            "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _params_list(self, params, count: int) -> list[SamplingParams]:
        """``params`` as a list: None -> the defaults, one -> ``count`` of it; each checked
        again as at construction (a field set afterwards is refused or normalized as there)
        and copied, so a change after the call reaches no running request."""
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [dataclasses.replace(params)] * count
        many = isinstance(params, Sequence) and not isinstance(params, str)
        out = list(params) if many else [params]
        odd = [p for p in out if not isinstance(p, SamplingParams)]
        if odd:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one "
                            f"per prompt), got {type(odd[0]).__name__}")
        return [dataclasses.replace(p) for p in out]

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # vLLM's TokensPrompt, or its TextPrompt
            extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if extra and ("prompt" in prompt or "prompt_token_ids" in prompt):
                raise ValueError(f"prompt key {extra[0]!r} is not supported (a prompt dict "
                                 "takes 'prompt' and 'prompt_token_ids' only)")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                    raise ValueError(f"prompt_token_ids must be a list of token ids, got "
                                     f"{type(ids).__name__}")
                return prompt.get("prompt"), [int(t) if _is_id(t) else t for t in ids]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' (a list of ids) or "
                             f"'prompt' (a string), got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(map(_is_id, prompt)):
            return None, [int(t) for t in prompt]  # numpy's integers as Python's
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids' or 'prompt', got {type(prompt).__name__}")


def _is_id(t) -> bool:
    """A token id: an integer (numpy's too), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _check_fanout(params: SamplingParams) -> None:
    """ValueError naming ``seed`` when :func:`_children`'s ``seed + n - 1`` is past the range,
    or ``stream_latent_steps`` (whole outputs come back: nothing would stream)."""
    if params.stream_latent_steps:
        raise ValueError("stream_latent_steps needs a stream (the server's stream: true, or "
                         "LLMEngine.step's outputs); LLM.generate returns whole outputs")
    top = SEED_MAX - params.n + 1
    if params.seed is not None and params.seed > top:
        raise ValueError(f"seed must be at most {top} with n={params.n} (request i draws with "
                         f"seed + i, at most {SEED_MAX}), got {params.seed}")


def _children(params: SamplingParams) -> list[SamplingParams]:
    """One prompt's ``params.n`` engine requests: seed + i, prompt_logprobs on the first."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(params.n)]


def _check_no_effect(lora_request, priority, count: int) -> None:
    """ValueError naming ``lora_request`` (not None) or ``priority`` (not None, 0 or ``count``
    zeros): vLLM's per-request LoRA and priority scheduling, which this engine does not
    serve."""
    if lora_request is not None:
        raise ValueError("lora_request must be None: per-request LoRA adapters are not "
                         "served (a LoRA adapter directory is merged at load: "
                         "LLM(model=ADAPTER_DIR))")
    if priority is None:
        return
    if isinstance(priority, numbers.Integral):
        priority = [priority] * count
    elif len(priority := list(priority)) != count:
        raise ValueError(f"got {count} prompts but {len(priority)} priorities; pass one or "
                         "one per prompt")
    if any(p != 0 for p in priority):
        raise ValueError("priority must be None or 0: requests are served first come, "
                         "first served")
