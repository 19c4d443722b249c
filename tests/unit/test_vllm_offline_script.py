"""A vLLM user's offline script, unchanged apart from the import, on a tiny Llama: prompts
as strings, TextPrompt and TokensPrompt, ``get_tokenizer``, ``logprobs``,
``prompt_logprobs`` and ``n``; the values are checked against an HF reference forward."""

import pytest
import torch

# vLLM: from vllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from latentserve import LLM, SamplingParams, TextPrompt, TokensPrompt


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(model=str(tiny_dirs["llama"]))


def vllm_script(llm):
    """What a vLLM user writes (vLLM's docs: offline inference, logprobs)."""
    tokenizer = llm.get_tokenizer()
    prompts = [
        "Hello, my name is",
        TextPrompt(prompt="The capital of France is"),
        TokensPrompt(prompt_token_ids=tokenizer.encode("The future of AI is")),
    ]
    sampling_params = SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                     prompt_logprobs=2, ignore_eos=True)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
        for position in output.outputs[0].logprobs:
            for token_id, logprob in position.items():
                print(token_id, logprob.logprob, logprob.rank, logprob.decoded_token)
        for position in output.prompt_logprobs[1:]:
            print({t: lp.logprob for t, lp in position.items()})
    return outputs


def reference_logprobs(hf_models, model_dir, ids):
    """``[len(ids) - 1, vocab]``: row i is the log-softmax that scores ``ids[i + 1]``."""
    with torch.no_grad():
        logits = hf_models(model_dir)(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def check_position(entry, token_id, row, k, tokenizer):
    """One vLLM logprobs dict: the chosen token (its rank) plus the top k, with the
    reference's values and ranks and each token decoded on its own."""
    assert token_id in entry
    top_v, top_i = row.topk(k)
    assert set(entry) == {token_id, *top_i.tolist()}
    for rank, (t, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), start=1):
        assert entry[t].rank == rank
        assert entry[t].logprob == pytest.approx(v, abs=1e-4)
    assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=1e-4)
    assert entry[token_id].rank == int((row > row[token_id]).sum()) + 1
    assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())


def test_a_vllm_offline_script_runs_unchanged(llm, tiny_dirs, hf_models, capsys):
    outputs = vllm_script(llm)
    assert "Generated text" in capsys.readouterr().out
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    texts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    assert [o.prompt for o in outputs] == [texts[0], texts[1], None]
    for output, text in zip(outputs, texts):
        ids = output.prompt_token_ids
        assert ids == tokenizer.encode(text)
        (completion,) = output.outputs
        assert completion.index == 0 and completion.finish_reason == "length"
        assert completion.finished() and completion.lora_request is None
        assert (output.metrics, output.lora_request, output.encoder_prompt) == (None,) * 3
        full = ids + completion.token_ids
        ref = reference_logprobs(hf_models, tiny_dirs["llama"], full)
        # Greedy tokens equal the reference's argmax, and the text their decoding.
        assert completion.token_ids == ref[len(ids) - 1:].argmax(-1).tolist()
        assert completion.text == tokenizer.decode(completion.token_ids,
                                                   skip_special_tokens=True)
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for j, (entry, t) in enumerate(zip(completion.logprobs, completion.token_ids)):
            check_position(entry, t, ref[len(ids) - 1 + j], 3, tokenizer)
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)))
        assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
        for p in range(1, len(ids)):
            check_position(output.prompt_logprobs[p], ids[p], ref[p - 1], 2, tokenizer)
    llm.engine.cache.check_idle()
    radix = llm.engine.cache.radix
    assert radix.total_size() > 0 and llm.reset_prefix_cache() is True  # vLLM's
    assert radix.total_size() == 0
    llm.engine.cache.check_idle()
    with pytest.raises(ValueError, match="^reset_running_requests=True is not supported"):
        llm.reset_prefix_cache(reset_running_requests=True)


