"""The offline ``LLM`` API on a tiny model: stop strings, a KV pool smaller than the
model's context, and the latent fields of a completion."""

import re

import numpy as np
import pytest

from latentserve import LLM, SamplingParams


def test_stop_string_cuts_the_text_and_ends_with_stop(tiny_dirs):
    llm = LLM(model=str(tiny_dirs["llama"]))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=24,
                                                      ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    llm.engine.cache.check_idle()


def test_pool_smaller_than_context_lowers_max_model_len_instead_of_hanging(tiny_dirs):
    llm = LLM(model=str(tiny_dirs["llama"]), kv_slots=100, max_model_len=256)
    assert llm.engine.max_model_len == 100
    out = llm.generate([[28] * 90], SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 100 - 90
    llm.engine.cache.check_idle()


def test_offline_outputs_carry_latent_steps_and_trace(tmp_path, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    llm = LLM(model=str(save_latent_tiny(tmp_path, "coconut-gpt2")))
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]],
                        [SamplingParams(temperature=0, max_tokens=4, latent_budget=b,
                                        return_latent_trace=True) for b in (3, 0)],
                        use_tqdm=False)
    thinking, plain = outs[0].outputs[0], outs[1].outputs[0]
    assert thinking.latent_steps == 3 and len(thinking.latent_trace) == 3
    assert all(len(step["top_tokens"]) == 5 for step in thinking.latent_trace)
    tok = llm.get_tokenizer()
    assert all(step["top_texts"] == [tok.decode([t]) for t, _ in step["top_tokens"]]
               for step in thinking.latent_trace)
    assert plain.latent_steps == 0 and not plain.latent_trace
    llm.engine.cache.check_idle()


