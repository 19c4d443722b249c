"""The offline ``LLM`` API on a tiny model: stop strings, and a KV pool smaller than the
model's context."""

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