def test_n_gives_n_completions_seeded_as_vllm(llm):
    """``n=3`` gives ``outputs`` with index 0..2; with a seed, completion i is the n=1
    request with ``seed + i`` (vLLM's parallel sampling); ``prompt_logprobs`` once."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True,
                            prompt_logprobs=0)
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate("Once upon a time",
                            SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6,
                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
               for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)
    llm.engine.cache.check_idle()


def test_n_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="^n must be >= 1, got 0"):
        SamplingParams(n=0)


def test_the_engine_takes_one_completion_per_request(llm):
    with pytest.raises(ValueError, match="^n must be 1 for one engine request, got 2"):
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(n=2))


def test_use_tqdm_takes_a_tqdm_like_callable(llm):
    """vLLM's ``use_tqdm`` may be a callable (e.g. ``functools.partial(tqdm, ...)``):
    called with the total, updated once per finished prompt, closed."""
    calls = []

    class Bar:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs["total"]))

        def update(self, k):
            calls.append(("update", k))

        def close(self):
            calls.append(("close",))

    params = SamplingParams(n=2, temperature=0, max_tokens=2)
    llm.generate(["a", "b", "c"], params, use_tqdm=Bar)
    assert calls == [("init", 3)] + [("update", 1)] * 3 + [("close",)]


def test_stop_reason_names_the_stop_string_or_stop_token(llm):
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    full = llm.generate([[5, 6, 7, 8]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert full.stop_reason is None and full.finish_reason == "length"
    token = full.token_ids[3]
    by_id = llm.generate([[5, 6, 7, 8]], SamplingParams(stop_token_ids=[token], **greedy),
                         use_tqdm=False)[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", token)
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(token) + 1]
    stop = full.text[len(full.text) // 2:][:3]
    by_text = llm.generate([[5, 6, 7, 8]], SamplingParams(stop=[stop], **greedy),
                           use_tqdm=False)[0].outputs[0]
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop)


def test_a_prompt_dict_with_an_unsupported_key_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="prompt key 'multi_modal_data' is not supported"):
        llm.generate({"prompt": "hi", "multi_modal_data": {}}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_llm_takes_vllms_trust_remote_code_and_ignores_it(tiny_dirs, caplog):
    """``LLM(model, trust_remote_code=True)``, as vLLM scripts write it, loads (with the
    CLI's note) instead of a TypeError; other unknown options are still refused."""
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(tiny_dirs["llama"]), trust_remote_code=True, max_model_len=64)
    assert "trust_remote_code is ignored" in caplog.text
    assert llm.engine.max_model_len == 64
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model=str(tiny_dirs["llama"]), no_such_option=1)


def test_chat_takes_vllms_arguments_and_content_parts(llm):
    """vLLM's ``LLM.chat``: content as a list of text parts, ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template`` and ``tools``; ``prompt`` is the
    rendered prompt text."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=3)
    conv = [{"role": "user", "content": "Hi there"}]
    (plain,) = llm.chat(conv, greedy, use_tqdm=False)
    expected = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert plain.prompt == expected
    assert plain.prompt_token_ids == tok.encode(expected)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    (same,) = llm.chat(parts, greedy, use_tqdm=False)
    assert same.prompt_token_ids == plain.prompt_token_ids
    assert same.outputs[0].token_ids == plain.outputs[0].token_ids
    (no_gen,) = llm.chat(conv, greedy, use_tqdm=False, add_generation_prompt=False)
    assert no_gen.prompt == tok.apply_chat_template(conv, add_generation_prompt=False,
                                                    tokenize=False)
    cont = conv + [{"role": "assistant", "content": "Hello, I am"}]
    (cont_out,) = llm.chat(cont, greedy, use_tqdm=False, add_generation_prompt=False,
                           continue_final_message=True)
    assert cont_out.prompt.endswith("Hello, I am")
    (custom,) = llm.chat(conv, greedy, use_tqdm=False,
                         chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert custom.prompt == "<Hi there>"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    (with_tool,) = llm.chat(conv, greedy, use_tqdm=False, tools=[tool],
                            chat_template="{{ tools[0].function.name }}|{{ messages[0].content }}")
    assert with_tool.prompt == "get_weather|Hi there"
    with pytest.raises(ValueError, match="continue_final_message needs a final message"):
        llm.chat(conv, greedy, use_tqdm=False, add_generation_prompt=False,
                 continue_final_message=True)
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        llm.chat(cont, greedy, use_tqdm=False, continue_final_message=True)  # as vLLM
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], greedy, use_tqdm=False)
    llm.engine.cache.check_idle()


def test_bad_words_none_is_vllms_default():
    assert SamplingParams(bad_words=None).bad_words == []


def test_max_model_len_above_the_models_limit_is_served_at_the_limit_with_a_warning(
        tiny_dirs, caplog):
    """vLLM refuses a ``max_model_len`` above ``max_position_embeddings``; we serve the
    model's limit, and say so instead of lowering it silently."""
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(tiny_dirs["llama"]), max_model_len=100_000)
    assert llm.engine.max_model_len == 512
    assert "max_model_len 100000 is above the model's 512 positions" in caplog.text


def test_max_tokens_none_generates_until_the_context_is_full(tiny_dirs):
    """vLLM's ``SamplingParams(max_tokens=None)``: no output cap but ``max_model_len``."""
    from latentserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_dirs["llama"]), max_model_len=24)
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, temperature=0.0,
                                                         ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 24 - 4
    assert out.outputs[0].finish_reason == "length"