def test_a_refused_prompt_leaves_nothing_queued_and_the_llm_usable(tmp_path, smollm2_dir):
    """A budget over the cap in the second prompt: ValueError naming the field, the first
    prompt is not left queued, and the next call answers as a fresh one would."""
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    llm = LLM(model=str(save_latent_tiny(tmp_path, "coconut-gpt2")))
    good = SamplingParams(temperature=0, max_tokens=3, latent_budget=1)
    cap = llm.engine.latent_spec.max_budget
    with pytest.raises(ValueError, match="latent_budget"):
        llm.generate([[5, 6, 7], [5, 6, 8]],
                     [good, SamplingParams(temperature=0, max_tokens=3, latent_budget=cap + 1)],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.cache.check_idle()
    again = llm.generate([[5, 6, 7]], good, use_tqdm=False)[0].outputs[0]
    fresh = LLM(model=llm.engine.config.model).generate([[5, 6, 7]], good, use_tqdm=False)
    assert again.token_ids == fresh[0].outputs[0].token_ids and len(again.token_ids) == 3


def test_chat_template_kwargs_turn_a_heads_thinking_on_and_off(tmp_path, smollm2_dir):
    """``LLM.chat(..., chat_template_kwargs={"enable_thinking": False})`` turns the latent
    phase off, as the same kwargs do on ``/v1/chat/completions`` (``thinking`` too, a
    string "false" as well); a ``thinking`` set in the SamplingParams wins over them. Text
    parts are joined a line each."""
    from tests.support.head_models import save_head_model

    llm = LLM(model=str(save_head_model(tmp_path / "m")))
    conv = [{"role": "user", "content": "hi"}]
    p = SamplingParams(temperature=0, max_tokens=6, max_latent=2, use_stop=False,
                       min_output_tokens=0)

    def stats(params, kwargs):
        out = llm.chat(conv, params, use_tqdm=False, chat_template_kwargs=kwargs)
        return out[0].outputs[0].latent_stats

    assert stats(p, None)["steps"] == 2
    for kwargs in ({"enable_thinking": False}, {"thinking": False}, {"thinking": "false"}):
        s = stats(p, kwargs)
        assert (s["thinking"], s["steps"]) == (False, 0), kwargs
    assert stats(SamplingParams(**{**_fields(p), "thinking": True}),
                 {"enable_thinking": False})["steps"] == 2
    llm.engine.cache.check_idle()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    prompt = llm.chat(parts, SamplingParams(max_tokens=1, thinking=False), use_tqdm=False)[0]
    assert "Hi\nthere" in prompt.prompt  # text parts a line each, as vLLM joins them


def _fields(p):
    import dataclasses

    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def test_a_stop_string_keeps_a_heads_latent_stats(tmp_path, smollm2_dir):
    """Offline, a thinking request that a stop string ends (aborted, no final engine output)
    keeps the stats its latent phase ended with; the engine sends them once when the phase
    settles and again on a final output."""
    from tests.support.head_models import save_head_model

    llm = LLM(model=str(save_head_model(tmp_path / "m")))
    p = SamplingParams(temperature=0, max_tokens=12, max_latent=2, use_stop=False,
                       min_output_tokens=0, ignore_eos=True)
    full = llm.generate([[11, 12, 13, 14]], p, use_tqdm=False)[0].outputs[0]
    assert full.latent_stats["steps"] == 2 and full.finish_reason == "length"
    stop = full.text[len(full.text) // 2:][:3]
    cut = llm.generate([[11, 12, 13, 14]], SamplingParams(**{**_fields(p), "stop": [stop]}),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.text) < len(full.text)
    assert cut.latent_stats == full.latent_stats
    llm.engine.cache.check_idle()
    # In the engine: the settled stats once, then the final output's.
    eng = llm.engine
    eng.add_request("s", [11, 12, 13, 14], p)
    with_stats = []
    while eng.has_unfinished_requests():
        with_stats += [o.finished for o in eng.step() if o.latent_stats is not None]
    assert with_stats == [False, True]


def test_numpy_scalars_are_taken_as_python_numbers(tiny_dirs):
    """``SamplingParams`` built from numpy values (a common offline habit) holds plain Python
    ints and floats; a non-integer for an integer field is still refused by name."""
    import numpy as np

    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.0), seed=np.uint32(5),
                       top_k=np.int16(4), stop_token_ids=[np.int64(2)])
    assert (type(p.max_tokens), type(p.temperature), type(p.seed), type(p.top_k)) == \
        (int, float, int, int)
    assert p.stop_token_ids == [2] and type(p.stop_token_ids[0]) is int
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(3.0))
    out = LLM(model=str(tiny_dirs["llama"])).generate([[5, 6, 7]], p, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 3


@pytest.mark.parametrize("name", ["return_latent_trace", "ignore_eos", "skip_special_tokens",
                                  "stream_latent_steps", "include_stop_str_in_output"])
@pytest.mark.parametrize("value", ["no", 1])
def test_boolean_fields_take_a_boolean_only(name, value):
    """A truthy non-boolean (``"no"`` is truthy) is refused by name, as over HTTP."""
    with pytest.raises(ValueError, match=f"^{name} must be a boolean"):
        SamplingParams(**{name: value})


def test_offline_outputs_carry_a_recurrent_models_per_token_trace(tmp_path):
    """``LLM.generate`` with ``return_latent_trace`` on Ouro: each generated token's depth
    and readout step, equal to the eager reference's; a request that did not ask in the same
    batch has no trace; a model without a trace refuses the field by name."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from tests.support.recurrent_reference import OuroReference

    d = write_ouro(tmp_path / "ouro")
    prompt = [(7 * i + 11) % 900 + 20 for i in range(10)]
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    params = [SamplingParams(exit_criterion="threshold", exit_threshold=0.6,
                             return_latent_trace=True, **greedy),
              SamplingParams(exit_criterion="threshold", exit_threshold=0.6, **greedy),
              SamplingParams(latent_budget=3, exit_criterion="threshold-approx",
                             exit_threshold=0.5, return_latent_trace=True, **greedy)]
    llm = LLM(model=str(d))
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    ref = OuroReference(d)
    for (depth, mode, thr), out in zip([(4, "threshold", 0.6), (3, "threshold-approx", 0.5)],
                                       (outs[0].outputs[0], outs[2].outputs[0])):
        want = ref.generate(prompt, 6, depth, mode, thr)
        assert out.token_ids == want["tokens"]
        assert [(e["depth"], e["readout_step"]) for e in out.latent_trace] == \
            list(zip(want["iterations"], want["readouts"]))
        for e, pdf in zip(out.latent_trace, want["exit_probs"], strict=True):
            assert e["exit_probs"] == pytest.approx(pdf, abs=1e-4)
    assert outs[1].outputs[0].latent_trace is None
    assert outs[1].outputs[0].recurrence is not None  # the stats stay as they were
    llm.engine.cache.check_idle()


def test_offline_plain_model_refuses_return_latent_trace(tiny_dirs):
    llm = LLM(model=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match="^return_latent_trace needs"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, return_latent_trace=True),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_dicts_as_vllm_takes_them(tiny_dirs):
    """vLLM's TextPrompt ``{"prompt": str}`` and TokensPrompt ``{"prompt_token_ids": ids}``
    give what the string and the ids give; a dict with neither is a ValueError naming both."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("hello world")
    outs = llm.generate(["hello world", {"prompt": "hello world"}, {"prompt_token_ids": ids}],
                        greedy, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[1].prompt == "hello world" and outs[1].prompt_token_ids == ids
    with pytest.raises(ValueError, match="'prompt_token_ids'.*'prompt'"):
        llm.generate([{"text": "hello"}], greedy, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_k_ids(tiny_dirs):
    """vLLM's ``SamplingParams.truncate_prompt_tokens``: the last k ids (text or ids), -1
    the context; 0, below -1 or over ``max_model_len`` is a ValueError naming it."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    text = "one two three four five six"
    out = llm.generate([text, [5, 6, 7, 8, 9]],
                       SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3),
                       use_tqdm=False)
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(text)[-3:]
    assert out[0].prompt == text and out[1].prompt_token_ids == [7, 8, 9]
    assert llm.llm_engine is llm.engine  # vLLM's names, as its users reach the engine
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    with pytest.raises(ValueError, match="^stream_latent_steps needs a stream"):
        llm.generate([text], SamplingParams(stream_latent_steps=True), use_tqdm=False)
    whole = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)
    assert whole[0].prompt_token_ids == [5, 6, 7]
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(\d+\) is greater"):
        llm.generate([[5, 6]], SamplingParams(
            truncate_prompt_tokens=llm.engine.max_model_len + 1), use_tqdm=False)
    llm.engine.cache.check_idle()


@pytest.mark.parametrize(("conv", "tools", "path"), [
    ([{"role": "user", "content": "hi", "bogus": 1}], None, "messages[0].bogus"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}]}], None,
     "messages[0].content[0].colour"),
    ([{"role": "user", "content": "hi"}],
     [{"type": "function", "function": {"name": "f", "parameters": {}, "x": 1}}],
     "tools[0].function.x"),
])
def test_chat_refuses_an_unknown_nested_key_as_the_route_does(tiny_dirs, conv, tools, path):
    """``LLM.chat`` checks messages and tools as ``/v1/chat/completions`` does: an unknown
    key anywhere inside is a ValueError naming its path, never silently ignored."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match=re.escape(path)):
        llm.chat(conv, SamplingParams(max_tokens=2), use_tqdm=False, tools=tools)
    assert not llm.engine.has_unfinished_requests()


def test_bad_token_ids_are_refused_naming_them_and_leave_the_llm_usable(tiny_dirs):
    """Float, bool, negative and huge ids: a ValueError naming the prompt's ids before
    anything runs (a float once reached the forward, failing every later call); a step that
    raises takes its call's requests out of the engine; ``stop`` / ``stop_token_ids`` of
    the wrong type name themselves."""
    import numpy as np

    llm = LLM(model=str(tiny_dirs["llama"]))
    params = SamplingParams(max_tokens=2, temperature=0)
    for bad, message in (([1.5, 2], "must be integers, got 1.5"),
                         ([True, 5], "must be integers, got True"),
                         (np.array([1.0, 2.0]), "must be integers"),
                         ([1, -5], r"must be in \[0, \d+\), got -5"),
                         ([1, 2**64], r"must be in \[0, \d+\), got 18446744073709551616")):
        with pytest.raises(ValueError, match=f"^prompt token ids {message}"):
            llm.generate({"prompt_token_ids": bad}, params, use_tqdm=False)
    want = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": np.array([5, 6, 7])}, params,
                        use_tqdm=False)[0].outputs[0].token_ids == want
    steps = [0]
    step = llm.engine.step

    def flaky():
        steps[0] += 1
        if steps[0] == 2:
            raise RuntimeError("the forward failed")
        return step()

    llm.engine.step = flaky
    with pytest.raises(RuntimeError, match="the forward failed"):
        llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.step = step
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.engine.cache.check_idle()
    with pytest.raises(ValueError, match="^stop must be a string or a list of strings, got 5"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="^stop_token_ids must be a list of token ids, got 5"):
        SamplingParams(stop_token_ids=5)


def test_truncating_to_the_context_leaves_room_for_one_token(tiny_dirs):
    llm = LLM(model=str(tiny_dirs["llama"]))
    n = llm.engine.max_model_len
    for k in (-1, n):
        out = llm.generate([list(range(1, n + 40))], SamplingParams(
            max_tokens=3, truncate_prompt_tokens=k), use_tqdm=False)[0]
        assert out.prompt_token_ids == list(range(41, n + 40))  # the last n - 1 ids
        assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_vllm_options_that_change_nothing_are_taken_at_those_values(tiny_dirs):
    """A vLLM script's ``LLM(...)`` runs unchanged where its options change nothing here;
    a value that would change something is refused naming it."""
    llm = LLM(model=str(tiny_dirs["llama"]), disable_log_stats=True, swap_space=4,
              kv_cache_dtype="auto", tokenizer_mode="auto", enable_lora=False,
              quantization=None)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=1), use_tqdm=False)
    for name, value in (("kv_cache_dtype", "fp8"), ("enable_lora", True),
                        ("quantization", "awq"), ("tokenizer_mode", "slow")):
        with pytest.raises(ValueError, match=f"^{name}={value!r} is not supported"):
            LLM(model=str(tiny_dirs["llama"]), **{name: value})


def test_generate_and_chat_take_vllms_lora_request_priority_and_content_format(
        tiny_dirs):
    """``lora_request=None`` and ``priority`` None, 0 or one 0 per prompt (vLLM scripts
    pass them); a LoRA request, a non-zero priority or a priority list of another length is
    refused naming it, before anything runs; ``chat_template_content_format`` "auto" and
    "string" render alike, "openai" is refused."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    params = SamplingParams(max_tokens=2, temperature=0)
    want = llm.generate([[5, 6], [7]], params, use_tqdm=False)
    for priority in ([0, 0], 0, np.int64(0)):
        got = llm.generate([[5, 6], [7]], params, use_tqdm=False, lora_request=None,
                           priority=priority)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for kwargs, match in (({"lora_request": object()}, "^lora_request must be"),
                          ({"priority": [1]}, "^priority must be"),
                          ({"priority": 2}, "^priority must be"),
                          ({"priority": [0, 0]}, "^got 1 prompts but 2 priorities")):
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6]], params, use_tqdm=False, **kwargs)
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="^lora_request must be"):
        llm.chat(conv, params, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="^priority must be"):
        llm.chat(conv, params, use_tqdm=False, priority=1)
    with pytest.raises(ValueError, match="^chat_template_content_format='openai' is not"):
        llm.chat(conv, params, use_tqdm=False, chat_template_content_format="openai")
    chats = [llm.chat(conv, params, False, None, 0, chat_template_content_format=fmt)
             for fmt in ("auto", "string")]  # vLLM's positional order
    assert chats[0][0].outputs[0].token_ids == chats[1][0].outputs[0].token_ids
    with pytest.raises(TypeError):  # vLLM's generate takes use_tqdm by keyword only
        llm.generate([[5, 6]], params, False)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_normalise_as_vllms_and_refuse_positional_arguments():
    """``seed=-1`` is no seed, ``logprobs=True`` / ``prompt_logprobs=True`` are 1 (vLLM's
    ``__post_init__``); ``SamplingParams(2)``, ``n`` in vLLM's field order, is refused."""
    sp = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert (sp.seed, sp.logprobs, sp.prompt_logprobs) == (None, 1, 1)
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(2)


def test_vllm_sampling_fields_that_change_nothing_are_taken_at_those_values():
    """vLLM's ``best_of`` (None, 1 or n), ``detokenize``, ``spaces_between_special_tokens``
    and ``logits_processors`` at their defaults; other values are refused naming them;
    ``clone`` is a deep copy."""
    import dataclasses

    sp = SamplingParams(n=2, best_of=2, detokenize=True, spaces_between_special_tokens=True,
                        logits_processors=[], stop=["x"])
    copy = sp.clone()
    assert copy == sp and copy.stop is not sp.stop
    assert dataclasses.replace(sp, max_tokens=3).max_tokens == 3
    for name, value in (("best_of", 3), ("best_of", True), ("detokenize", False),
                        ("spaces_between_special_tokens", False),
                        ("logits_processors", [abs])):
        with pytest.raises(ValueError, match=f"^{name}=.* is not supported"):
            SamplingParams(n=2, **{name: value})


@pytest.mark.parametrize("field,value", [("max_latent", 4), ("min_latent", 2), ("use_stop", True),
                                         ("stop_threshold", 0.3), ("min_output_tokens", 10)])
def test_head_controls_on_a_model_without_a_head_are_refused(tiny_dirs, field, value):
    """A compression head's control on a plain model would do nothing: refused by the engine
    (offline as on the server), unless thinking is off, which makes them harmless."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match=f"^{field} needs a model with a compression head"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    off = SamplingParams(max_tokens=2, thinking=False, **{field: value})  # thinking off
    assert len(llm.generate([[5, 6, 7]], off, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_malformed_generate_arguments_are_refused_by_name(tiny_dirs):
    """A dict for ``sampling_params``, ``prompt_token_ids`` that is no list, and a seed whose
    ``seed + n - 1`` leaves the range are refused up front; numpy ids are ids."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    for bad in ({"temperature": 0}, [{"temperature": 0}], [SamplingParams(), None]):
        with pytest.raises(TypeError, match="^sampling_params must be a SamplingParams"):
            llm.generate(["a", "b"][:len(bad) if isinstance(bad, list) else 1], bad,
                         use_tqdm=False)
    for bad, name in ((5, "int"), (b"hi", "bytes"), (np.array([5, 6]), "ndarray")):
        with pytest.raises(TypeError, match=f"^prompts must be a prompt .* got {name}$"):
            llm.generate(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt_token_ids must be a list of token ids"):
        llm.generate({"prompt_token_ids": None}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^seed must be at most 9223372036854775806 with n=2"):
        llm.generate([[5, 6]], SamplingParams(n=2, seed=2**63 - 1, max_tokens=1),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b = llm.generate([[np.int64(5), 6, 7], [5, 6, 7]], greedy, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for prompt in ([np.int64(5), 6, 7], {"prompt_token_ids": np.array([5, 6, 7])}):
        ids = llm.generate(prompt, greedy, use_tqdm=False)[0].prompt_token_ids
        assert ids == [5, 6, 7] and all(type(t) is int for t in ids)


def test_generate_runs_without_the_server_stack(tiny_dirs):
    """``LLM.generate`` (and so ``latentserve eval``) imports no pydantic or FastAPI: only
    ``LLM.chat`` validates messages with the server's models (a GPU image without them ran
    training, then failed every evaluation)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['pydantic'] = sys.modules['fastapi'] = None; "
            "from latentserve import LLM, SamplingParams; "
            f"out = LLM(model={str(tiny_dirs['llama'])!r}).generate([[5, 6, 7]], "
            "SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(len(out[0].outputs[0].token_ids))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["2"], r.stderr[-2000:]


def test_params_changed_after_construction_are_checked_again(tiny_dirs):
    """A field set on a SamplingParams after it was built is checked (or normalized) as at
    construction when ``generate`` takes it, and the engine runs on a copy."""
    llm = LLM(model=str(tiny_dirs["llama"]))
    params = SamplingParams(temperature=0, max_tokens=2)
    for field, value in (("temperature", float("nan")), ("n", 0), ("seed", "a")):
        changed = SamplingParams(temperature=0, max_tokens=2)
        setattr(changed, field, value)
        with pytest.raises(ValueError, match=f"^{field} must be"):
            llm.generate([[5, 6, 7]], changed, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    params.stop_token_ids = None  # normalized to [] as at construction
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and params.stop_token_ids is None
